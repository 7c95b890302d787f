"""The dense SwiGLU MLP: dense layers, and the shared experts beside a MoE block."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .dense import Linear
from .weights import compute_dtype, linear_opts, take_raw
from .protocol import Sublayer


class DenseMLP(Sublayer):
    """SwiGLU: down(silu(gate x) * up x); ``limit`` > 0 (DeepSeek-V4's shared expert): gate clamped
    from above and up to +-limit first."""

    def __init__(self, w: dict, prefix: str, limit: float = 0.0) -> None:
        self.limit = float(limit)
        self._act = self._swiglu_clamped if self.limit else self._swiglu     # picked once
        gate, up = take_raw(w, prefix + "gate_proj.weight"), take_raw(w, prefix + "up_proj.weight")
        self.inter = gate.shape[0]
        self.gate_up = Linear(torch.cat([gate, up]), None, compute_dtype(w, gate), **linear_opts(w))   # [gate | up]
        self.down = Linear(take_raw(w, prefix + "down_proj.weight"), None, compute_dtype(w, gate), **linear_opts(w))

    @staticmethod
    def tensors(prefix: str, inter: int, hidden: int) -> dict:
        return {prefix + "gate_proj.weight": (inter, hidden), prefix + "up_proj.weight": (inter, hidden),
                prefix + "down_proj.weight": (hidden, inter)}

    def __call__(self, x: torch.Tensor, ctx=None) -> torch.Tensor:
        # x: [tokens, hidden]
        h = self.gate_up(x)                                              # h: [tokens, 2 inter]
        return self.down(self._act(h[:, :self.inter], h[:, self.inter:]))

    def _swiglu(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return F.silu(g) * u

    def _swiglu_clamped(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return F.silu(g.clamp(max=self.limit)) * u.clamp(-self.limit, self.limit)
