"""MiMo-V2-Flash (``mimo_v2_flash``, Xiaomi): GQA whose values have a head dim of their own (``v_head_dim``, below
q/k's ``head_dim``) and are scaled by ``attention_value_scale`` (folded into v_proj at load); full-attention layers
(the first and every sixth by default, ``layer_types``) and sliding-window layers with twice the key-value heads and
attention sinks (the release's ``attention_sink_bias``); a RoPE per layer type (``rope_parameters`` keyed by
``full_attention`` / ``sliding_attention``: theta 5e6 / 1e4, both on the first ``partial_rotary_factor`` (0.334) of
each head); DeepSeek-V3's router (sigmoid + correction bias + group-limited top-k) without shared experts; dense
layers from ``mlp_layer_types`` (default: the first). ``sliding_window_size`` (the reference implementation's
count of previous tokens) reads as transformers reads it, one more than the window (default 129).

Its multi-token-prediction layers (``num_nextn_predict_layers``: 3 in the release) are read by convert into the
store's ``mtp/`` part for ``--speculative mtp`` (runtime/model/mtp.py; ``mtp_name`` below maps the release's names,
vLLM's mimo_v2_mtp.py / SGLang's mimo_v2_flash_nextn.py): ``model.mtp.layers.{j}.`` ``enorm`` / ``hnorm`` /
``eh_proj`` (over concat(embeddings, hidden) - embeddings first), a decoder layer of the sliding-window kind (the
SWA heads, sinks and RoPE theta: ``mtp_fields``) with ``pre_mlp_layernorm`` for post_attention_layernorm and a dense
MLP of intermediate_size (``MTP_MOE``), and ``final_layernorm`` before the model's head. The next draft reads the
output before final_layernorm (SGLang's multi-layer MTP sets return_hidden_states_before_norm)."""
from . import dense_intermediate, hf_defaults, moe_layers_of, renamed, typed_sliding

PARTIAL_ROTARY = True
KINDS = ("full_attention", "sliding_attention")
DEFAULT_ROPE = {"full_attention": {"rope_type": "default", "rope_theta": 5_000_000.0, "partial_rotary_factor": 0.334},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.334}}
RELEASED = ((".self_attn.sinks", ".self_attn.attention_sink_bias"),)


def language_model(d: dict) -> dict:
    """The per-type RoPE: the full layers' as the model's ``rope_parameters``, the sliding layers' aside; the
    reference implementation's ``sliding_window_size`` as transformers' ``sliding_window``."""
    rope = dict(d.get("rope_parameters") or {})
    if not rope or set(rope) <= set(KINDS):
        rope = {k: {**DEFAULT_ROPE[k], **(rope.get(k) or {})} for k in KINDS}
        d = {**d, "rope_parameters": rope["full_attention"], "sliding_rope_parameters": rope["sliding_attention"]}
    if d.get("sliding_window_size") is not None:
        d = {**d, "sliding_window": int(d["sliding_window_size"]) + 1}
    elif d.get("sliding_window") is None:
        d = {**d, "sliding_window": 129}                  # transformers' default
    return d


def sliding_layers(d: dict, L: int):
    s = typed_sliding(d)     # transformers' default: full on the first layer and every sixth, sliding elsewhere
    return s if s is not None else [i for i in range(L) if not (i == 0 or (i + 1) % 6 == 0)]


def stored_names(name: str) -> list:
    return renamed(name, RELEASED)


def config(d: dict, common: dict, need) -> dict:
    L, src = common["num_layers"], common["source"]
    hf_defaults(d, common, head_dim=192, rms_norm_eps=1e-5)
    full = d.get("rope_parameters") or {}
    slide = dict(d.get("sliding_rope_parameters") or full)
    if (slide.get("rope_type") or "default") != "default" or \
            float(slide.get("partial_rotary_factor", 0.334)) != float(full.get("partial_rotary_factor", 0.334)):
        raise ValueError(f"{src}: mimo_v2_flash's sliding-layer RoPE {slide!r} is not supported (a default RoPE on "
                         f"the full layers' rotary dim is)")
    theta = float(slide.get("rope_theta", 10_000.0))
    sliding = sliding_layers(d, L) if d.get("sliding_window") else []
    moe = moe_layers_of(d, L, src, 1)
    scale = d.get("attention_value_scale", 0.707)
    return dict(dense_intermediate=dense_intermediate(moe, L, need), expert_intermediate=int(need("moe_intermediate_size")),
                moe_layers=moe, router="sigmoid_group", n_group=int(d.get("n_group") or 1),
                topk_group=int(d.get("topk_group") or 1), norm_topk_prob=bool(d.get("norm_topk_prob", True)),
                routed_scaling_factor=float(d.get("routed_scaling_factor") or 1.0),
                qkv_bias=bool(d.get("attention_bias", False)), attn_v_head_dim=int(d.get("v_head_dim") or 128),
                window_kv_heads=2 * common["num_kv_heads"] if sliding else 0, attn_sinks=bool(sliding),
                window_sinks_only=True, attn_v_scale=1.0 if scale is None else float(scale),
                sliding_rope_theta=theta if sliding and theta != common["rope_theta"] else 0.0)


MTP_MOE = False
MTP_PARTS = {"post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
             "shared_head.norm.weight": "final_layernorm.weight"}


def mtp_layers(d: dict) -> int:
    return int(d.get("num_nextn_predict_layers") or 0)


def mtp_name(j: int, part: str) -> str:
    """The release's name of MTP layer j's tensor ``part`` (our name below ``model.layers.{L + j}.``)."""
    return f"model.mtp.layers.{j}." + MTP_PARTS.get(part, part)


def mtp_fields(cfg, n: int) -> dict:
    """The MTP config's sliding layers: the model's and its MTP layers (sliding-window attention, vLLM / SGLang)."""
    if not cfg.window_layers:       # the SWA heads / sinks / theta come with the model's sliding layers
        raise ValueError(f"{cfg.source}: mimo_v2_flash's MTP layers are sliding-window layers, and the model has "
                         f"none (sliding_window / layer_types)")
    return {"sliding_layers": list(cfg.sliding_layers) + [cfg.num_layers + j for j in range(n)]}
