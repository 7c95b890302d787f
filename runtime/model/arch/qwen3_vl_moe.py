"""Qwen3-VL-MoE (``qwen3_vl_moe``), the released multimodal layout: its language model is Qwen3-MoE's
(GQA with per-head q/k RMSNorm, softmax -> top-k, always renormalised; MoE every
``decoder_sparse_step`` layers except ``mlp_only_layers``) with its config under ``text_config``,
tensors under ``model.language_model.`` and each layer's experts fused as shipped
(``mlp.experts.gate_up_proj`` [E, hidden, 2 x intermediate], ``mlp.experts.down_proj``
[E, intermediate, hidden]; see convert). The vision tower (``model.visual.``) is not read.

Its interleaved MRoPE gives each frequency the temporal, height or width position; for text every
token's three positions are the same, so it is the plain RoPE over the head (``mrope_section`` only
says which position each frequency takes). tiered-moe decodes text only. DeepStack's visual
features, added to the first layers' hidden states, exist only with an image or video."""
from . import text_config, text_rope

TEXT_TYPES = ("qwen3_vl_moe_text",)


def language_model(d: dict) -> dict:
    t = text_config(d, TEXT_TYPES)
    rope = text_rope(t)
    # transformers' Qwen3-VL text model has no sliding window (it sets sliding_window None) and ties the
    # head by the top-level flag (Qwen3VLMoeConfig's default: false), not text_config's.
    t = {k: v for k, v in t.items() if k not in ("rope_scaling", "sliding_window", "use_sliding_window")}
    if rope:
        t["rope_parameters"] = rope
    return {**t, "model_type": "qwen3_moe", "norm_topk_prob": True,
            "tie_word_embeddings": bool(d.get("tie_word_embeddings", False)), "lm_prefix": "model.language_model."}
