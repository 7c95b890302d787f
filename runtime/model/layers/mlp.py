"""The dense SwiGLU MLP: dense layers, and the shared experts beside a MoE block."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .weights import take


class DenseMLP:
    def __init__(self, w: dict, prefix: str) -> None:
        self.gate, self.up, self.down = (take(w, prefix + "gate_proj.weight"), take(w, prefix + "up_proj.weight"),
                                         take(w, prefix + "down_proj.weight"))

    @staticmethod
    def tensors(prefix: str, inter: int, hidden: int) -> dict:
        return {prefix + "gate_proj.weight": (inter, hidden), prefix + "up_proj.weight": (inter, hidden),
                prefix + "down_proj.weight": (hidden, inter)}

    def __call__(self, x: torch.Tensor, ctx=None) -> torch.Tensor:
        # x: [tokens, hidden]
        return F.linear(F.silu(F.linear(x, self.gate)) * F.linear(x, self.up), self.down)
