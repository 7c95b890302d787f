"""Granite 4 hybrids (``granitemoehybrid``: granite-4.0-h-tiny / -small): Mamba-2 layers (runtime/model/mamba2.py,
under ``mamba.``) and Llama attention layers (``layer_types``: linear_attention / full_attention, or the releases'
mamba / attention), each followed by ``granitemoeshared``'s MoE - top-k of the router's logits then softmax, the
fused experts ``block_sparse_moe.input_linear`` / ``output_linear`` and an ungated ``shared_mlp`` - with Granite's
scalars. The attention layers take RoPE only with ``position_embedding_type`` rope (the releases: none, NoPE)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from . import check_layer_kinds, granitemoeshared

if TYPE_CHECKING:           # annotations only: the config module reads this one
    from ..config import MoEConfig

sliding_layers = granitemoeshared.sliding_layers
stored_names = granitemoeshared.stored_names
sliced = granitemoeshared.sliced
RELEASED_KINDS = {"mamba": "linear_attention", "attention": "full_attention"}


def check_time_step_limit(value, src: str) -> None:
    """Mamba-2's dt clamp (``time_step_limit``, None: the default): refused unless the default (0, inf)."""
    # transformers writes the infinite bound as {"__float__": "Infinity"} (JSON has no inf)
    limit = tuple(float(v["__float__"] if isinstance(v, dict) else v) for v in (value or (0.0, float("inf"))))
    if limit != (0.0, float("inf")):
        raise ValueError(f"{src}: time_step_limit {list(limit)} is not supported (transformers clamps dt in its prefill "
                         f"scan but not in its decode step; only the default (0, inf) reads alike in both)")


def config(d: dict, common: dict, need) -> dict:
    L, src = common["num_layers"], common["source"]
    kinds = [RELEASED_KINDS.get(k, k) for k in (d.get("layer_types") or d.get("layers_block_type")
                                                 or ["linear_attention"] * L)]
    check_layer_kinds(kinds, d, src)
    if not int(d.get("num_local_experts", 8) or 0):
        raise ValueError(f"{src}: num_local_experts 0 (a dense Granite 4 hybrid) is not a mixture of experts")
    check_time_step_limit(d.get("time_step_limit"), src)
    H = int(d.get("mamba_n_heads", 128))
    inner = int(d.get("mamba_expand", 2)) * common["hidden_size"]
    head = d.get("mamba_d_head", "auto")
    head = inner // H if head in (None, "auto") else int(head)
    if H * head != inner:
        raise ValueError(f"{src}: mamba_n_heads {H} x mamba_d_head {head} is not mamba_expand x hidden_size ({inner})")
    attention = [i for i, k in enumerate(kinds) if k == "full_attention"]
    return dict(granitemoeshared.config(d, common, need),
                linear_layers=[i for i, k in enumerate(kinds) if k == "linear_attention"], linear_kind="mamba2",
                linear_prefix="mamba.", linear_num_heads=H, linear_head_dim=head,
                linear_num_groups=int(d.get("mamba_n_groups", 1)), linear_state_dim=int(d.get("mamba_d_state", 256)),
                linear_conv_kernel=int(d.get("mamba_d_conv", 4)), linear_conv_bias=bool(d.get("mamba_conv_bias", True)),
                linear_proj_bias=bool(d.get("mamba_proj_bias", False)),
                nope_layers=[] if d.get("position_embedding_type") == "rope" else attention)


def linear_names(cfg: MoEConfig, layer: int) -> dict:
    """A Mamba-2 layer's tensors -> shape (transformers' names, the release's)."""
    lin = cfg.linear
    inner, GN, H, D = lin.num_heads * lin.head_dim, lin.num_groups * lin.state_dim, lin.num_heads, cfg.hidden_size
    conv, p = inner + 2 * GN, f"model.layers.{layer}.mamba."
    out = {p + "in_proj.weight": (inner + conv + H, D), p + "conv1d.weight": (conv, 1, lin.conv_kernel),
           p + "dt_bias": (H,), p + "A_log": (H,), p + "D": (H,), p + "norm.weight": (inner,),
           p + "out_proj.weight": (D, inner)}
    if lin.conv_bias:
        out[p + "conv1d.bias"] = (conv,)
    if lin.proj_bias:
        out.update({p + "in_proj.bias": (inner + conv + H,), p + "out_proj.bias": (D,)})
    return out
