"""NVIDIA Nemotron-H / Nemotron 3 (``nemotron_h``: NemotronHForCausalLM, e.g. Nemotron 3 Nano).

The checkpoint is a sequence of blocks, each one residual step x += mixer(norm(x)) (an RMSNorm of its own, eps
``layer_norm_epsilon``), its mixer named per block by ``layers_block_type`` (or the releases'
``hybrid_override_pattern`` letters):

* ``M``: Mamba-2 (runtime/model/mamba2.py: ``mamba_num_heads`` x ``mamba_head_dim``, B and C in ``n_groups`` groups of
  ``ssm_state_size``, conv bias ``use_conv_bias``, projection biases ``use_bias``, the gated RMSNorm per group);
* ``*``: GQA without RoPE (NoPE: positions only through the Mamba layers and the causal mask) and without biases
  (transformers builds q/k/v/o without one, whatever ``attention_bias`` says);
* ``-``: an ungated MLP: down(relu(up x)^2) (``mlp_hidden_act`` relu2, ``intermediate_size``);
* ``E``: a MoE - DeepSeek-V3's router (sigmoid, the correction bias for choosing only, the best ``topk_group`` of
  ``n_group`` groups by their two best experts, top-k, renormalised, x ``routed_scaling_factor``), ungated relu^2
  experts (``up_proj`` / ``down_proj`` only) and a relu^2 shared expert ``moe_shared_expert_intermediate_size``
  wide that reads the block's input; with ``moe_latent_size`` the experts run in a latent space
  (``fc1_latent_proj`` before them, ``fc2_latent_proj`` after their weighted sum).

A layer of ours is an attention-like sublayer and an FFN (residual.DecoderLayer); Nemotron-H's blocks pair up onto
them: each mixer block (M or *) with the FFN block (- or E) right after it. A mixer followed by another mixer or by
nothing gets an empty FFN, an FFN block that follows no mixer an empty attention (MoEConfig.empty_*_layers,
layers/absent.py): an empty sublayer adds nothing and has no norm. Pairing is exact - the blocks run in the same
order, each with its own norm - and nearly halves the layer count where mixers and FFN blocks alternate. Every
per-layer count (MoE layers, cache specs, pipeline stages) counts our layers, whose index is not the checkpoint's
block index: ``stored_names_of`` maps our names (transformers' usual names: self_attn, mamba, mlp,
input / post_attention_layernorm) to the blocks' (``backbone.layers.N.mixer.`` / ``.norm``; ``model.`` as
transformers holds them in memory read too).

The multi-token-prediction blocks (``num_nextn_predict_layers`` steps of the blocks ``mtp_layers_block_type`` /
``mtp_hybrid_override_pattern`` names, stored as ``mtp.layers.{k}.*`` with k counting blocks over every step) are read
by convert into the store's ``mtp/`` part and draft for ``--speculative mtp`` (runtime/model/mtp.py) where a step is an
attention block then a MoE block (``*E``: Nemotron 3 Super's and Ultra's, transformers' default), which pair onto one
layer of ours: MTP layer j is blocks 2j (``enorm`` / ``hnorm`` / ``eh_proj``, ``norm``, a NoPE GQA ``mixer``) and
2j + 1 (``norm``, the MoE ``mixer``, ``final_layernorm`` - our shared_head.norm), with the model's embedding and
lm_head (vLLM's nemotron_h_mtp.py: the step's output after ``final_layernorm`` is both the head's input and the next
draft's hidden state). Other step patterns are left unread (``mtp_layers`` is 0 for them)."""
from __future__ import annotations

from . import hf_defaults
from .granitemoehybrid import check_time_step_limit, linear_names  # noqa: F401  (the Mamba-2 tensor table)

MIXERS, FFNS = ("linear_attention", "full_attention"), ("mlp", "moe")
LETTERS = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
LEGACY = {"mamba": "linear_attention", "attention": "full_attention"}      # transformers' older layer-type names
DEFAULT = ["linear_attention", "moe", "full_attention", "mlp"]             # NemotronHConfig's without a pattern
# our names under model.layers.N. -> (which of the layer's blocks holds it: 0 mixer, 1 FFN; the name there)
_PLACES = (("input_layernorm.", 0, "norm."), ("post_attention_layernorm.", 1, "norm."), ("self_attn.", 0, "mixer."),
           ("mamba.", 0, "mixer."), ("mlp.latent_down.", 1, "mixer.fc1_latent_proj."),
           ("mlp.latent_up.", 1, "mixer.fc2_latent_proj."), ("mlp.", 1, "mixer."))
_OUTSIDE = {"model.embed_tokens.weight": "embeddings.weight", "model.norm.weight": "norm_f.weight"}


