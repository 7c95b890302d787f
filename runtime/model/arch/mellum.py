"""Mellum (``mellum``, JetBrains' Mellum 2): Qwen3-MoE's attention (per-head q/k RMSNorm, biases on q/k/v/o with
``attention_bias``) with sliding-window layers (``layer_types``) and a RoPE per layer type - ``rope_parameters``
keyed by ``full_attention`` / ``sliding_attention`` (defaults: theta 5e5 / 1e4): the full layers' RoPE is the model's
(default or YaRN), the sliding layers' a default RoPE of their own theta (``sliding_rope_theta``) -; softmax ->
top-k (renormalised with ``norm_topk_prob``), dense layers from ``mlp_layer_types``. The multi-token-prediction
layers (``mtp.``) are not read."""
from . import dense_intermediate, hf_defaults, moe_layers_of, typed_sliding

KINDS = ("full_attention", "sliding_attention")
DEFAULT_THETA = {"full_attention": 5e5, "sliding_attention": 1e4}


def language_model(d: dict) -> dict:
    """The per-type RoPE: the full layers' as the model's ``rope_parameters``, the sliding layers' aside."""
    rope = dict(d.get("rope_parameters") or {})
    if rope and set(rope) <= set(KINDS):
        full = dict(rope.get("full_attention") or {"rope_type": "default"})
        full.setdefault("rope_theta", DEFAULT_THETA["full_attention"])
        d = {**d, "rope_parameters": full, "sliding_rope_parameters": rope.get("sliding_attention")}
    elif not rope:
        d = {**d, "rope_parameters": {"rope_type": "default", "rope_theta": DEFAULT_THETA["full_attention"]},
             "sliding_rope_parameters": {"rope_type": "default", "rope_theta": DEFAULT_THETA["sliding_attention"]}}
    return d


def sliding_layers(d: dict, L: int):
    s = typed_sliding(d)
    return s if s is not None else []


def config(d: dict, common: dict, need) -> dict:
    L, src = common["num_layers"], common["source"]
    hf_defaults(d, common, head_dim=128)
    slide = dict(d.get("sliding_rope_parameters") or {"rope_type": "default", "rope_theta": common["rope_theta"]})
    if (slide.get("rope_type") or "default") != "default" or float(slide.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError(f"{src}: mellum's sliding-layer RoPE {slide!r} is not supported (a default RoPE over the "
                         f"whole head is)")
    theta = float(slide.get("rope_theta", DEFAULT_THETA["sliding_attention"]))
    own = sliding_layers(d, L) and (theta != common["rope_theta"] or common["rope_scaling"])
    moe = moe_layers_of(d, L, src, 0)
    bias = bool(d.get("attention_bias", False))
    return dict(dense_intermediate=dense_intermediate(moe, L, need), expert_intermediate=int(need("moe_intermediate_size")),
                moe_layers=moe, norm_topk_prob=bool(d.get("norm_topk_prob", True)), qk_norm="head", qkv_bias=bias,
                o_bias=bias, sliding_rope_theta=theta if own else 0.0)
