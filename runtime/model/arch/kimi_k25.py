"""Kimi K2.5 (``kimi_k25``), the released multimodal layout: a DeepSeek-V3 language model (Kimi K2's)
whose config is ``text_config`` (``model_type`` ``kimi_k2`` in the release, ``deepseek_v3`` as
transformers saves it) and whose tensors live under ``language_model.model.`` with the head at
``language_model.lm_head.weight``; the vision tower (``vision_tower.``), the projector
(``mm_projector.``) and the multi-token-prediction layers are not read. Everything else is
``deepseek_v3``'s (the language model's config maps through that module)."""
from . import text_config

TEXT_TYPES = ("deepseek_v3", "kimi_k2")


def language_model(d: dict) -> dict:
    t = text_config(d, TEXT_TYPES)
    # transformers ties the head by the top-level flag (its Kimi_K25Config default: true); the release's
    # language model carries its own (false, with language_model.lm_head.weight shipped).
    tie = d.get("tie_word_embeddings", t.get("tie_word_embeddings", False))
    return {**t, "model_type": "deepseek_v3", "tie_word_embeddings": tie, "lm_prefix": "language_model.model.",
            "lm_head_name": "language_model.lm_head.weight"}
