"""Sarvam-30B (``sarvam_moe``) and Param2-MoE (``param2moe``): GLM-4.5's model - transformers runs both configs
through ``Glm4MoeForCausalLM`` - with RoPE over the whole head (their default), per-head q/k RMSNorm
(``use_qk_norm``, default on), q/k/v biases with ``attention_bias`` (released ``use_qkv_bias``), DeepSeek-V3's
router, shared experts, dense first layers. Their releases keep the original (Ling-style) names: one
``attention.query_key_value`` [q | k | v rows] (``sliced``), ``attention.dense``, ``query_layernorm`` /
``key_layernorm``, ``model.word_embeddings``, the router's ``expert_bias``; transformers' names read too. Where a
config leaves them out, transformers' defaults per type (rope_theta, head_dim, shared experts, tied head)."""
from . import glm4_moe, hf_defaults, renamed

PARTIAL_ROTARY = True
RELEASED = (("model.embed_tokens.", "model.word_embeddings."), (".self_attn.o_proj.", ".attention.dense."),
            (".self_attn.q_norm.", ".attention.query_layernorm."), (".self_attn.k_norm.", ".attention.key_layernorm."),
            (".mlp.gate.e_score_correction_bias", ".mlp.gate.expert_bias"))
# model_type -> (rope_theta, shared experts, tied embeddings): the config classes' defaults
DEFAULTS = {"sarvam_moe": (8e6, 1, False), "param2moe": (5e5, 2, True)}


def language_model(d: dict) -> dict:
    """The original fields as transformers' attribute maps read them; the types' defaults where absent."""
    d = dict(d)
    for legacy, ours in (("num_experts", "n_routed_experts"), ("num_shared_experts", "n_shared_experts"),
                         ("use_qkv_bias", "attention_bias")):
        if legacy in d and ours not in d:
            d[ours] = d.pop(legacy)
    _, shared, tied = DEFAULTS[d["model_type"]]
    for k, v in (("n_shared_experts", shared), ("tie_word_embeddings", tied), ("use_qk_norm", True),
                 ("routed_scaling_factor", 2.5), ("first_k_dense_replace", 1)):
        if d.get(k) is None:
            d[k] = v
    if not any("partial_rotary_factor" in (x or {}) for x in (d, d.get("rope_parameters"), d.get("rope_scaling"))):
        d["partial_rotary_factor"] = 1.0          # unlike GLM-4.5, RoPE over the whole head
    return d


def sliding_layers(d: dict, L: int):
    return None


def stored_names(name: str) -> list:
    return renamed(name, RELEASED)


def sliced(name: str, cfg) -> "tuple | None":
    """q / k / v projections (and biases) as rows of the stored attention.query_key_value."""
    head, sep, tail = name.rpartition(".self_attn.")
    proj, _, sfx = tail.partition("_proj.")
    if not sep or proj not in ("q", "k", "v") or sfx not in ("weight", "bias"):
        return None
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    lo = {"q": 0, "k": q, "v": q + kv}[proj]
    return f"{head}.attention.query_key_value.{sfx}", lo, lo + (q if proj == "q" else kv)


def config(d: dict, common: dict, need) -> dict:
    theta, _, _ = DEFAULTS[d["model_type"]]
    hf_defaults(d, common, head_dim=64, rope_theta=theta)
    return glm4_moe.config(d, common, need)
