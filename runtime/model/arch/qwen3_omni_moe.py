"""Qwen3-Omni (``qwen3_omni_moe``), the released omni layout, and its thinker alone
(``qwen3_omni_moe_thinker``, what transformers' thinker model saves): the thinker's language model is
Qwen3-MoE's (per-head q/k RMSNorm, biases on q/k/v/o with ``attention_bias``, softmax -> top-k -> renormalised,
``mlp_only_layers`` / ``decoder_sparse_step``, no sliding window) with its config at
``thinker_config.text_config`` (the thinker's: ``text_config``) and tensors under ``thinker.model.`` /
``thinker.lm_head`` (the thinker's: ``model.`` / ``lm_head``). The audio and vision towers, the talker and the
code-to-wave model are not read: tiered-moe decodes text. Its interleaved MRoPE is the plain RoPE on text
positions. Where the text config leaves them out, transformers' defaults: rope_theta 1e6, renormalised top-k."""
from . import text_config, text_rope

TEXT_TYPES = ("qwen3_omni_moe_text",)


def language_model(d: dict) -> dict:
    if d.get("model_type") == "qwen3_omni_moe":           # the release: the thinker's under thinker_config
        thinker = d.get("thinker_config")
        if not isinstance(thinker, dict):
            raise ValueError("qwen3_omni_moe config.json has no thinker_config (the language model's configuration)")
        where = {"lm_prefix": "thinker.model.", "lm_head_name": "thinker.lm_head.weight"}
    else:
        thinker, where = d, {}
    t = text_config(thinker, TEXT_TYPES)
    rope = text_rope(t)
    if "rope_theta" not in rope and "rope_theta" not in t:
        rope["rope_theta"] = 1e6
    t = {k: v for k, v in t.items() if k not in ("rope_scaling", "sliding_window", "use_sliding_window")}
    return {**t, "rope_parameters": rope, "model_type": "qwen3_moe", "norm_topk_prob": t.get("norm_topk_prob", True),
            "tie_word_embeddings": bool(thinker.get("tie_word_embeddings", False)), **where}
