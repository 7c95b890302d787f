"""The protocol every sublayer kind follows (attention kinds, FFN kinds and the tensor-parallel wrappers).

A sublayer is built once from the config and the checkpoint's tensors, and then only computes:
``__call__(x [tokens, hidden], ctx) -> [tokens, hidden]``. Which implementation computes it - the torch
ops, a host kernel, CUDA - is decided when it is built (vLLM's CustomOp idea), never per call.

``fused_refusal`` tells the fused CPU decode (layers/fused.py, a GQA attention + MoE layer in two host
kernel calls) whether it can take this sublayer: None where it can, else the reason (kept per layer
in ``MoEModel.fused_why``). Kinds the kernel covers override it; every other kind inherits the refusal."""
from __future__ import annotations


class Sublayer:
    reads_rope_heads = False   # GQA layers read cos / sin broadcast over heads: the model builds them per forward

    def fused_refusal(self) -> "str | None":
        return f"{type(self).__name__} has no fused host decode"
