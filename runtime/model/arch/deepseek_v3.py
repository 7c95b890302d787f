"""DeepSeek-V3 (``deepseek_v3``; Kimi K2's architecture): MLA (optional q LoRA, compressed KV
latent, interleaved RoPE), sigmoid router with a correction bias and group-limited top-k, shared
experts, dense first layers.

Its multi-token-prediction layers (``num_nextn_predict_layers``: ``model.layers.{L..}.*`` after the last layer - enorm,
hnorm, eh_proj, a full decoder layer with MoE experts, shared_head) are read by convert into the store's ``mtp/``
part and draft for ``--speculative mtp`` (runtime/model/mtp.py)."""


def sliding_layers(d: dict, L: int):
    return None


def config(d: dict, common: dict, need) -> dict:
    L = common["num_layers"]
    first = int(d.get("first_k_dense_replace", 0))
    freq = int(d.get("moe_layer_freq", 1) or 1)
    rope_dim = int(need("qk_rope_head_dim"))
    common["head_dim"] = rope_dim
    return dict(dense_intermediate=int(need("intermediate_size")),
                expert_intermediate=int(need("moe_intermediate_size")),
                moe_layers=[i for i in range(L) if i >= first and i % freq == 0],
                router="sigmoid_group", n_group=int(d.get("n_group") or 1), topk_group=int(d.get("topk_group") or 1),
                norm_topk_prob=bool(d.get("norm_topk_prob", True)),
                routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
                shared_intermediate=int(need("moe_intermediate_size")) * int(d.get("n_shared_experts") or 0),
                shared_prefix="mlp.shared_experts.", attention="mla", qkv_bias=bool(d.get("attention_bias", False)),
                q_lora_rank=int(d.get("q_lora_rank") or 0), kv_lora_rank=int(need("kv_lora_rank")),
                qk_rope_head_dim=rope_dim, qk_nope_head_dim=int(need("qk_nope_head_dim")),
                v_head_dim=int(need("v_head_dim")), rope_interleave=bool(d.get("rope_interleave", True)))


def mtp_layers(d: dict) -> int:
    """Multi-token-prediction layers the release stores after the last layer (``model.layers.{L + j}.*``)."""
    return int(d.get("num_nextn_predict_layers") or 0)
