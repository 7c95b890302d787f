"""The protocol every sublayer kind follows (attention kinds, FFN kinds and the tensor-parallel wrappers).

A sublayer is built once from the config and the checkpoint's tensors, and then only computes:
``__call__(x [tokens, hidden], ctx) -> [tokens, hidden]``. Which implementation computes it - the torch
ops, a host kernel, CUDA - is decided when it is built (vLLM's CustomOp idea), never per call.

``fused_refusal`` tells the fused CPU decode (layers/fused.py, an attention + MoE layer in two host
kernel calls) whether it can take this sublayer: None where it can, else the reason (kept per layer
in ``MoEModel.fused_why``). Kinds the kernel covers override it and name their kernel in ``fused_part``;
every other kind inherits the refusal.

Tensor parallelism (runtime/parallel/shard.py plans it, vLLM's column / row parallel linears): an attention
kind says whether its heads split over ``world`` ranks (``head_split``: the rank's config fields, or why
not - then every rank runs the layer whole) and cuts its checkpoint tensors to a rank's heads
(``shard_tensors``); the default is to replicate."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class HeadSplit:
    """How an attention kind's heads split over tensor-parallel ranks: ``why`` they do not (empty: they split),
    the rank's config fields (``changes``), and for GQA the global kv heads the rank keeps."""
    why: str = ""
    changes: dict = field(default_factory=dict)
    kv_heads: "tuple | None" = None


def rows(t: torch.Tensor, a: int, b: int) -> torch.Tensor:
    """Rows [a, b) of t (a column-parallel cut: output features)."""
    return t[a:b].contiguous()


def cols(t: torch.Tensor, a: int, b: int) -> torch.Tensor:
    """Columns [a, b) of t (a row-parallel cut: input features; the outputs are partial sums)."""
    return t[:, a:b].contiguous()


class Sublayer:
    reads_rope_heads = False   # GQA layers read cos / sin broadcast over heads: the model builds them per forward
    empty = False              # an empty sublayer (layers/absent.py): adds nothing, the decoder layer skips it
    fused_part = None          # the attention kinds the fused decode takes: their key in layers/fused.py's ATTENTION_PARTS

    def fused_refusal(self) -> "str | None":
        return f"{type(self).__name__} has no fused host decode"

    @classmethod
    def head_split(cls, cfg, shard) -> HeadSplit:
        """Whether this kind's heads split over ``shard.world`` ranks, and the rank's config fields if so."""
        return HeadSplit(why=f"{cls.__name__} does not split its heads")

    @staticmethod
    def shard_tensors(cfg, i: int, out: dict, plan) -> None:
        """Cut layer ``i``'s tensors in ``out`` (name -> tensor, changed in place) to the rank's heads; called
        only where ``head_split`` said they split."""
        raise NotImplementedError
