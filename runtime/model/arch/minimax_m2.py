"""MiniMax-M2 (``minimax_m2``): GQA with RMSNorm over the whole q and k projections, RoPE on the first
``rotary_dim`` channels of each head (the released config's field; transformers:
``partial_rotary_factor``); a sigmoid router with a correction bias and plain top-k (no groups,
weights renormalised), no shared expert, experts as ``block_sparse_moe.experts.N.w1/w3/w2`` and the
bias beside the router as ``block_sparse_moe.e_score_correction_bias``."""

PARTIAL_ROTARY = True


def sliding_layers(d: dict, L: int):
    return None


def config(d: dict, common: dict, need) -> dict:
    if d.get("rotary_dim") and int(d["rotary_dim"]) != common["head_dim"]:
        common["rotary_dim"] = int(d["rotary_dim"])
    if d.get("scoring_func", "sigmoid") != "sigmoid":
        raise ValueError(f"{common['source']}: scoring_func {d['scoring_func']!r} is not supported (sigmoid is)")
    inter = int(need("intermediate_size"))
    return dict(dense_intermediate=inter, expert_intermediate=inter,
                moe_layers=list(range(common["num_layers"])), router="sigmoid_group", norm_topk_prob=True,
                qk_norm="full" if d.get("use_qk_norm", True) else "none", mlp_prefix="block_sparse_moe.",
                expert_tensors=("w1", "w3", "w2"), correction_bias_tensor="e_score_correction_bias")
