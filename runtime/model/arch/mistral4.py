"""Mistral 4 (``mistral4``, Mistral-Small-4's language model): DeepSeek-V3's MLA (q LoRA, compressed KV latent,
interleaved RoPE on ``qk_rope_head_dim`` channels with YaRN) whose query is scaled per position as Llama 4's,
q x (1 + beta ln(1 + floor(pos / original_max_position_embeddings))) (``llama_4_scaling_beta`` in the RoPE
parameters; 1 below that length); a softmax router - top-k, renormalised with ``norm_topk_prob``, routed scaling
(one group: its grouped form scores a group by its top-2 sum, which no router here does) -, shared experts,
dense first layers (``first_k_dense_replace``). Where a config leaves them out, transformers' defaults."""

PARTIAL_ROTARY = True     # transformers' form: the rotary share of the q/k head


def sliding_layers(d: dict, L: int):
    return None


def config(d: dict, common: dict, need) -> dict:
    L, src = common["num_layers"], common["source"]
    rope = {**(d.get("rope_scaling") or {}), **(d.get("rope_parameters") or {})}
    if (rope.get("rope_type") or rope.get("type") or "default") != "yarn":
        raise ValueError(f"{src}: mistral4 with RoPE {rope.get('rope_type') or rope.get('type')!r} is not supported "
                         f"(yarn is: transformers' default RoPE spans the whole q/k head)")
    if int(d.get("n_group") or 1) != 1:
        raise ValueError(f"{src}: mistral4 with n_group {d['n_group']} is not supported (its groups are scored by "
                         f"their top-2 sum)")
    if d.get("attention_bias"):
        raise ValueError(f"{src}: attention_bias with MLA is not supported")
    first = int(d.get("first_k_dense_replace", 0) or 0)
    rope_dim = int(need("qk_rope_head_dim"))
    common["head_dim"], common["rotary_dim"] = rope_dim, 0
    moe_inter = int(need("moe_intermediate_size"))
    return dict(dense_intermediate=int(need("intermediate_size")) if first else 0, expert_intermediate=moe_inter,
                moe_layers=[i for i in range(L) if i >= first], router="softmax_topk",
                norm_topk_prob=bool(d.get("norm_topk_prob", True)),
                routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
                shared_intermediate=moe_inter * int(d.get("n_shared_experts", 1) or 0),
                shared_prefix="mlp.shared_experts.", attention="mla", q_lora_rank=int(d.get("q_lora_rank") or 0),
                kv_lora_rank=int(need("kv_lora_rank")), qk_rope_head_dim=rope_dim,
                qk_nope_head_dim=int(need("qk_nope_head_dim")), v_head_dim=int(need("v_head_dim")),
                rope_interleave=bool(d.get("rope_interleave", True)),
                q_scale_beta=float(rope.get("llama_4_scaling_beta") or 0.0),
                q_scale_len=int(rope.get("original_max_position_embeddings") or 0))
