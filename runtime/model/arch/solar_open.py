"""Solar Open (``solar_open``, Upstage's Solar-Open-100B): Llama attention - q/k/v biases with ``attention_bias``
(never on o), no q/k norm, RoPE over the whole head - and GLM-4.5's MoE on every layer: sigmoid router with a
correction bias, group-limited top-k, renormalised, routed scaling, shared experts (transformers drops
``first_k_dense_replace`` and ``intermediate_size`` for it). Where config.json leaves them out, transformers'
defaults: head_dim 128, rope_theta 1e6, rms_norm_eps 1e-5, one shared expert."""
from . import hf_defaults


def sliding_layers(d: dict, L: int):
    return None


def config(d: dict, common: dict, need) -> dict:
    hf_defaults(d, common, head_dim=128, rms_norm_eps=1e-5, rope_theta=1e6)
    moe_inter = int(need("moe_intermediate_size"))
    return dict(dense_intermediate=0, expert_intermediate=moe_inter, moe_layers=list(range(common["num_layers"])),
                router="sigmoid_group", n_group=int(d.get("n_group") or 1), topk_group=int(d.get("topk_group") or 1),
                norm_topk_prob=bool(d.get("norm_topk_prob", True)),
                routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
                shared_intermediate=moe_inter * int(d.get("n_shared_experts", 1) or 0),
                shared_prefix="mlp.shared_experts.", qkv_bias=bool(d.get("attention_bias", False)))
