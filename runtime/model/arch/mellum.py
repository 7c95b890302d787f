"""Mellum (``mellum``, JetBrains' Mellum 2): Qwen3-MoE's attention (per-head q/k RMSNorm, biases on q/k/v/o with
``attention_bias``) with sliding-window layers (``layer_types``) and a RoPE per layer type - ``rope_parameters``
keyed by ``full_attention`` / ``sliding_attention`` (defaults: theta 5e5 / 1e4): the full layers' RoPE is the model's
(default or YaRN), the sliding layers' a default RoPE of their own theta (``sliding_rope_theta``) -; softmax ->
top-k (renormalised with ``norm_topk_prob``), dense layers from ``mlp_layer_types``.

Its multi-token-prediction layer (``num_nextn_predict_layers`` / transformers' ``num_mtp_layers``: at most one, of
the attention kind ``mtp_layer_types`` names - sliding by default, with the sliding layers' window and RoPE - and a
sparse FFN, ``mtp_mlp_layer_types``) is stored as Qwen3-Next's is: ``mtp.fc`` (our eh_proj),
``mtp.pre_fc_norm_embedding`` / ``_hidden`` (enorm / hnorm), the decoder layer ``mtp.layers.0.*``, ``mtp.norm``
(shared_head.norm) before the model's lm_head (transformers' MtpModel and its Mellum renames in conversion_mapping.py); convert reads it into the store's
``mtp/`` part for ``--speculative mtp`` (runtime/model/mtp.py). Plain RMSNorms (no 1 + weight); the next draft reads
the output after ``mtp.norm``, as transformers' MtpModel chains it. A dense MTP layer is left unread."""
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
    window = int(d.get("sliding_window") or 0)
    mtp_slides = bool(window and mtp_layers(d) and _mtp_kind(d) == "sliding_attention")
    if mtp_slides:   # the MTP layer (model layer L: runtime/model/mtp.py's mtp_config) has the sliding window and RoPE
        common.update(sliding_window=window, sliding_layers=list(common.get("sliding_layers") or []) + [L])
    own = (sliding_layers(d, L) or mtp_slides) and (theta != common["rope_theta"] or common["rope_scaling"])
    moe = moe_layers_of(d, L, src, 0)
    bias = bool(d.get("attention_bias", False))
    return dict(dense_intermediate=dense_intermediate(moe, L, need), expert_intermediate=int(need("moe_intermediate_size")),
                moe_layers=moe, norm_topk_prob=bool(d.get("norm_topk_prob", True)), qk_norm="head", qkv_bias=bias,
                o_bias=bias, sliding_rope_theta=theta if own else 0.0)


# -- multi-token prediction (transformers' MtpModel over MellumDecoderLayer; conversion_mapping.py's Mellum layout) ---
MTP_PARTS = {"eh_proj.weight": "fc.weight", "enorm.weight": "pre_fc_norm_embedding.weight",
             "hnorm.weight": "pre_fc_norm_hidden.weight", "shared_head.norm.weight": "norm.weight"}
MTP_CHAIN_NORMED = True         # transformers' MtpModel feeds the next draft the layer's output after mtp.norm


def _mtp_kind(d: dict) -> str:
    return (d.get("mtp_layer_types") or ["sliding_attention"])[0]


def mtp_layers(d: dict) -> int:
    """1 where the release has the one MTP layer transformers' MellumConfig allows, with a sparse FFN and an attention
    kind Mellum has; else 0 (its ``mtp.*`` tensors are then reported unread)."""
    n = int(d.get("num_nextn_predict_layers") or d.get("num_mtp_layers") or 0)
    sparse = (d.get("mtp_mlp_layer_types") or ["sparse"])[0] == "sparse"
    return 1 if n == 1 and sparse and _mtp_kind(d) in KINDS else 0


def mtp_name(j: int, part: str) -> str:
    """The release's name of MTP layer j's tensor ``part`` (our name below ``model.layers.{L + j}.``)."""
    return "mtp." + MTP_PARTS[part] if part in MTP_PARTS else f"mtp.layers.{j}.{part}"