def blocks(d: dict) -> list:
    """The checkpoint's blocks, each its mixer's kind: ``layers_block_type`` (``layer_types``), else the
    ``hybrid_override_pattern`` letters (transformers reads the pattern only where the list is absent), else
    transformers' default."""
    kinds = d.get("layers_block_type") or d.get("layer_types")
    pattern = d.get("hybrid_override_pattern")
    if kinds is None and pattern:
        bad = sorted(set(pattern) - set(LETTERS))
        if bad:
            raise ValueError(f"hybrid_override_pattern {pattern!r} has letters {bad}; Nemotron-H's are M * - E")
        kinds = [LETTERS[c] for c in pattern]
    kinds = [LEGACY.get(k, k) for k in (kinds or DEFAULT)]
    for j, k in enumerate(kinds):
        if k not in MIXERS + FFNS:
            raise ValueError(f"block {j} has kind {k!r}, which is none of {', '.join(MIXERS + FFNS)}")
    return kinds


def pairs(kinds: list) -> list:
    """Our layers as (mixer block, FFN block) of the checkpoint, None where the layer has none: each mixer with the
    FFN block right after it, a mixer without one alone, an FFN block after no mixer alone."""
    out, j = [], 0
    while j < len(kinds):
        if kinds[j] in FFNS:
            out.append((None, j))
            j += 1
            continue
        f = j + 1 if j + 1 < len(kinds) and kinds[j + 1] in FFNS else None
        out.append((j, f))
        j = j + 2 if f is not None else j + 1
    return out


def language_model(d: dict) -> dict:
    """Not a multimodal release: the config in our layers' terms, before ``from_dict`` reads it - the layer count is
    the pairs' (``num_hidden_layers`` counts blocks in the releases and is absent from transformers' own saves),
    and ``hidden_act``, which Nemotron-H's config class does not define (transformers ignores it; the MLPs' is
    ``mlp_hidden_act``), is dropped."""
    out = {k: v for k, v in d.items() if k != "hidden_act"}
    out["num_hidden_layers"] = len(pairs(blocks(d)))
    return out


def sliding_layers(d: dict, L: int):
    return []      # transformers' NemotronH attends causally over everything, whatever sliding_window says


def _legacy(d: dict, name: str, old: str, default):
    """A Mamba field by its name, or by the releases' older one, which transformers prefers where both are given."""
    return d[old] if old in d else d.get(name, default)


def _refusals(d: dict, src: str) -> None:
    for name, want in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
        if d.get(name, want) != want:
            raise ValueError(f"{src}: {name} {d[name]!r} is not supported (Nemotron-H's is {want})")
    if d.get("mlp_bias"):
        raise ValueError(f"{src}: mlp_bias (biases on the MLPs, experts and latent projections) is not supported")
    check_time_step_limit(_legacy(d, "time_step_limit", "mamba_dt_limit", None), src)


def config(d: dict, common: dict, need) -> dict:
    src = common["source"]
    kinds = blocks(d)
    layers = pairs(kinds)
    mixer = [None if a is None else kinds[a] for a, _ in layers]
    ffn = [None if f is None else kinds[f] for _, f in layers]
    moe = [i for i, k in enumerate(ffn) if k == "moe"]
    if not moe:
        raise ValueError(f"{src}: no MoE block (E) among {len(kinds)} blocks: a dense Nemotron-H is not a mixture of "
                         f"experts")
    _refusals(d, src)
    common["rms_norm_eps"] = float(d.get("layer_norm_epsilon", 1e-5))
    hf_defaults(d, common, head_dim=128)
    if "num_key_value_heads" not in d:      # NemotronHConfig's default is 8 (None, given, means every head)
        common["num_kv_heads"] = 8
    return dict(dense_intermediate=int(d.get("intermediate_size", 21504)) if "mlp" in ffn else 0,
                expert_intermediate=int(d.get("moe_intermediate_size", 7688)), moe_layers=moe,
                router="sigmoid_group", n_group=int(d.get("n_group") or 1), topk_group=int(d.get("topk_group") or 1),
                norm_topk_prob=bool(d.get("norm_topk_prob", True)),
                routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
                shared_intermediate=int(d.get("moe_shared_expert_intermediate_size", 7688) or 0),
                shared_prefix="mlp.shared_experts.", latent_dim=int(d.get("moe_latent_size") or 0),
                expert_act="relu2", mlp_act="relu2", expert_tensors=("up_proj", "down_proj"),
                linear_layers=[i for i, k in enumerate(mixer) if k == "linear_attention"], linear_kind="mamba2",
                linear_prefix="mamba.", linear_num_heads=int(d.get("mamba_num_heads", 128)),
                linear_head_dim=int(d.get("mamba_head_dim", 64)),
                linear_num_groups=int(_legacy(d, "n_groups", "mamba_n_groups", 8)),
                linear_state_dim=int(d.get("ssm_state_size", 128)),
                linear_conv_kernel=int(_legacy(d, "conv_kernel", "mamba_d_conv", 4)),
                linear_conv_bias=bool(_legacy(d, "use_conv_bias", "mamba_conv_bias", True)),
                linear_proj_bias=bool(d.get("use_bias", False)),
                # the MTP layers (model layers L + j: runtime/model/mtp.py's mtp_config) attend without RoPE too
                nope_layers=[i for i, k in enumerate(mixer) if k == "full_attention"] +
                [len(layers) + j for j in range(mtp_layers(d))],
                empty_attn_layers=[i for i, k in enumerate(mixer) if k is None],
                empty_ffn_layers=[i for i, k in enumerate(ffn) if k is None])


