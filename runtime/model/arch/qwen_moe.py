"""Qwen2-MoE (``qwen2_moe``: qkv bias, shared expert with a sigmoid gate) and Qwen3-MoE
(``qwen3_moe``: per-head q/k RMSNorm). Softmax -> top-k (optional renorm); MoE every
``decoder_sparse_step`` layers except ``mlp_only_layers``."""
from . import typed_sliding


def sliding_layers(d: dict, L: int):
    if not d.get("use_sliding_window", False):
        return []
    s = typed_sliding(d)
    if s is not None:
        return s
    if d["model_type"] == "qwen2_moe":   # the even-indexed layers below max_window_layers
        return [i for i in range(L) if i % 2 == 0 and i < int(d.get("max_window_layers", 28))]
    return list(range(L))


def config(d: dict, common: dict, need) -> dict:
    L, E = common["num_layers"], common["num_experts"]
    step = int(d.get("decoder_sparse_step", 1))
    only = set(d.get("mlp_only_layers") or [])
    moe = [i for i in range(L) if i not in only and E > 0 and (i + 1) % step == 0]
    kw = dict(dense_intermediate=int(need("intermediate_size")), expert_intermediate=int(need("moe_intermediate_size")),
              moe_layers=moe, norm_topk_prob=bool(d.get("norm_topk_prob", False)))
    if d["model_type"] == "qwen2_moe":
        return dict(**kw, qkv_bias=bool(d.get("qkv_bias", True)),
                    shared_intermediate=int(d.get("shared_expert_intermediate_size") or 0),
                    shared_expert_gate=bool(d.get("shared_expert_intermediate_size")))
    bias = bool(d.get("attention_bias", False))         # Qwen3's: on q, k, v and o
    return dict(**kw, qkv_bias=bias, o_bias=bias, qk_norm="head")
