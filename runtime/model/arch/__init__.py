"""One module per architecture (issue 12).

Each module owns what is specific to its Hugging Face ``model_type``: how its ``config.json`` maps
onto ``MoEConfig`` (``config``: the architecture's fields, which ``MoEConfig.from_dict`` adds to the
fields every architecture reads), which layers transformers' rules make sliding-window
(``sliding_layers``), and - through the config fields it sets (``mlp_prefix``, ``shared_prefix``,
``expert_tensors``, ``linear_layers``...) - its tensor-name table, which ``convert.dense_names`` /
``expert_names`` read and the forward pass never spells out per architecture. Adding an
architecture is a module here and an entry in ``ARCHITECTURES``.

Modules are imported on first use, by ``MoEConfig.from_dict``; they import nothing of the model but
this package (``MoEConfig`` only for annotations), so the config module and its architectures import
in one direction."""
from __future__ import annotations

import importlib

# What a layer's token mixer is (config.json ``layer_types``): the kinds ``check_layer_kinds`` accepts.
LAYER_KINDS = ("full_attention", "linear_attention")

# model_type -> module in this package
ARCHITECTURES = {
    "mixtral": "mixtral",
    "qwen2_moe": "qwen_moe",
    "qwen3_moe": "qwen_moe",
    "olmoe": "olmoe",
    "deepseek_v3": "deepseek_v3",
    "gpt_oss": "gpt_oss",
    "kimi_linear": "kimi_linear",
    "qwen3_next": "qwen3_next",
    "qwen3_5_moe_text": "qwen3_next",
    "qwen3_5_moe": "qwen3_next",          # the multimodal release: its language model (text_config)
    "glm4_moe": "glm4_moe",
    "minimax_m2": "minimax_m2",
    "minimax": "minimax",
    "mimo_v2_flash": "mimo_v2_flash",
    "granitemoehybrid": "granitemoehybrid",
    "deepseek_v2": "deepseek_v2",
    "kimi_k25": "kimi_k25",               # the multimodal release: its DeepSeek-V3 language model (text_config)
    "glm4_moe_lite": "glm4_moe_lite",
    "dots1": "dots1",
    "ernie4_5_moe": "ernie4_5_moe",
    "qwen3_vl_moe": "qwen3_vl_moe",       # the multimodal release: its Qwen3-MoE language model (text_config)
    "deepseek_v4": "deepseek_v4",
    "solar_open": "solar_open",
    "minicpm5_moe": "minicpm5_moe",
    "glm4v_moe": "glm4v_moe",             # the multimodal release: its GLM-4.5 language model (text_config)
    "hy_v3": "hy_v3",
    "hunyuan_v1_moe": "hunyuan_v1_moe",
    "flex_olmo": "flex_olmo",
    "granitemoe": "granitemoe",
    "granitemoeshared": "granitemoeshared",
    "exaone_moe": "exaone_moe",
    "flint": "flint",
    "sarvam_mla": "sarvam_mla",           # DeepSeek-V3's model under its own config type
    "sarvam_moe": "ling_moe",             # GLM-4.5's model, released with Ling-style tensor names
    "param2moe": "ling_moe",
    "qwen3_omni_moe": "qwen3_omni_moe",   # the omni release: its thinker's Qwen3-MoE language model
    "qwen3_omni_moe_thinker": "qwen3_omni_moe",
    "deepseek_ocr2": "deepseek_ocr2",     # the released layout: its language model (text_config)
    "deepseek_ocr2_text": "deepseek_ocr2",
    "granitemoe_swa": "granitemoe_swa",
    "mistral4": "mistral4",
    "kolibri1": "kolibri1",
    "mellum": "mellum",
    "aria_text": "aria",
    "aria": "aria",                       # the multimodal release: its language model (text_config)
    "llama4_text": "llama4",
    "llama4": "llama4",                   # the multimodal release: its language model (text_config)
    "deepseek_v32": "deepseek_v32",
    "glm_moe_dsa": "glm_moe_dsa",         # DeepSeek-V3.2's model, layers sharing an indexer
    "nemotron_h": "nemotron_h",           # Nemotron-H / Nemotron 3: a mixer block and the FFN block after it per layer
}


def language_model(d: dict) -> dict:
    """A multimodal config -> its language model's config (the architecture module's ``language_model``);
    any other config unchanged."""
    mt = d.get("model_type")
    if mt in ARCHITECTURES and hasattr(module(mt), "language_model"):
        return module(mt).language_model(d)
    return d


