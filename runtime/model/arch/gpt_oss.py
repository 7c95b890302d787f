"""gpt-oss (``gpt_oss``): GQA with q/k/v/o biases and attention sinks, alternating sliding / full
layers, a router with bias (top-k -> softmax), the clamped SwiGLU with expert biases; experts fused
per layer (``mlp.experts.gate_up_proj`` / MXFP4 ``*_blocks``; see convert)."""
from . import typed_sliding


def sliding_layers(d: dict, L: int):
    s = typed_sliding(d)
    return list(range(0, L, 2)) if s is None else s  # transformers' default: sliding, full, sliding, ...


def config(d: dict, common: dict, need) -> dict:
    inter = int(need("intermediate_size"))
    return dict(dense_intermediate=inter, expert_intermediate=inter,
                moe_layers=list(range(common["num_layers"])), router="topk_softmax", router_bias=True,
                router_tensor="router.weight", qkv_bias=bool(d.get("attention_bias", True)),
                o_bias=bool(d.get("attention_bias", True)), attn_sinks=True, expert_bias=True,
                expert_act="swiglu_clamp", swiglu_limit=float(d.get("swiglu_limit", 7.0)),
                swiglu_alpha=float(d.get("swiglu_alpha", 1.702)))
