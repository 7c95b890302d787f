"""ERNIE 4.5 MoE (``ernie4_5_moe``): GQA without q/k norms, RoPE on interleaved channel pairs, a
softmax router whose top-k is chosen on the probabilities plus a correction bias
(``mlp.moe_statics.e_score_correction_bias``, stored [1, E]) and renormalised, shared experts; MoE
on every ``moe_layer_interval``-th layer from ``moe_layer_start_index`` to ``moe_layer_end_index``.

Its multi-token-prediction layer (``num_nextn_predict_layers``: 1 in the -PT releases) is read by convert into the
store's ``mtp/`` part for ``--speculative mtp`` (runtime/model/mtp.py; ``mtp_name`` below maps the release's names):
``model.mtp_emb_norm.{j}`` / ``mtp_hidden_norm.{j}`` (enorm / hnorm), ``mtp_linear_proj.{j}`` (eh_proj, over
concat(embeddings, hidden) - embeddings first), ``mtp_block.{j}.*`` a decoder layer whose FFN is a dense MLP of
intermediate_size (``MTP_MOE``: the release's Paddle model builds it as decoder layer j < moe_layer_start_index,
transformers' MtpModel / SGLang's ernie4_eagle.py alike), and the model's own final norm ``model.norm`` before the
head (transformers' ``_keys_shared_with_mtp``; the Paddle model norms every MTP output with it). Its q/k rows are
reordered as the model's (``mtp_stored``).

The interleaved RoPE needs no change to the forward pass: conversion reorders each q and k head's
rows (channel pairs (2i, 2i+1) -> (i, i + head_dim / 2)), the same permutation on both, so the
rotate-half RoPE on the reordered heads gives the same q.k products as transformers' interleaved one."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from . import dense_intermediate

if TYPE_CHECKING:           # annotations only: the config module reads this one
    from ..config import MoEConfig

NORM_MIN = 1e-12          # the renormalisation's floor the router implements (transformers' default moe_norm_min)


def sliding_layers(d: dict, L: int):
    return None


def config(d: dict, common: dict, need) -> dict:
    L, src = common["num_layers"], common["source"]
    if d.get("use_bias"):
        raise ValueError(f"{src}: use_bias (biases on the attention and MLP projections) is not supported for ernie4_5_moe")
    if float(d.get("moe_norm_min", NORM_MIN)) != NORM_MIN:
        raise ValueError(f"{src}: moe_norm_min {d['moe_norm_min']} is not supported for ernie4_5_moe ({NORM_MIN} is)")
    idx = {}
    for key, default in (("moe_layer_start_index", 1), ("moe_layer_end_index", -1), ("moe_layer_interval", 1)):
        v = d.get(key, default)
        if not isinstance(v, int):   # the VL release gives a [text, vision] pair
            raise ValueError(f"{src}: {key} {v!r} is not supported for ernie4_5_moe (an integer is)")
        idx[key] = v
    start, end, every = idx["moe_layer_start_index"], idx["moe_layer_end_index"], idx["moe_layer_interval"]
    end = L - 1 if end == -1 else end
    if every < 1:
        raise ValueError(f"{src}: moe_layer_interval {every} must be positive")
    moe = [i for i in range(L) if (i + 1) % every == 0 and start <= i <= end]
    moe_inter = int(need("moe_intermediate_size"))
    return dict(dense_intermediate=dense_intermediate(moe, L, need), expert_intermediate=moe_inter,
                moe_layers=moe, router="softmax_bias", norm_topk_prob=True,
                correction_bias_tensor="moe_statics.e_score_correction_bias",
                shared_intermediate=moe_inter * int(d.get("moe_num_shared_experts") or 0),
                shared_prefix="mlp.shared_experts.")


def deinterleave_rows(w: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """A q or k projection [heads * head_dim, ...] with each head's output rows reordered from
    interleaved pairs to halves: new row j < head_dim / 2 is old 2j, new row head_dim / 2 + j is old 2j + 1."""
    order = torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])
    return w.reshape(heads, head_dim, *w.shape[1:])[:, order].reshape(w.shape).contiguous()


def convert_dense(cfg: MoEConfig, dense: dict) -> None:
    """The converted dense tensors, in place: q and k projections into the rotate-half channel order."""
    for i in cfg.attention_layers:
        for proj, heads in (("q_proj", cfg.num_heads), ("k_proj", cfg.num_kv_heads)):
            name = f"model.layers.{i}.self_attn.{proj}.weight"
            dense[name] = deinterleave_rows(dense[name], heads, cfg.head_dim)


# The multi-token-prediction layer (see the docstring). Chaining: transformers' MtpModel hands the next draft the
# output after the norm (its post_norm, here model.norm), the state the first draft reads of the target too.
MTP_MOE = False
MTP_CHAIN_NORMED = True
MTP_PARTS = {"enorm.weight": "mtp_emb_norm", "hnorm.weight": "mtp_hidden_norm", "eh_proj.weight": "mtp_linear_proj"}


def mtp_layers(d: dict) -> int:
    return int(d.get("num_nextn_predict_layers") or 0)


def mtp_name(j: int, part: str) -> str:
    """The release's name of MTP layer j's tensor ``part`` (our name below ``model.layers.{L + j}.``)."""
    if part in MTP_PARTS:
        return f"model.{MTP_PARTS[part]}.{j}.weight"
    if part == "shared_head.norm.weight":
        return "model.norm.weight"             # the model's final norm, shared
    return f"model.mtp_block.{j}.{part}"


def mtp_stored(cfg: MoEConfig, name: str, t: torch.Tensor) -> torch.Tensor:
    """An MTP tensor as read from the release -> as the store keeps it: q / k rows reordered as convert_dense's."""
    if name.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight")):
        heads = cfg.num_heads if name.endswith("q_proj.weight") else cfg.num_kv_heads
        return deinterleave_rows(t, heads, cfg.head_dim)
    return t
