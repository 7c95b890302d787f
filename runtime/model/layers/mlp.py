"""The dense MLPs: dense layers, and the shared experts beside a MoE block - SwiGLU (``DenseMLP``), or Nemotron-H's
ungated relu^2 (``UngatedMLP``), as ``MoEConfig.mlp_act`` says (``mlp_kind``)."""
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


class UngatedMLP(Sublayer):
    """Nemotron-H's MLP (its dense blocks and the shared expert): down(relu(up x)^2), no gate. Not a ``DenseMLP``: the
    fused decode's MLP kernel computes SwiGLU only, so a layer with this one runs composed (the protocol's
    refusal)."""

    def __init__(self, w: dict, prefix: str, limit: float = 0.0) -> None:
        up = take_raw(w, prefix + "up_proj.weight")
        self.inter = up.shape[0]
        self.up = Linear(up, None, compute_dtype(w, up), **linear_opts(w))
        self.down = Linear(take_raw(w, prefix + "down_proj.weight"), None, compute_dtype(w, up), **linear_opts(w))

    @staticmethod
    def tensors(prefix: str, inter: int, hidden: int) -> dict:
        return {prefix + "up_proj.weight": (inter, hidden), prefix + "down_proj.weight": (hidden, inter)}

    @staticmethod
    def shard_tensors(out: dict, prefix: str, inter: int, how: str, shard) -> None:
        """As ``DenseMLP.shard_tensors``: up by rows of the rank's part of the intermediate axis, down by the same
        columns (``split``), or whole on rank 0 (``rank0``)."""
        up, down = prefix + "up_proj.weight", prefix + "down_proj.weight"
        if how == "rank0":
            if shard.rank:
                out.pop(up, None)
                out.pop(down, None)
            return
        a, b = shard.part(inter)
        out[up], out[down] = rows(out[up], a, b), cols(out[down], a, b)

    def __call__(self, x: torch.Tensor, ctx=None) -> torch.Tensor:
        # x: [tokens, hidden]
        return self.down(torch.relu(self.up(x)).square())               # relu(up x)^2: [tokens, inter]


def mlp_kind(cfg):
    """The MLP class of a config's dense layers and shared experts (``mlp_act``)."""
    return UngatedMLP if cfg.mlp_act == "relu2" else DenseMLP
