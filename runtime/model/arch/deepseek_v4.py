"""DeepSeek-V4 (``deepseek_v4``: V4-Flash, V4-Pro): per layer a sliding window of one shared K=V head,
alone or with compressed entries (CSA: one per 4 tokens, an indexer picks the top-k per query; HCA:
one per 128 tokens), attention sinks and a grouped low-rank output projection; hyper-connections
(several residual streams mixed by Sinkhorn-normalised matrices); MoE layers routed by sqrt(softplus)
scores with a correction bias, the first ones by a token-id -> experts table; a shared expert; both
with a clamped SwiGLU.

The config is read as transformers 5.24 reads it (``DeepseekV4Config.__post_init__``): ``layer_types``
(or the released ``compress_ratios`` per layer: 0 / 4 / 128), ``compress_rates`` (or
``compress_rate_csa`` / ``_hca``), ``mlp_layer_types`` (or ``num_hash_layers``), a ``partial_rotary_factor``
(or ``qk_rope_head_dim``), and ``rope_parameters`` nested as {"main", "compress"} or flat (then the
compress RoPE is ``compress_rope_theta`` with the flat scaling, YaRN's attention factor 1). Fields the
reference model does not read either (``norm_topk_prob``: top-k weights are always renormalised;
``n_shared_experts``: one shared expert; ``num_key_value_heads``: one K=V head) are not read here.

Its multi-token-prediction layers (``num_nextn_predict_layers``: ``mtp.{j}.*`` - enorm, hnorm, e_proj, h_proj, a
whole V4 block with MoE experts and its hyper-connections, its own hc_head and norm) are read by convert into the
store's ``mtp/`` part and draft for ``--speculative mtp`` over the target's hyper-connected streams
(deepseek_v4_mtp.py; runtime/model/mtp.py)."""
from . import deepseek_v4_mtp
from .deepseek_v4_mtp import V4MTP

LAYER_TYPES = {"sliding_attention": "sliding", "compressed_sparse_attention": "csa",
               "heavily_compressed_attention": "hca"}
RATIO_TYPES = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
PARTIAL_ROTARY = True


def sliding_layers(d: dict, L: int):
    return []          # every layer keeps its own window (V4Attention), none is a plain sliding-window layer


def _rope(d: dict, source: str, partial: float, theta: float, compress_theta: float) -> tuple:
    """(main scaling, compress scaling) as {} or YaRN parameters; the main RoPE must be plain."""
    rp = dict(d.get("rope_parameters") or {})
    if d.get("rope_scaling"):
        rp = {**d["rope_scaling"], **rp}
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        main, comp = rp["main"], rp["compress"]
    else:
        flat = {k: v for k, v in rp.items() if k not in ("main", "compress")}
        main = {"rope_type": "default", "rope_theta": theta}
        comp = {**flat, "rope_theta": compress_theta}
        comp.setdefault("rope_type", flat.get("type", "default"))
        if comp["rope_type"] == "yarn":
            comp.setdefault("attention_factor", 1.0)
    if (main.get("rope_type") or "default") != "default":
        raise ValueError(f"{source}: the main (sliding-layer) RoPE of DeepSeek-V4 must be default, got {main.get('rope_type')!r}")
    ct = comp.get("rope_type") or comp.get("type") or "default"
    if ct not in ("default", "yarn"):
        raise ValueError(f"{source}: compress rope_type {ct!r} is not supported (default and yarn are)")
    scaling = {}
    if ct == "yarn":
        if "original_max_position_embeddings" not in comp:
            comp = {**comp, "original_max_position_embeddings": int(d.get("max_position_embeddings") or 1048576)}
        scaling = {k: comp[k] for k in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
                                        "attention_factor", "truncate") if k in comp}
        scaling.setdefault("attention_factor", 1.0)
        # transformers reads `truncate` from the nested dict's top level, where it never is: True
        scaling["truncate"] = True
    return float(main.get("rope_theta", theta)), float(comp.get("rope_theta", compress_theta)), scaling


