"""EXAONE MoE (``exaone_moe``, K-EXAONE): EXAONE 4's attention - per-head q/k RMSNorm, no biases, sliding-window
layers (``layer_types``) with RoPE and, where a window is set, global layers without it (NoPE) - and DeepSeek-V3's
MoE: sigmoid router with a correction bias (stored beside the gate, ``mlp.e_score_correction_bias``),
group-limited top-k, renormalised, routed scaling, shared experts, dense layers from ``mlp_layer_types`` (else
the first ``first_k_dense_replace``). The multi-token-prediction layers are not read. Where config.json leaves
them out, transformers' defaults: rms_norm_eps 1e-5, routed scaling 2.5, one shared expert."""
from . import dense_intermediate, hf_defaults, moe_layers_of, renamed, typed_sliding

RELEASED = ((".mlp.gate.e_score_correction_bias", ".mlp.e_score_correction_bias"),)


def sliding_layers(d: dict, L: int):
    sliding = typed_sliding(d)
    if sliding is None:             # transformers' rule: every sliding_window_pattern-th layer global
        n = int(d.get("sliding_window_pattern") or 0)
        sliding = [i for i in range(L) if n and (i + 1) % n != 0]
    return sliding


def stored_names(name: str) -> list:
    return renamed(name, RELEASED)


def config(d: dict, common: dict, need) -> dict:
    L, src = common["num_layers"], common["source"]
    hf_defaults(d, common, rms_norm_eps=1e-5)
    moe = moe_layers_of(d, L, src, int(d.get("first_k_dense_replace", 1)))
    moe_inter = int(need("moe_intermediate_size"))
    # "We use global NoPE for hybrid attention model": with a window, only the sliding layers rotate
    nope = [i for i in range(L) if i not in sliding_layers(d, L)] if d.get("sliding_window") else []
    return dict(dense_intermediate=dense_intermediate(moe, L, need), expert_intermediate=moe_inter, moe_layers=moe,
                router="sigmoid_group", n_group=int(d.get("n_group") or 1), topk_group=int(d.get("topk_group") or 1),
                norm_topk_prob=bool(d.get("norm_topk_prob", True)),
                routed_scaling_factor=float(d.get("routed_scaling_factor", 2.5)),
                shared_intermediate=moe_inter * int(d.get("num_shared_experts", 1) or 0),
                shared_prefix="mlp.shared_experts.", qk_norm="head", nope_layers=nope)
