"""Llama 4 (``llama4``: Scout / Maverick as released - Llama4ForConditionalGeneration, its language model's config
under text_config and its tensors under ``language_model.model.`` / ``language_model.lm_head``, the vision tower and
projector not read -; ``llama4_text``: that language model alone, Llama4ForCausalLM). A pre-norm (RMSNorm) layer:

* attention: GQA (biases on q/k/v/o with ``attention_bias``). The RoPE layers (``no_rope_layers`` 1; by default all
  but every ``no_rope_layer_interval``-th) turn q and k by complex multiplication - RoPE on interleaved channel
  pairs, read as rotate-half RoPE on q/k rows reordered at conversion (ERNIE 4.5's ``deinterleave_rows``) -, then
  with ``use_qk_norm`` norm each q and k head by a weightless RMSNorm, and attend with ``attention_chunk_size``
  within their chunk of that many positions (``layer_types`` ``chunked_attention``: a window ring whose reads stop
  at the chunk). The NoPE layers (0) attend to the whole causal prefix without RoPE or norm, q scaled with
  ``attn_temperature_tuning`` by 1 + attn_scale ln(1 + floor((pos + 1) / floor_scale)). RoPE default or Llama
  3.1's (``rope_type`` llama3), theta 5e5 by default.
* FFN: MoE on ``moe_layers`` (default: every ``interleave_moe_layer_step``-th from step - 1), else a dense SwiGLU
  ``intermediate_size_mlp`` wide. The router takes the top-k logits and weighs each chosen expert by its logit's
  sigmoid (no renormalisation, no bias) - a weight on the expert's *input*, not its output -; the experts,
  ``intermediate_size`` wide, are stored fused and input-major (``feed_forward.experts.gate_up_proj`` [E, H, 2I]:
  gate columns, then up; ``down_proj`` [E, I, H]); a shared expert as wide adds in full.

Where config.json leaves them out, transformers' defaults (head_dim 128, rms_norm_eps 1e-5, chunks of 8192, the
temperature's floor_scale 8192 and attn_scale 0.1)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from . import hf_defaults, text_config
from .ernie4_5_moe import deinterleave_rows

if TYPE_CHECKING:           # annotations only: the config module reads this one
    from ..config import MoEConfig

TEXT_TYPES = ("llama4_text",)
KINDS = ("chunked_attention", "full_attention")
FUSED_INPUT_MAJOR = True    # transformers keeps Llama 4's fused experts as released (convert._fused_layer)


def language_model(d: dict) -> dict:
    if d.get("model_type") != "llama4":
        return d
    t = text_config(d, TEXT_TYPES)
    # transformers ties the multimodal model's head by the top-level flag (Llama4Config's default: false)
    return {**t, "model_type": "llama4_text", "tie_word_embeddings": bool(d.get("tie_word_embeddings", False)),
            "lm_prefix": "language_model.model.", "lm_head_name": "language_model.lm_head.weight"}


def sliding_layers(d: dict, L: int):
    return None


def nope_layers(d: dict, L: int, src: str) -> list:
    """The layers without RoPE: 0 in ``no_rope_layers`` (at least one flag per layer), else every
    ``no_rope_layer_interval``-th (transformers' default)."""
    flags = d.get("no_rope_layers")
    if not flags:
        n = int(d.get("no_rope_layer_interval", 4))
        flags = [int((i + 1) % n != 0) for i in range(L)]
    if len(flags) < L:
        raise ValueError(f"{src}: no_rope_layers has {len(flags)} entries for {L} layers")
    return [i for i in range(L) if not flags[i]]


def chunked_layers(d: dict, L: int, nope: list, chunk: "int | None", src: str) -> list:
    """The chunked-attention layers: ``layer_types``, else transformers' rule (the RoPE layers, where a chunk size
    is set)."""
    kinds = d.get("layer_types") or ["chunked_attention" if i not in nope and chunk is not None else "full_attention"
                                     for i in range(L)]
    if len(kinds) != L or any(k not in KINDS for k in kinds):
        raise ValueError(f"{src}: layer_types must give one of {' / '.join(KINDS)} for each of {L} layers, got {kinds!r}")
    chunked = [i for i, k in enumerate(kinds) if k == "chunked_attention"]
    if chunked and not chunk:
        raise ValueError(f"{src}: chunked_attention layers without an attention_chunk_size")
    return chunked


def config(d: dict, common: dict, need) -> dict:
    L, src = common["num_layers"], common["source"]
    hf_defaults(d, common, head_dim=128, rms_norm_eps=1e-5, rope_theta=5e5)
    if d.get("max_position_embeddings") is None:
        common["max_position_embeddings"] = 4096 * 32
    step = int(d.get("interleave_moe_layer_step", 1))
    moe = [int(i) for i in d["moe_layers"]] if d.get("moe_layers") is not None else list(range(step - 1, L, step))
    nope = nope_layers(d, L, src)
    chunk = d.get("attention_chunk_size", 8192)
    chunked = chunked_layers(d, L, nope, chunk, src)
    floor, beta = int(d.get("floor_scale", 8192)), float(d.get("attn_scale", 0.1))
    tuned = nope if d.get("attn_temperature_tuning", True) and beta else []
    if tuned and floor < 1:
        raise ValueError(f"{src}: floor_scale {floor} must be positive (the attention temperature divides by it)")
    inter = int(need("intermediate_size"))
    bias = bool(d.get("attention_bias", False))
    window = dict(sliding_window=int(chunk), sliding_layers=chunked, chunked_windows=True) if chunked else {}
    return dict(dense_intermediate=int(need("intermediate_size_mlp")) if len(set(moe)) < L else 0,
                expert_intermediate=inter, moe_layers=moe, router="logit_bias", correction_bias_tensor="",
                router_scales_input=True, mlp_prefix="feed_forward.", router_tensor="router.weight",
                shared_intermediate=inter, shared_prefix="feed_forward.shared_expert.", qkv_bias=bias, o_bias=bias,
                qk_norm="weightless_rope" if d.get("use_qk_norm", True) else "none", nope_layers=nope,
                q_scale_beta=beta if tuned else 0.0, q_scale_len=floor, q_scale_offset=1, q_scale_layers=tuned,
                **window)


def convert_dense(cfg: MoEConfig, dense: dict) -> None:
    """The converted dense tensors, in place: the RoPE layers' q and k projections (and biases) into the rotate-half
    channel order - the same permutation of q and k, so their products are transformers' (the weightless norm
    over a head does not see the order)."""
    rope = [i for i in cfg.attention_layers if i not in set(cfg.nope_layers)]
    for i in rope:
        for proj, heads in (("q_proj", cfg.num_heads), ("k_proj", cfg.num_kv_heads)):
            for sfx in ("weight", "bias"):
                name = f"model.layers.{i}.self_attn.{proj}.{sfx}"
                if name in dense:
                    dense[name] = deinterleave_rows(dense[name], heads, cfg.head_dim)