def config(d: dict, common: dict, need) -> dict:
    L, source = common["num_layers"], common["source"]
    kinds = d.get("layer_types")
    if kinds is None and d.get("compress_ratios") is not None:
        bad = [r for r in d["compress_ratios"] if r not in RATIO_TYPES]
        if bad:
            raise ValueError(f"{source}: compress_ratios {bad} are not ones DeepSeek-V4 defines ({sorted(RATIO_TYPES)})")
        kinds = [RATIO_TYPES[r] for r in d["compress_ratios"]]
    if kinds is None:        # transformers' default: 2 HCA layers, then CSA / HCA alternating
        kinds = ["heavily_compressed_attention"] * min(L, 2) + [
            "compressed_sparse_attention" if i % 2 else "heavily_compressed_attention" for i in range(max(L - 2, 0))]
    kinds = list(kinds)[:L]
    if len(kinds) != L:
        raise ValueError(f"{source}: layer_types has {len(kinds)} entries for {L} layers")
    for i, k in enumerate(kinds):
        if k not in LAYER_TYPES:
            raise ValueError(f"{source}: layer {i} has kind {k!r}, which tiered-moe does not implement for deepseek_v4 "
                             f"(implemented: {', '.join(LAYER_TYPES)})")
    rates = dict(d.get("compress_rates") or {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128})
    if d.get("compress_rate_csa") is not None:
        rates["compressed_sparse_attention"] = d["compress_rate_csa"]
    if d.get("compress_rate_hca") is not None:
        rates["heavily_compressed_attention"] = d["compress_rate_hca"]
    unknown = sorted(set(rates) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"{source}: compress_rates names {unknown}, not DeepSeek-V4 layer kinds")
    mlp = d.get("mlp_layer_types")
    if mlp is None:
        n_hash = int(d["num_hash_layers"]) if d.get("num_hash_layers") is not None else 3
        mlp = ["hash_moe"] * min(L, n_hash) + ["moe"] * max(0, L - n_hash)
    mlp = list(mlp)[:L]
    if len(mlp) != L or any(t not in ("hash_moe", "moe") for t in mlp):
        raise ValueError(f"{source}: mlp_layer_types must give 'hash_moe' or 'moe' for each of {L} layers, got {mlp!r}")
    scoring = d.get("scoring_func", "sqrtsoftplus")
    if scoring != "sqrtsoftplus":
        raise ValueError(f"{source}: scoring_func {scoring!r} is not supported for deepseek_v4 (sqrtsoftplus is)")
    if (d.get("hidden_act") or "silu") != "silu":
        raise ValueError(f"{source}: hidden_act {d.get('hidden_act')!r} is not supported (silu is)")
    head_dim = int(need("head_dim"))
    partial = d.get("partial_rotary_factor")
    if partial is None:
        partial = d["qk_rope_head_dim"] / head_dim if d.get("qk_rope_head_dim") is not None else 0.125
    rope_dim = int(head_dim * float(partial))
    theta, ctheta, cscaling = _rope(d, source, float(partial), float(d.get("rope_theta", 10000.0)),
                                    float(d.get("compress_rope_theta", 160000.0)))
    inter = int(need("moe_intermediate_size"))
    common.update(head_dim=head_dim, rope_theta=theta, rope_scaling={}, rotary_dim=0,
                  sliding_window=int(d.get("sliding_window") or 128), sliding_layers=[])
    return dict(dense_intermediate=0, expert_intermediate=inter, moe_layers=list(range(L)),
                router="sqrtsoftplus", norm_topk_prob=True,
                routed_scaling_factor=float(d.get("routed_scaling_factor", 1.5)),
                shared_intermediate=inter, shared_prefix="mlp.shared_experts.",
                expert_act="silu_clamp", swiglu_limit=float(d.get("swiglu_limit", 10.0)),
                attention="v4", q_lora_rank=int(need("q_lora_rank")), qk_rope_head_dim=rope_dim,
                v4_kinds=[LAYER_TYPES[k] for k in kinds],
                compress_rates={LAYER_TYPES[k]: int(v) for k, v in rates.items()},
                o_groups=int(need("o_groups")), o_lora_rank=int(need("o_lora_rank")),
                index_n_heads=int(d.get("index_n_heads") or 0), index_head_dim=int(d.get("index_head_dim") or 0),
                index_topk=int(d.get("index_topk") or 0), compress_rope_theta=ctheta,
                compress_rope_scaling=cscaling, hc_mult=int(d.get("hc_mult") or 4),
                hc_sinkhorn_iters=int(d.get("hc_sinkhorn_iters") or 20), hc_eps=float(d.get("hc_eps") or 1e-6),
                hash_layers=[i for i, t in enumerate(mlp) if t == "hash_moe"])


