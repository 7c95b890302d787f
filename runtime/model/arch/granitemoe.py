"""Granite MoE (``granitemoe``, Granite 3.x MoE): Llama attention (biases on q/k/v/o with ``attention_bias``) and
Mixtral's experts on every layer under ``block_sparse_moe`` - top-k of the router's logits, then softmax over those
k -, with Granite's scalars: the embeddings x ``embedding_multiplier``, the attention scale
``attention_multiplier`` (not head_dim ** -0.5), each sublayer's output x ``residual_multiplier``, the logits /
``logits_scaling`` (folded into the weights at load: moe.fold_scales). The checkpoint's fused experts
``block_sparse_moe.input_linear`` [E, 2I, H] (gate rows, then up) and ``output_linear``, its router
``router.layer``; transformers' names read too."""
from . import renamed

# our name -> the release's (transformers' conversion mapping for granitemoe, reversed)
RELEASED = ((".block_sparse_moe.experts.gate_up_proj", ".block_sparse_moe.input_linear.weight"),
            (".block_sparse_moe.experts.down_proj", ".block_sparse_moe.output_linear.weight"),
            (".block_sparse_moe.router.weight", ".block_sparse_moe.router.layer.weight"))


def sliding_layers(d: dict, L: int):
    return None


def stored_names(name: str) -> list:
    return renamed(name, RELEASED)


def scalars(d: dict) -> dict:
    """Granite's multipliers as MoEConfig takes them (the routed experts' through routed_scaling_factor)."""
    r = float(d.get("residual_multiplier", 1.0))
    return dict(embedding_multiplier=float(d.get("embedding_multiplier", 1.0)), residual_multiplier=r,
                routed_scaling_factor=r, attention_multiplier=float(d.get("attention_multiplier", 1.0)),
                logits_scaling=float(d.get("logits_scaling", 1.0)))


def config(d: dict, common: dict, need) -> dict:
    inter = int(need("intermediate_size"))
    bias = bool(d.get("attention_bias", False))
    return dict(dense_intermediate=inter, expert_intermediate=inter, moe_layers=list(range(common["num_layers"])),
                router="topk_softmax", mlp_prefix="block_sparse_moe.", router_tensor="router.weight",
                qkv_bias=bias, o_bias=bias, **scalars(d))
