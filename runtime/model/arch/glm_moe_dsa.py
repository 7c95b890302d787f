"""GLM-5 (``glm_moe_dsa``): DeepSeek-V3.2's model (``deepseek_v32``: MLA + DeepSeek Sparse Attention) with its
indexer's RoPE on interleaved pairs, and layers that share an indexer: a ``"shared"`` layer has none and attends
to the keys the layer before it picked (``indexer_types``; else transformers' pattern ``index_topk_pattern`` of F /
S, else the schedule ``index_topk_freq`` / ``index_skip_topk_offset``). GLM-5's defaults where config.json leaves
a field out (one expert group, 32 indexer heads, rms_norm_eps 1e-5).

Its multi-token-prediction layer (config.json's ``num_nextn_predict_layers``: 1, a field GlmMoeDsaConfig lacks;
``model.layers.{L}.*`` in DeepSeek-V3's layout, transformers skipping ``model.layers.78.*`` at load) is read by convert
into the store's ``mtp/`` part and drafts for ``--speculative mtp`` (runtime/model/mtp.py). ``indexer_types`` covers
the L decoder layers only: the MTP layer runs an indexer of its own (the releases store ``model.layers.{L}.self_attn
.indexer.*``; vLLM's / SGLang's schedule gives layer L "full" for GLM-5.2's freq 4 / offset 3 too). GLM-5.2's
``index_share_for_mtp_iteration`` (a serving shortcut: MTP iterations reuse a top-k rather than run the indexer) is
not followed: every MTP forward runs the layer's own indexer - drafts may differ, the target's verification keeps the
output exact."""
from . import hf_defaults
from .deepseek_v3 import mtp_layers  # noqa: F401 - DeepSeek-V3's MTP layout
from .deepseek_v32 import DEFAULTS as V32_DEFAULTS, dsa_config

DEFAULTS = {**V32_DEFAULTS, "n_group": 1, "topk_group": 1, "q_lora_rank": 2048, "index_n_heads": 32}
INDEXER_TYPES = {"F": "full", "S": "shared"}


def sliding_layers(d: dict, L: int):
    return None


def indexer_types(d: dict, L: int, src: str) -> list:
    """Each layer's indexer type as ``GlmMoeDsaConfig.__post_init__`` derives it: "full" (its own indexer) or
    "shared" (the layer before's top-k)."""
    kinds = d.get("indexer_types")
    if kinds is None and d.get("index_topk_pattern") is not None:
        pattern = d["index_topk_pattern"]
        if isinstance(pattern, str) and set(pattern) - set(INDEXER_TYPES):
            raise ValueError(f"{src}: index_topk_pattern {pattern!r} must be letters F (full) and S (shared)")
        kinds = [INDEXER_TYPES[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
    if kinds is None:
        freq = max(int(d.get("index_topk_freq", 1) or 1), 1)
        offset = int(d["index_skip_topk_offset"] if d.get("index_skip_topk_offset") is not None else 2)
        kinds = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(L)]
    if len(kinds) != L or any(k not in ("full", "shared") for k in kinds):
        raise ValueError(f"{src}: indexer_types must give 'full' or 'shared' for each of {L} layers, got {kinds!r}")
    if kinds[0] != "full":
        raise ValueError(f"{src}: indexer_types starts with a shared layer, which has no layer before it to take "
                         f"the top-k from")
    return kinds


def config(d: dict, common: dict, need) -> dict:
    L, src = common["num_layers"], common["source"]
    hf_defaults(d, common, rms_norm_eps=1e-5)
    shared = [i for i, k in enumerate(indexer_types(d, L, src)) if k == "shared"]
    return dsa_config(d, common, need, DEFAULTS, interleaved=True, shared=shared)
