"""OLMoE (``olmoe``): GQA with q/k RMSNorm over the whole projection, softmax -> top-k, every layer MoE."""


def sliding_layers(d: dict, L: int):
    return None                                       # not supported


def config(d: dict, common: dict, need) -> dict:
    if d.get("clip_qkv") is not None:
        raise ValueError(f"{common['source']}: clip_qkv is not supported yet")
    inter = int(need("intermediate_size"))
    return dict(dense_intermediate=inter, expert_intermediate=inter,
                moe_layers=list(range(common["num_layers"])), qk_norm="full",
                qkv_bias=bool(d.get("attention_bias", False)), norm_topk_prob=bool(d.get("norm_topk_prob", False)))
