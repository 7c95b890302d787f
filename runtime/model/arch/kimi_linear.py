"""Kimi-Linear (``kimi_linear``, moonshotai/Kimi-Linear-48B-A3B): Kimi Delta Attention layers and MLA
layers without RoPE (3:1), DeepSeek-V3's MoE (sigmoid router with a correction bias, group-limited
top-k, shared experts) under ``block_sparse_moe`` with experts as ``experts.N.w1/w3/w2``."""
from __future__ import annotations

from typing import TYPE_CHECKING

from . import check_layer_kinds

if TYPE_CHECKING:           # annotations only: the config module reads this one
    from ..config import MoEConfig


def sliding_layers(d: dict, L: int):
    return None


def config(d: dict, common: dict, need) -> dict:
    """Layer kinds come from ``layer_types`` (transformers) or the released checkpoint's
    ``linear_attn_config`` (1-indexed ``kda_layers`` / ``full_attn_layers``)."""
    L, source = common["num_layers"], common["source"]
    lac = d.get("linear_attn_config") or {}
    kinds = d.get("layer_types")
    if kinds is None and ("kda_layers" in lac or "full_attn_layers" in lac):
        kinds = [None] * L
        for key, kind in (("full_attn_layers", "full_attention"), ("kda_layers", "linear_attention")):
            for n in lac.get(key) or []:
                if not 1 <= int(n) <= L:
                    raise ValueError(f"{source}: linear_attn_config.{key} names layer {n}, outside 1..{L} (1-indexed)")
                kinds[int(n) - 1] = kind
    elif kinds is None:   # transformers' default: full attention every 4th layer from layer 4
        kinds = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(L)]
    check_layer_kinds(kinds, d, source)
    mlp = d.get("mlp_layer_types")
    if mlp is None:
        first, freq = int(d.get("first_k_dense_replace", 1) or 0), int(d.get("moe_layer_freq", 1) or 1)
        mlp = ["sparse" if i >= first and i % freq == 0 else "dense" for i in range(L)]
    if len(mlp) != L or any(t not in ("dense", "sparse") for t in mlp):
        raise ValueError(f"{source}: mlp_layer_types must give 'dense' or 'sparse' for each of {L} layers, got {mlp!r}")
    if d.get("mla_use_nope") is False:
        raise ValueError(f"{source}: mla_use_nope false (MLA with RoPE in Kimi-Linear) is not supported")
    act = d.get("moe_router_activation_func", "sigmoid")
    if act != "sigmoid":
        raise ValueError(f"{source}: moe_router_activation_func {act!r} is not supported (sigmoid is)")
    rope_dim = int(need("qk_rope_head_dim"))
    common["head_dim"] = rope_dim
    moe_inter = int(need("moe_intermediate_size"))
    shared = int(d.get("num_shared_experts", d.get("n_shared_experts")) or 0)
    return dict(dense_intermediate=int(need("intermediate_size")), expert_intermediate=moe_inter,
                moe_layers=[i for i, t in enumerate(mlp) if t == "sparse"], router="sigmoid_group",
                n_group=int(d.get("num_expert_group", d.get("n_group")) or 1), topk_group=int(d.get("topk_group") or 1),
                norm_topk_prob=bool(d.get("moe_renormalize", d.get("norm_topk_prob", True))),
                routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
                shared_intermediate=moe_inter * shared, shared_prefix="block_sparse_moe.shared_experts.",
                mlp_prefix="block_sparse_moe.", expert_tensors=("w1", "w3", "w2"), attention="mla", qkv_bias=bool(d.get("attention_bias", False)),
                q_lora_rank=int(d.get("q_lora_rank") or 0), kv_lora_rank=int(need("kv_lora_rank")),
                qk_rope_head_dim=rope_dim, qk_nope_head_dim=int(need("qk_nope_head_dim")),
                v_head_dim=int(need("v_head_dim")), mla_rope=False,
                # tiered-moe extensions for the K3-shaped synthetic checkpoint (synthetic.py):
                latent_dim=int(d.get("moe_latent_size") or 0),
                attn_res_block_layers=int(d.get("attn_res_block_layers") or 0),
                linear_layers=[i for i, k in enumerate(kinds) if k == "linear_attention"],
                linear_num_heads=int(lac.get("num_heads") or d.get("linear_num_heads") or 0),
                linear_head_dim=int(lac.get("head_dim") or d.get("linear_head_dim") or 0),
                linear_conv_kernel=int(lac.get("short_conv_kernel_size") or d.get("linear_conv_kernel_dim") or 4))


def linear_names(cfg: MoEConfig, layer: int) -> dict:
    """A Kimi Delta Attention layer's tensors (released Kimi-Linear names, which transformers also saves)
    -> shape."""
    lin = cfg.linear
    H, K, D, W = lin.num_heads, lin.head_dim, cfg.hidden_size, lin.conv_kernel
    HK, p = H * K, f"model.layers.{layer}.self_attn."
    out = {p + f"{n}_proj.weight": (HK, D) for n in "qkv"}
    out.update({p + f"{n}_conv1d.weight": (HK, 1, W) for n in "qkv"})
    out.update({p + "f_a_proj.weight": (K, D), p + "f_b_proj.weight": (HK, K), p + "dt_bias": (HK,),
                p + "A_log": (1, 1, H, 1), p + "b_proj.weight": (H, D), p + "g_a_proj.weight": (K, D),
                p + "g_b_proj.weight": (HK, K), p + "o_norm.weight": (K,), p + "o_proj.weight": (D, HK)})
    return out
