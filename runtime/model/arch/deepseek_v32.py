"""DeepSeek-V3.2 (``deepseek_v32``): DeepSeek-V3's model (MLA with q LoRA and interleaved RoPE, the sigmoid
group-limited router with a correction bias, shared experts) with DeepSeek Sparse Attention on every layer: a
lightning indexer (runtime/model/layers/dsa.py) picks ``index_topk`` of the cached keys per query and MLA attends
to those only.

Read as transformers 5.25 reads it (``DeepseekV32Config``): which layers are dense from ``mlp_layer_types``, else
the first ``first_k_dense_replace``; MLA's RoPE always interleaved (the class has no ``rope_interleave``), the
indexer's rotate-half; the class's defaults where config.json leaves a field out. The multi-token-prediction layer
the release stores after the last one (``num_nextn_predict_layers``: ``model.layers.{L}.*``, with its own indexer) is
read by convert into the store's ``mtp/`` part and drafts for ``--speculative mtp`` (runtime/model/mtp.py; transformers
drops it at load)."""
from . import deepseek_v3, moe_layers_of
from .deepseek_v3 import mtp_layers  # noqa: F401 - DeepSeek-V3's MTP layout

# DeepseekV32Config's defaults for the fields that shape the model, where config.json has no such key (a saved
# config carries them all)
DEFAULTS = {"first_k_dense_replace": 3, "n_group": 8, "topk_group": 4, "n_shared_experts": 1,
            "routed_scaling_factor": 2.5, "norm_topk_prob": True, "q_lora_rank": 1536, "index_topk": 2048,
            "index_head_dim": 128, "index_n_heads": 64}


def sliding_layers(d: dict, L: int):
    return None


def config(d: dict, common: dict, need) -> dict:
    return dsa_config(d, common, need, DEFAULTS, interleaved=False, shared=[])


def dsa_config(d: dict, common: dict, need, defaults: dict, *, interleaved: bool, shared: list) -> dict:
    """DeepSeek-V3's fields of a DSA model (``defaults`` where config.json leaves one out), its dense layers from
    ``mlp_layer_types`` and its indexer: RoPE ``interleaved`` or rotate-half, the ``shared`` layers reusing the
    pick of the layer before."""
    L, src = common["num_layers"], common["source"]
    d = {**defaults, **d}
    if d.get("topk_method", "noaux_tc") != "noaux_tc" or d.get("scoring_func", "sigmoid") != "sigmoid":
        raise ValueError(f"{src}: topk_method {d.get('topk_method')!r} / scoring_func {d.get('scoring_func')!r} are "
                         f"not supported for {d['model_type']} (noaux_tc / sigmoid are)")
    out = deepseek_v3.config(d, common, need)
    out.update(moe_layers=moe_layers_of(d, L, src, int(d["first_k_dense_replace"] or 0)), rope_interleave=True,
               mla_indexer=True, index_n_heads=int(d["index_n_heads"] or 0),
               index_head_dim=int(d["index_head_dim"] or 0), index_topk=int(d["index_topk"] or 0),
               index_rope_interleave=interleaved, index_shared_layers=shared)
    return out
