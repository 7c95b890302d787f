"""Hunyuan 3 (``hy_v3``): GQA with biases on q/k/v/o (``attention_bias``) and per-head q/k RMSNorm before
RoPE over the whole head; a sigmoid router - top-k of sigmoid + correction bias, the sigmoid weights renormalised
and scaled by ``router_scaling_factor`` (one group) -, an ungated shared expert, dense layers from
``mlp_layer_types`` (transformers' default: the first). The release names the router ``mlp.router.gate``, its bias
``mlp.expert_bias`` and the shared expert ``mlp.shared_mlp`` (``stored_names``); the multi-token-prediction layer
after the last one is not read. Where config.json leaves them out, transformers' defaults: head_dim 128,
rope_theta 11158840, rms_norm_eps 1e-5, router scaling 2.826, one shared expert."""
from . import dense_intermediate, hf_defaults, moe_layers_of, renamed

# our name -> the release's (transformers' conversion mapping for hy_v3, reversed)
_RELEASED = ((".mlp.gate.weight", ".mlp.router.gate.weight"), (".mlp.e_score_correction_bias", ".mlp.expert_bias"),
             (".mlp.shared_experts.", ".mlp.shared_mlp."))


def sliding_layers(d: dict, L: int):
    return None


def stored_names(name: str) -> list:
    """Where a checkpoint may hold our tensor ``name``: as transformers names it in memory, or as released."""
    return renamed(name, _RELEASED)


def config(d: dict, common: dict, need) -> dict:
    L, src = common["num_layers"], common["source"]
    if d.get("mlp_bias"):
        raise ValueError(f"{src}: mlp_bias is not supported for hy_v3")
    hf_defaults(d, common, head_dim=128, rms_norm_eps=1e-5, rope_theta=11158840.0)
    moe = moe_layers_of(d, L, src)
    moe_inter = int(need("moe_intermediate_size"))
    bias = bool(d.get("attention_bias", False))
    return dict(dense_intermediate=dense_intermediate(moe, L, need), expert_intermediate=moe_inter, moe_layers=moe,
                router="sigmoid_group", norm_topk_prob=True,
                routed_scaling_factor=float(d.get("router_scaling_factor", 2.826)),
                shared_intermediate=moe_inter * int(d.get("num_shared_experts", 1) or 0),
                shared_prefix="mlp.shared_experts.", correction_bias_tensor="e_score_correction_bias",
                qkv_bias=bias, o_bias=bias, qk_norm="head")