def module(model_type: str):
    return importlib.import_module(f"{__name__}.{ARCHITECTURES[model_type]}")


def check_layer_kinds(kinds: list, d: dict, source: str) -> list:
    """``layer_types`` of a hybrid model: one implemented kind per layer, else an error naming the layer."""
    L = int(d["num_hidden_layers"])
    if len(kinds) != L:
        raise ValueError(f"{source}: layer_types has {len(kinds)} entries for {L} layers")
    for i, k in enumerate(kinds):
        if k not in LAYER_KINDS:
            raise ValueError(f"{source}: layer {i} has kind {k!r}, which tiered-moe does not implement for "
                             f"{d['model_type']} (implemented: {', '.join(LAYER_KINDS)})")
    return kinds


def text_config(d: dict, types: tuple) -> dict:
    """A multimodal release's language-model config (``text_config``), of one of ``types`` (the first is
    what a config that names none is taken to be); else an error naming what is there."""
    arch = d.get("model_type")
    t = d.get("text_config")
    if not isinstance(t, dict):
        raise ValueError(f"{arch} config.json has no text_config (the language model's configuration)")
    mt = t.get("model_type", types[0])
    if mt not in types:
        raise ValueError(f"{arch} text_config model_type {mt!r} is not supported ({' / '.join(types)} is)")
    return dict(t)


def dense_intermediate(moe_layers: list, L: int, need) -> int:
    """The dense MLP width, read only where some layer is dense: a model whose every layer is MoE
    (Qwen3.5's text config) has no ``intermediate_size`` and needs none."""
    return int(need("intermediate_size")) if len(set(moe_layers)) < L else 0


def typed_sliding(d: dict) -> "list | None":
    """Sliding layers from ``layer_types`` (newer configs say it per layer), else None."""
    if d.get("layer_types"):
        return [i for i, t in enumerate(d["layer_types"]) if t == "sliding_attention"]
    return None


def hf_defaults(d: dict, common: dict, *, head_dim: "int | None" = None, rms_norm_eps: "float | None" = None,
                rope_theta: "float | None" = None) -> None:
    """The architecture's transformers config-class defaults where config.json leaves the field out
    (``from_dict``'s own fallbacks - H // heads, 1e-6, 1e4 - are other architectures')."""
    if head_dim is not None and d.get("head_dim") is None:
        common["head_dim"] = int(head_dim)
    if rms_norm_eps is not None and d.get("rms_norm_eps") is None:
        common["rms_norm_eps"] = float(rms_norm_eps)
    if rope_theta is not None and not any("rope_theta" in (x or {}) for x in (d, d.get("rope_parameters"),
                                                                                d.get("rope_scaling"))):
        common["rope_theta"] = float(rope_theta)


def moe_layers_of(d: dict, L: int, src: str, dense_first: int = 1) -> list:
    """The MoE layers of a config that names each layer's MLP in ``mlp_layer_types`` ('dense' / 'sparse'), else
    of its default: the first ``dense_first`` layers dense."""
    kinds = d.get("mlp_layer_types") or ["dense" if i < dense_first else "sparse" for i in range(L)]
    if len(kinds) != L or any(t not in ("dense", "sparse") for t in kinds):
        raise ValueError(f"{src}: mlp_layer_types must give 'dense' or 'sparse' for each of {L} layers, got {kinds!r}")
    return [i for i, t in enumerate(kinds) if t == "sparse"]


def renamed(name: str, pairs: tuple) -> list:
    """``stored_names`` of an architecture whose release renames parts of our names: [ours, theirs] where a
    (ours, theirs) pair applies, else [ours]."""
    for ours, theirs in pairs:
        if ours in name:
            return [name, name.replace(ours, theirs)]
    return [name]


def text_rope(t: dict) -> dict:
    """A multimodal release's MRoPE as the plain RoPE it is on text (every token's temporal, height and width
    positions are the same, so which position each frequency takes - ``mrope_section`` - does not matter):
    ``rope_scaling`` and ``rope_parameters`` merged, the MRoPE-only keys dropped."""
    rope = {**(t.get("rope_scaling") or {}), **(t.get("rope_parameters") or {})}
    if rope.get("rope_type", rope.get("type")) == "mrope":   # Qwen2-VL-era configs name the default MRoPE so
        rope["rope_type"] = "default"
        rope.pop("type", None)
    for k in ("mrope_section", "mrope_interleaved", "interleaved"):
        rope.pop(k, None)
    return rope
