"""The empty sublayer of a layer that has one sublayer only (``MoEConfig.empty_attn_layers`` / ``empty_ffn_layers``):
Nemotron-H's blocks are a mixer or an FFN alone, and pair onto our layers (arch/nemotron_h.py) except where a mixer
has no FFN block after it or an FFN block no mixer before it. An empty sublayer adds nothing, takes no tensor and
no norm, and caches nothing; the decoder layer skips it (residual.DecoderLayer), so it costs no op.

Tensor-parallel ranks split nothing of it (its ``head_split`` says why), and the fused decode refuses its layer
(the fused kernels run an attention and an FFN)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .protocol import HeadSplit, Sublayer


@dataclass(frozen=True)
class NoCacheSpec:
    """What an empty attention caches: nothing (PagedKV gives its layer a cache without tensors)."""

    def cache_tensors(self) -> dict:
        return {}


class Absent(Sublayer):
    """An empty sublayer: in the attention's place (built as attention kinds are: cfg, layer, tensors) or the FFN's."""
    empty = True

    def __init__(self, cfg=None, i: "int | None" = None, w: "dict | None" = None) -> None:
        self.i = i

    def __call__(self, x: torch.Tensor, ctx=None) -> torch.Tensor:
        return torch.zeros_like(x)      # what it adds (the decoder layer does not call it)

    def fused_refusal(self) -> str:
        return "a layer with one sublayer (the fused kernels run an attention and an FFN)"

    @classmethod
    def head_split(cls, cfg, shard) -> HeadSplit:
        return HeadSplit(why="no attention in this layer")

    @staticmethod
    def tensors(cfg, i: int) -> dict:
        return {}

    @staticmethod
    def cache_spec(cfg, i: int) -> NoCacheSpec:
        return NoCacheSpec()
