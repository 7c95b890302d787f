"""GLM-4.5V / GLM-4.6V (``glm4v_moe``), the released multimodal layout: GLM-4.5's language model - q/k/v biases
(its default: on), no q/k norm, RoPE on the first half of each head (rotate-half), DeepSeek-V3's router, shared
experts, dense first layers - with its config under ``text_config`` and tensors under ``model.language_model.``
(the head at ``lm_head.weight``). The vision tower (``model.visual.``) and the multi-token-prediction layer are
not read.

Its MRoPE gives each frequency the temporal, height or width position; for text the three positions are the same,
so it is the plain RoPE (``mrope_section`` only says which position each frequency takes). tiered-moe decodes
text only."""
from . import text_config, text_rope

TEXT_TYPES = ("glm4v_moe_text",)


def language_model(d: dict) -> dict:
    t = text_config(d, TEXT_TYPES)
    rope = text_rope(t)
    rope.setdefault("partial_rotary_factor", t.get("partial_rotary_factor", 0.5))
    t = {k: v for k, v in t.items() if k not in ("rope_scaling", "use_qk_norm", "partial_rotary_factor")}
    return {**t, "rope_parameters": rope, "model_type": "glm4_moe", "use_qk_norm": False,
            "attention_bias": bool(t.get("attention_bias", True)),
            # transformers ties by the outer flag, or by text_config's (pre-v5 saves put it there)
            "tie_word_embeddings": bool(d.get("tie_word_embeddings") or t.get("tie_word_embeddings")),
            "lm_prefix": "model.language_model."}
