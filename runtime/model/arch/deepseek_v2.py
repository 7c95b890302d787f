"""DeepSeek-V2 / V2-Lite (``deepseek_v2``): DeepSeek-V3's MLA (optional q LoRA - V2-Lite has none -,
compressed KV latent; RoPE on adjacent channel pairs, transformers' complex form, which is the
interleaved layout), a softmax router: ``topk_method`` ``greedy`` (top-k of all experts) or
``group_limited_greedy`` (the best ``topk_group`` of ``n_group`` groups by their best expert, then
top-k within them), the chosen probabilities times ``routed_scaling_factor`` (not renormalised),
shared experts, dense first layers (``first_k_dense_replace``). No correction bias."""
from . import dense_intermediate

TOPK_METHODS = ("greedy", "group_limited_greedy")


def sliding_layers(d: dict, L: int):
    return None


def config(d: dict, common: dict, need) -> dict:
    L, src = common["num_layers"], common["source"]
    method = d.get("topk_method") or "greedy"
    if method not in TOPK_METHODS:
        raise ValueError(f"{src}: topk_method {method!r} is not supported for deepseek_v2 ({', '.join(TOPK_METHODS)} are)")
    if d.get("scoring_func", "softmax") != "softmax":
        raise ValueError(f"{src}: scoring_func {d['scoring_func']!r} is not supported for deepseek_v2 (softmax is)")
    if d.get("norm_topk_prob"):
        # transformers' DeepSeek-V2 router never renormalises (the released V2 / V2-Lite set it false)
        raise ValueError(f"{src}: norm_topk_prob true is not supported for deepseek_v2 (transformers' router ignores "
                         f"it; DeepSeek's own code would renormalise)")
    if int(d.get("moe_layer_freq", 1) or 1) != 1:
        raise ValueError(f"{src}: moe_layer_freq {d['moe_layer_freq']} is not supported for deepseek_v2 (1 is: "
                         f"every layer from first_k_dense_replace on is MoE)")
    if d.get("mlp_bias"):
        raise ValueError(f"{src}: mlp_bias is not supported for deepseek_v2")
    E, k = common["num_experts"], common["top_k"]
    n_group, topk_group = (int(d.get("n_group") or 1), int(d.get("topk_group") or 1)) if method != "greedy" else (1, 1)
    if method == "group_limited_greedy" and (n_group < 1 or E % n_group or topk_group * (E // n_group) < k):
        raise ValueError(f"{src}: group_limited_greedy needs n_group ({n_group}) dividing the {E} experts and "
                         f"topk_group ({topk_group}) groups holding at least num_experts_per_tok ({k}) experts")
    first = int(d.get("first_k_dense_replace", 0) or 0)
    rope_dim = int(need("qk_rope_head_dim"))
    common["head_dim"] = rope_dim
    moe_inter = int(need("moe_intermediate_size"))
    moe = [i for i in range(L) if i >= first]
    return dict(dense_intermediate=dense_intermediate(moe, L, need),
                expert_intermediate=moe_inter, moe_layers=moe,
                router="softmax_group" if method == "group_limited_greedy" else "softmax_topk",
                n_group=n_group, topk_group=topk_group, norm_topk_prob=False,
                routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
                shared_intermediate=moe_inter * int(d.get("n_shared_experts") or 0),
                shared_prefix="mlp.shared_experts.", attention="mla", qkv_bias=bool(d.get("attention_bias", False)),
                q_lora_rank=int(d.get("q_lora_rank") or 0), kv_lora_rank=int(need("kv_lora_rank")),
                qk_rope_head_dim=rope_dim, qk_nope_head_dim=int(need("qk_nope_head_dim")),
                v_head_dim=int(need("v_head_dim")), rope_interleave=True)
