"""Qwen3-Next (``qwen3_next``) and the Qwen3.5 MoE language model (``qwen3_5_moe_text``): Gated
DeltaNet linear attention and gated full attention (3:1), softmax -> top-k -> renorm routing with a
sigmoid-gated shared expert.

Full-attention layers: ``q_proj`` gives [q | gate] per head (the output is multiplied by
sigmoid(gate) before ``o_proj``), per-head q/k RMSNorm, RoPE on the first ``partial_rotary_factor``
of each head. Every RMSNorm but the DeltaNet's gated one scales by (1 + weight). Gated DeltaNet
layers live under ``linear_attn.``: Qwen3-Next fuses their projections per key head
(``in_proj_qkvz`` / ``in_proj_ba``), Qwen3.5 keeps them flat (``in_proj_qkv`` / ``in_proj_z`` /
``in_proj_b`` / ``in_proj_a``)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from . import check_layer_kinds, dense_intermediate

if TYPE_CHECKING:           # annotations only: the config module reads this one
    from ..config import MoEConfig

PARTIAL_ROTARY = True


def language_model(d: dict) -> dict:
    """The released Qwen3.5-MoE checkpoints are multimodal (``qwen3_5_moe``): the language model's
    config is ``text_config`` and its tensors live under ``model.language_model.``; the vision tower
    (``model.visual.``) is not read. The multi-token-prediction head (``mtp.``: ``mtp_layers`` below) is read by
    convert into the store's ``mtp/`` part for ``--speculative mtp`` (runtime/model/mtp.py)."""
    if d.get("model_type") != "qwen3_5_moe":
        return d
    if not isinstance(d.get("text_config"), dict):
        raise ValueError("qwen3_5_moe config.json has no text_config (the language model's configuration)")
    t = dict(d["text_config"])
    t.setdefault("tie_word_embeddings", d.get("tie_word_embeddings", False))
    return {**t, "model_type": "qwen3_5_moe_text", "lm_prefix": "model.language_model."}


def sliding_layers(d: dict, L: int):
    return None


def config(d: dict, common: dict, need) -> dict:
    L, source = common["num_layers"], common["source"]
    kinds = d.get("layer_types")
    if kinds is None:   # transformers' default: every full_attention_interval-th layer is full attention
        every = int(d.get("full_attention_interval") or 4)
        kinds = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(L)]
    check_layer_kinds(kinds, d, source)
    step = int(d.get("decoder_sparse_step", 1) or 1)
    only = set(d.get("mlp_only_layers") or [])
    moe = [i for i in range(L) if i not in only and (i + 1) % step == 0]
    if d["model_type"] == "qwen3_5_moe_text":   # every layer is MoE (no decoder_sparse_step / mlp_only_layers)
        moe = list(range(L))
    shared = int(d.get("shared_expert_intermediate_size") or 0)
    # Qwen3.5's router always renormalises the top-k weights (it has no norm_topk_prob).
    renorm = True if d["model_type"] == "qwen3_5_moe_text" else bool(d.get("norm_topk_prob", True))
    return dict(dense_intermediate=dense_intermediate(moe, L, need),
                expert_intermediate=int(need("moe_intermediate_size")), moe_layers=moe, norm_topk_prob=renorm,
                qkv_bias=bool(d.get("attention_bias", False)), qk_norm="head",
                shared_intermediate=shared, shared_expert_gate=bool(shared), attn_output_gate=True, norm_offset=1.0,
                linear_layers=[i for i, k in enumerate(kinds) if k == "linear_attention"],
                linear_kind="gated_deltanet", linear_prefix="linear_attn.",
                linear_num_heads=int(need("linear_num_key_heads")), linear_head_dim=int(need("linear_key_head_dim")),
                linear_num_v_heads=int(need("linear_num_value_heads")),
                linear_value_head_dim=int(need("linear_value_head_dim")),
                linear_conv_kernel=int(d.get("linear_conv_kernel_dim") or 4))


def linear_names(cfg: MoEConfig, layer: int) -> dict:
    """A Gated DeltaNet layer's tensors -> shape (the layout of cfg.model_type)."""
    lin = cfg.linear
    Hk, Dk, Hv, Dv = lin.num_heads, lin.head_dim, lin.num_v_heads, lin.value_head_dim
    D, W, p = cfg.hidden_size, lin.conv_kernel, f"model.layers.{layer}.linear_attn."
    conv = 2 * Hk * Dk + Hv * Dv                      # q | k | v through one short convolution
    if cfg.model_type == "qwen3_5_moe_text":
        out = {p + "in_proj_qkv.weight": (conv, D), p + "in_proj_z.weight": (Hv * Dv, D),
               p + "in_proj_b.weight": (Hv, D), p + "in_proj_a.weight": (Hv, D)}
    else:
        out = {p + "in_proj_qkvz.weight": (conv + Hv * Dv, D), p + "in_proj_ba.weight": (2 * Hv, D)}
    out.update({p + "conv1d.weight": (conv, 1, W), p + "dt_bias": (Hv,), p + "A_log": (Hv,), p + "norm.weight": (Dv,),
                p + "out_proj.weight": (D, Hv * Dv)})
    return out


# The multi-token-prediction head (``mtp_num_hidden_layers``; vLLM's qwen3_next_mtp.py): ``mtp.fc`` (our eh_proj) over
# concat(pre_fc_norm_embedding(embed), pre_fc_norm_hidden(h)), full-attention MoE decoder layers ``mtp.layers.{j}.*``,
# ``mtp.norm`` before the model's lm_head (no head or embedding of its own); every norm a (1 + weight) one. vLLM
# chains the output after ``mtp.norm`` into the next draft (DeepSeek's chains it before shared_head.norm).
MTP_PARTS = {"eh_proj.weight": "fc.weight", "enorm.weight": "pre_fc_norm_embedding.weight",
             "hnorm.weight": "pre_fc_norm_hidden.weight", "shared_head.norm.weight": "norm.weight"}
MTP_CHAIN_NORMED = True


def mtp_layers(d: dict) -> int:
    return int(d.get("mtp_num_hidden_layers", d.get("num_nextn_predict_layers")) or 0)


def mtp_name(j: int, part: str) -> str:
    """The release's name of MTP layer j's tensor ``part`` (our name below ``model.layers.{L + j}.``)."""
    return "mtp." + MTP_PARTS[part] if part in MTP_PARTS else f"mtp.layers.{j}.{part}"
