"""The dense SwiGLU MLP: dense layers, and the shared experts beside a MoE block."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .dense import Linear
from .weights import compute_dtype, linear_opts, take_raw
from .protocol import Sublayer, cols, rows


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

    @staticmethod
    def shard_tensors(out: dict, prefix: str, inter: int, how: str, shard) -> None:
        """A rank's part of the MLP at ``prefix`` in ``out``: ``split`` - gate and up by rows of its part of the
        intermediate axis, down by the same columns (its output a partial sum); ``rank0`` - rank 0 keeps it
        whole, the others drop it (they add nothing to the all-reduce)."""
        names = [prefix + n for n in ("gate_proj.weight", "up_proj.weight", "down_proj.weight")]
        if how == "rank0":
            if shard.rank:
                for n in names:
                    out.pop(n, None)
            return
        a, b = shard.part(inter)
        out[names[0]], out[names[1]] = rows(out[names[0]], a, b), rows(out[names[1]], a, b)
        out[names[2]] = cols(out[names[2]], a, b)

    def __call__(self, x: torch.Tensor, ctx=None) -> torch.Tensor:
        # x: [tokens, hidden]
        h = self.gate_up(x)                                              # h: [tokens, 2 inter]
        return self.down(self._act(h[:, :self.inter], h[:, self.inter:]))

    def _swiglu(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return F.silu(g) * u

    def _swiglu_clamped(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return F.silu(g.clamp(max=self.limit)) * u.clamp(-self.limit, self.limit)