def block_map(cfg) -> list:
    """Each of our layers' (mixer block, FFN block) in the checkpoint, None where it has none: the blocks are our
    layers' non-empty sublayers in order, so the config's empty sublayers give them back."""
    ea, ef = set(cfg.empty_attn_layers), set(cfg.empty_ffn_layers)
    out, j = [], 0
    for i in range(cfg.num_layers):
        a = None if i in ea else j
        j += a is not None
        f = None if i in ef else j
        j += f is not None
        out.append((a, f))
    return out


def stored_names_of(cfg):
    """name -> [the checkpoint's names for it] (convert.Checkpoint's aliases): a layer's tensors in its mixer's or
    FFN's block, under ``backbone.`` as released and saved (``model.`` too, as transformers holds them)."""
    where = block_map(cfg)

    def names(name: str) -> list:
        if name in _OUTSIDE:
            return [f"{p}.{_OUTSIDE[name]}" for p in ("backbone", "model")]
        if not name.startswith("model.layers."):
            return [name]                                    # lm_head.weight
        i, rest = name[len("model.layers."):].split(".", 1)
        for ours, which, theirs in _PLACES:
            if rest.startswith(ours):
                block = where[int(i)][which]
                tail = theirs + rest[len(ours):]
                return [f"{p}.layers.{block}.{tail}" for p in ("backbone", "model")]
        return [name]
    return names


# -- multi-token prediction (vLLM's nemotron_h_mtp.py; the releases' config.json and tensor names) -------------------
MTP_STEP = ["full_attention", "moe"]        # the one step layout read: an attention block, then a MoE block (*E)
MTP_CHAIN_NORMED = True                     # vLLM chains the step's output after final_layernorm into the next draft
_MTP_START = ("enorm.", "hnorm.", "eh_proj.")       # on a step's first block only


def mtp_blocks(d: dict) -> list:
    """One MTP step's block kinds: ``mtp_layers_block_type`` (older names mapped), else the
    ``mtp_hybrid_override_pattern`` letters (transformers reads the pattern where the list is absent or its default),
    else transformers' default; [] for a letter or kind Nemotron-H does not have."""
    kinds = d.get("mtp_layers_block_type")
    kinds = [LEGACY.get(k, k) for k in kinds] if isinstance(kinds, list) else None
    pattern = d.get("mtp_hybrid_override_pattern")
    if pattern and (kinds is None or kinds == MTP_STEP):
        if set(pattern) - set(LETTERS):
            return []
        kinds = [LETTERS[c] for c in pattern]
    kinds = kinds if kinds is not None else list(MTP_STEP)
    return kinds if all(k in MIXERS + FFNS for k in kinds) else []


def mtp_layers(d: dict) -> int:
    """MTP steps the release stores in the layout this reads (``*E`` steps): one layer of ours each; 0 otherwise (the
    ``mtp.*`` tensors are then reported unread)."""
    n = int(d.get("num_nextn_predict_layers") or 0)
    return n if n > 0 and mtp_blocks(d) == MTP_STEP else 0


def mtp_name(j: int, part: str) -> str:
    """The release's name of MTP layer j's tensor ``part`` (our name below ``model.layers.{L + j}.``): in block 2j
    (the step's attention block) or 2j + 1 (its MoE block) of ``mtp.layers``."""
    a, f = 2 * j, 2 * j + 1
    if part.startswith(_MTP_START):
        return f"mtp.layers.{a}.{part}"
    if part == "shared_head.norm.weight":
        return f"mtp.layers.{f}.final_layernorm.weight"
    for ours, which, theirs in _PLACES:
        if part.startswith(ours):
            return f"mtp.layers.{(a, f)[which]}.{theirs}{part[len(ours):]}"
    return f"mtp.{part}"        # the embedding / head copies other releases keep per layer: Nemotron-H's has none
