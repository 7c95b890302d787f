"""Sublayers of a tensor-parallel rank (runtime/parallel/shard.py decides who splits what).

A split sublayer computes a partial sum of its output from the rank's slice of the weights; ``Reduced``
all-reduces it into the whole, so the residual stream - and everything computed from it (routing,
placement, the next layer's input) - is the same on every rank. ``Skipped`` stands for a dense MLP that
does not split evenly and that rank 0 computes alone: the others contribute zeros to the sum."""
from __future__ import annotations

import torch

from .protocol import Sublayer


class Reduced(Sublayer):
    """``inner``'s output, summed over the ranks by ``reduce`` (an in-place all-reduce)."""

    def __init__(self, inner, reduce) -> None:
        self.inner, self.reduce = inner, reduce

    def __call__(self, x: torch.Tensor, ctx=None) -> torch.Tensor:
        y = self.inner(x, ctx).contiguous()                               # y: [tokens, hidden], this rank's part
        self.reduce(y)
        return y

    @property
    def reads_rope_heads(self) -> bool:
        return self.inner.reads_rope_heads

    def fused_refusal(self) -> str:
        return "split over tensor-parallel ranks (the fused layer has no place for the all-reduce)"

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


class Skipped(Sublayer):
    """A sublayer another rank computes: zeros of x's shape."""

    def __call__(self, x: torch.Tensor, ctx=None) -> torch.Tensor:
        return torch.zeros_like(x)
