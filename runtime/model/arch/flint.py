"""Flint (``flint``): Qwen3-MoE's attention (per-head q/k RMSNorm, q/k/v/o biases with ``attention_bias``) with
attention sinks on every layer, a sliding window on the ``layer_types`` sliding layers - the only ones with RoPE:
full-attention layers use none (NoPE) -, a sigmoid router without a correction bias (top-k of the sigmoid scores,
renormalised with ``norm_topk_prob``), an ungated shared expert added in full, MoE on the layers Qwen3-MoE's rule
picks (not ``mlp_only_layers``; every ``decoder_sparse_step``-th). The release names the sinks
``self_attn.softmax_offset``. Where config.json leaves them out, transformers' defaults: head_dim 128, the first
two layers dense, the sliding layers of its rule."""
from . import dense_intermediate, hf_defaults, renamed, typed_sliding

RELEASED = ((".self_attn.sinks", ".self_attn.softmax_offset"),)


def sliding_layers(d: dict, L: int):
    s = typed_sliding(d)     # transformers' default: full on the first two, every fourth from 1, and the last
    return s if s is not None else [i for i in range(L) if not (i < 2 or i % 4 == 1 or i == L - 1)]


def stored_names(name: str) -> list:
    return renamed(name, RELEASED)


def config(d: dict, common: dict, need) -> dict:
    L = common["num_layers"]
    hf_defaults(d, common, head_dim=128)
    step = int(d.get("decoder_sparse_step", 1))
    only = set(d.get("mlp_only_layers") if d.get("mlp_only_layers") is not None else [0, 1])
    moe = [i for i in range(L) if i not in only and (i + 1) % step == 0]
    bias = bool(d.get("attention_bias", False))
    sliding = sliding_layers(d, L)
    return dict(dense_intermediate=dense_intermediate(moe, L, need), expert_intermediate=int(need("moe_intermediate_size")),
                moe_layers=moe, router="sigmoid_group", norm_topk_prob=bool(d.get("norm_topk_prob", True)),
                correction_bias_tensor="", shared_intermediate=int(d.get("shared_expert_intermediate_size", 1024) or 0),
                qk_norm="head", qkv_bias=bias, o_bias=bias, attn_sinks=True,
                nope_layers=[i for i in range(L) if i not in sliding])
