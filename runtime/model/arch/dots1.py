"""dots.llm1 (``dots1``): Qwen3's attention (GQA, per-head q/k RMSNorm, q/k/v/o biases with
``attention_bias``) with DeepSeek-V3's MoE (sigmoid router with a correction bias, group-limited
top-k, routed scaling, shared experts), dense first layers (``first_k_dense_replace``);
sliding-window layers by ``layer_types`` (transformers' default: from ``max_window_layers`` on)."""
from . import dense_intermediate, typed_sliding


def sliding_layers(d: dict, L: int):
    s = typed_sliding(d)
    return [i for i in range(L) if i >= int(d.get("max_window_layers") or L)] if s is None else s


def config(d: dict, common: dict, need) -> dict:
    L = common["num_layers"]
    first = int(d.get("first_k_dense_replace", 0) or 0)
    moe = [i for i in range(L) if i >= first]
    moe_inter = int(need("moe_intermediate_size"))
    bias = bool(d.get("attention_bias", False))
    return dict(dense_intermediate=dense_intermediate(moe, L, need), expert_intermediate=moe_inter,
                moe_layers=moe, router="sigmoid_group", n_group=int(d.get("n_group") or 1),
                topk_group=int(d.get("topk_group") or 1), norm_topk_prob=bool(d.get("norm_topk_prob", False)),
                routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
                shared_intermediate=moe_inter * int(d.get("n_shared_experts") or 0),
                shared_prefix="mlp.shared_experts.", qkv_bias=bias, o_bias=bias, qk_norm="head")
