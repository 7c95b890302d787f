"""Mixtral (``mixtral``): GQA with RoPE, softmax -> top-k -> renormalise, every layer MoE, experts as
``block_sparse_moe.experts.N.w1/w3/w2``. tiered-moe extension: ``moe_latent_size`` puts a
LatentMoE projection (Kimi K3) around the experts, which then run in the latent space."""
from . import typed_sliding


def sliding_layers(d: dict, L: int):
    s = typed_sliding(d)
    return list(range(L)) if s is None else s        # sliding_window applies to every layer


def config(d: dict, common: dict, need) -> dict:
    inter = int(need("intermediate_size"))
    return dict(dense_intermediate=inter, expert_intermediate=inter,
                moe_layers=list(range(common["num_layers"])), router="softmax_topk", norm_topk_prob=True,
                latent_dim=int(d.get("moe_latent_size") or 0), mlp_prefix="block_sparse_moe.",
                expert_tensors=("w1", "w3", "w2"))
