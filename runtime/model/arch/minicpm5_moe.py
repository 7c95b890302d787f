"""MiniCPM5-MoE (``minicpm5_moe``): Llama attention (biases on q/k/v/o with ``attention_bias``, RoPE over the
whole head) with a sigmoid output gate per channel - ``q_proj`` gives [q | gate] per head, as Qwen3-Next's, and
transformers requires it (``use_gated_attention``) - and DeepSeek-V3's MoE: sigmoid router with a correction
bias, group-limited top-k, renormalised, routed scaling, shared experts, dense layers from ``mlp_layer_types``
(else the first ``first_k_dense_replace``). Where config.json leaves them out, transformers' defaults: head_dim 128,
rope_theta 5e6, routed scaling 3.66, one dense layer, one shared expert."""
from . import dense_intermediate, hf_defaults, moe_layers_of


def sliding_layers(d: dict, L: int):
    return None


def config(d: dict, common: dict, need) -> dict:
    L, src = common["num_layers"], common["source"]
    if d.get("use_gated_attention", True) is False:
        raise ValueError(f"{src}: minicpm5_moe without gated attention (use_gated_attention false) is not a model "
                         f"transformers runs")
    hf_defaults(d, common, head_dim=128, rope_theta=5e6)
    moe = moe_layers_of(d, L, src, int(d.get("first_k_dense_replace", 1)))
    moe_inter = int(need("moe_intermediate_size"))
    bias = bool(d.get("attention_bias", False))
    return dict(dense_intermediate=dense_intermediate(moe, L, need), expert_intermediate=moe_inter, moe_layers=moe,
                router="sigmoid_group", n_group=int(d.get("n_group") or 1), topk_group=int(d.get("topk_group") or 1),
                norm_topk_prob=bool(d.get("norm_topk_prob", True)),
                routed_scaling_factor=float(d.get("routed_scaling_factor", 3.66)),
                shared_intermediate=moe_inter * int(d.get("n_shared_experts", 1) or 0),
                shared_prefix="mlp.shared_experts.", qkv_bias=bias, o_bias=bias, attn_output_gate=True)