# Our (transformers') tensor names -> the released checkpoint's (DeepSeek's inference code; transformers'
# conversion_mapping for deepseek_v4 in reverse), segment by segment on the name without "model.".
_LAYER_RENAMES = (("self_attn.compressor.indexer.q_b_proj.", "attn.indexer.wq_b."),
                  ("self_attn.compressor.indexer.scorer.weights_proj.", "attn.indexer.weights_proj."),
                  ("self_attn.compressor.indexer.", "attn.indexer.compressor."),
                  ("self_attn.", "attn."), ("mlp.", "ffn."), ("input_layernorm.", "attn_norm."),
                  ("post_attention_layernorm.", "ffn_norm."), ("attn_hc.", "hc_attn_"), ("ffn_hc.", "hc_ffn_"),
                  ("q_a_proj.", "wq_a."), ("q_b_proj.", "wq_b."), ("q_a_norm.", "q_norm."), ("kv_proj.", "wkv."),
                  ("gate_proj.", "wgate."), ("o_a_proj.", "wo_a."), ("o_b_proj.", "wo_b."), ("sinks", "attn_sink"),
                  ("position_bias", "ape"), ("gate.e_score_correction_bias", "gate.bias"))
_SHARED = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def released_name(name: str) -> str:
    """``model.layers.3.self_attn.compressor.indexer.kv_proj.weight`` -> ``layers.3.attn.indexer.compressor.wkv.weight``
    (the compressor's and indexer's ``kv_norm`` -> ``norm``; the attention's stays ``kv_norm``)."""
    top = {"model.embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight", "model.norm.weight": "norm.weight",
           "model.hc_head.hc_fn": "hc_head_fn", "model.hc_head.hc_base": "hc_head_base",
           "model.hc_head.hc_scale": "hc_head_scale"}
    if name in top:
        return top[name]
    n = name[len("model."):] if name.startswith("model.") else name
    parts = n.split(".")
    if len(parts) > 4 and parts[2] == "mlp" and parts[3] in ("shared_experts", "experts"):
        if parts[3] == "shared_experts" and parts[4] in _SHARED:     # layers.i.mlp.shared_experts.gate_proj.weight
            parts[4] = _SHARED[parts[4]]
        elif parts[3] == "experts" and len(parts) > 5 and parts[5] in _SHARED:   # layers.i.mlp.experts.e.gate_proj.weight
            parts[5] = _SHARED[parts[5]]
        n = ".".join(parts)
    comp_norm = ".compressor.kv_norm." in n or ".indexer.kv_norm." in n
    for a, b in _LAYER_RENAMES:
        n = n.replace(a, b)
    if comp_norm:
        n = n.replace(".kv_norm.", ".norm.")
    return n


def stored_names(name: str) -> list:
    """Where a checkpoint may hold our tensor ``name``: as transformers names it in memory, as released,
    or as transformers 5.24's save_pretrained writes it (released names under "model.", the head as
    ``head.weight``, every K=V norm as ``norm``)."""
    r = released_name(name)
    saved = "model." + r if not r.startswith(("head.", "embed.", "hc_head_", "norm.")) else r
    if r == "embed.weight":
        saved = "model.embed_tokens.weight"
    elif r.startswith("hc_head_"):
        saved = "model.hc_head." + name.rsplit(".", 1)[1]
    elif r == "norm.weight":
        saved = "model.norm.weight"
    return [name, r, saved, saved.replace(".attn.kv_norm.", ".attn.norm.")]


MTP_SCHEME = V4MTP     # runtime/model/mtp.py: the MTP layer around its block is V4's own (deepseek_v4_mtp.py)


def mtp_layers(d: dict) -> int:
    """Multi-token-prediction layers the release stores as ``mtp.{j}.*`` that this runs."""
    return deepseek_v4_mtp.mtp_layers(d, released_name)


def mtp_name(j: int, part: str) -> str:
    """Our name of MTP layer j's tensor ``part`` -> the release's (``mtp.{j}.attn.wq_a.weight``...)."""
    return deepseek_v4_mtp.mtp_name(j, part, released_name)
