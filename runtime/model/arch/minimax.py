"""MiniMax-Text-01 / MiniMax-M1 (``minimax``): lightning attention (linear attention with a fixed decay per head:
runtime/model/lightning_attention.py) and softmax attention layers (Mixtral's GQA with RoPE; transformers' default
alternates them, the releases put one softmax layer after seven lightning ones), Mixtral's MoE on every layer
(softmax -> top-k -> renormalise, experts as ``block_sparse_moe.experts.N.w1/w3/w2``), and a residual stream that
carries the normed input: x = a * norm(x) + b * sublayer(norm(x)) with (a, b) per sublayer kind
(``norm_placement`` normed; the releases set a = (2 x layers) ** 0.25, DeepNorm's). The released configs'
names - ``attn_type_list`` (0: lightning, 1: softmax) and ``layernorm_*_alpha`` / ``_beta`` - are read too."""
from __future__ import annotations

from typing import TYPE_CHECKING

from . import check_layer_kinds, hf_defaults, mixtral

if TYPE_CHECKING:           # annotations only: the config module reads this one
    from ..config import MoEConfig

sliding_layers = mixtral.sliding_layers


def layer_kinds(d: dict, L: int, source: str) -> list:
    kinds = d.get("layer_types")
    if kinds is None and d.get("attn_type_list") is not None:
        kinds = ["full_attention" if int(t) == 1 else "linear_attention" for t in d["attn_type_list"]]
    if kinds is None:       # transformers' default: softmax on even layers, lightning on odd ones
        kinds = ["full_attention" if (i + 1) % 2 else "linear_attention" for i in range(L)]
    return check_layer_kinds(kinds, d, source)


def _scales(d: dict, ours: str, released: str) -> tuple:
    """(alpha, beta) of one sublayer kind: transformers' field names, else the release's, else 1."""
    return tuple(float(d.get(f"{ours}_{ab}_factor", d.get(f"layernorm_{released}_{ab}", 1.0))) for ab in ("alpha", "beta"))


def config(d: dict, common: dict, need) -> dict:
    L = common["num_layers"]
    hf_defaults(d, common, rms_norm_eps=1e-5, rope_theta=1e6)
    if d.get("postnorm") is False:
        raise ValueError(f"{common['source']}: postnorm false (pre-norm MiniMax) is not supported: the releases and "
                         f"transformers carry the normed input")
    kinds = layer_kinds(d, L, common["source"])
    out = mixtral.config(d, common, need)
    out.update(linear_layers=[i for i, k in enumerate(kinds) if k == "linear_attention"], linear_kind="lightning",
               linear_num_heads=common["num_heads"], linear_head_dim=common["head_dim"], norm_placement="normed",
               residual_scales={"attention": _scales(d, "full_attn", "full_attention"),
                                "linear": _scales(d, "linear_attn", "linear_attention"),
                                "ffn": _scales(d, "mlp", "mlp")})
    return out


def linear_names(cfg: MoEConfig, layer: int) -> dict:
    """A lightning-attention layer's tensors -> shape (transformers' names, the release's too)."""
    lin = cfg.linear
    HD, D, p = lin.num_heads * lin.head_dim, cfg.hidden_size, f"model.layers.{layer}.self_attn."
    return {p + "qkv_proj.weight": (3 * HD, D), p + "output_gate.weight": (HD, D), p + "norm.weight": (HD,),
            p + "out_proj.weight": (D, HD)}
