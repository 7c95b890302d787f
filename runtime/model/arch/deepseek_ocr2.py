"""DeepSeek-OCR 2 (``deepseek_ocr2``, the released layout; ``deepseek_ocr2_text``, its language model's config): Llama
attention (GQA, rotate-half RoPE, biases on q/k/v/o with ``attention_bias``; transformers forces head_dim to
hidden / heads) with DeepSeek-V2's MoE - a softmax router, ``greedy`` top-k or ``group_limited_greedy`` (the best
``topk_group`` of ``n_group`` groups), the chosen probabilities times ``routed_scaling_factor`` and not renormalised
(transformers' text config has no ``norm_topk_prob``) -, shared experts, dense layers from ``mlp_layer_types``
(else the first ``first_k_dense_replace``). The release keeps the language model at ``model.`` / ``lm_head``;
its SAM and Qwen2 vision encoders are not read: tiered-moe decodes text."""
from . import dense_intermediate, moe_layers_of, text_config

TEXT_TYPES = ("deepseek_ocr2_text",)
TOPK_METHODS = {"greedy": "softmax_topk", "group_limited_greedy": "softmax_group"}


def language_model(d: dict) -> dict:
    if d.get("model_type") != "deepseek_ocr2":
        return d
    t = text_config(d, TEXT_TYPES)
    return {**t, "model_type": "deepseek_ocr2_text", "tie_word_embeddings": bool(d.get("tie_word_embeddings", False))}


def sliding_layers(d: dict, L: int):
    return None


def config(d: dict, common: dict, need) -> dict:
    L, src, E, k = common["num_layers"], common["source"], common["num_experts"], common["top_k"]
    method = d.get("topk_method") or "greedy"
    if method not in TOPK_METHODS:
        raise ValueError(f"{src}: topk_method {method!r} is not supported for deepseek_ocr2 ({', '.join(TOPK_METHODS)} are)")
    if d.get("mlp_bias"):
        raise ValueError(f"{src}: mlp_bias is not supported for deepseek_ocr2")
    n_group, topk_group = (int(d.get("n_group") or 1), int(d.get("topk_group") or 1)) if method != "greedy" else (1, 1)
    if method == "group_limited_greedy" and (E % n_group or topk_group * (E // n_group) < k):
        raise ValueError(f"{src}: group_limited_greedy needs n_group ({n_group}) dividing the {E} experts and "
                         f"topk_group ({topk_group}) groups holding at least num_experts_per_tok ({k}) experts")
    common["head_dim"] = common["hidden_size"] // common["num_heads"]
    moe = moe_layers_of(d, L, src, int(d.get("first_k_dense_replace", 1)))
    moe_inter = int(need("moe_intermediate_size"))
    bias = bool(d.get("attention_bias", False))
    return dict(dense_intermediate=dense_intermediate(moe, L, need), expert_intermediate=moe_inter, moe_layers=moe,
                router=TOPK_METHODS[method], n_group=n_group, topk_group=topk_group, norm_topk_prob=False,
                routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
                shared_intermediate=moe_inter * int(d.get("n_shared_experts", 2) or 0),
                shared_prefix="mlp.shared_experts.", qkv_bias=bias, o_bias=bias)
