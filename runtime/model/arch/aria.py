"""Aria (``aria``, the released multimodal layout; ``aria_text``, its language model): Llama attention (biases on
q/k/v/o with ``attention_bias``) and MoE on every layer - top-k of the router's logits, softmax over those k
(``moe_topk``), experts ``intermediate_size`` wide stored fused and input-major as released (``mlp.experts.fc1``
[E, H, 2I] - gate columns, then up - and ``fc2`` [E, I, H]; transformers' ``gate_up_proj`` / ``down_proj`` read
too), shared experts (``moe_num_shared_experts`` x ``intermediate_size``) added in full. The release keeps the
language model's config under text_config and its tensors under ``language_model.model.`` / ``language_model.lm_head``;
its vision tower and projector are not read: tiered-moe decodes text."""
from . import renamed, text_config

TEXT_TYPES = ("aria_text",)
RELEASED = ((".mlp.experts.gate_up_proj", ".mlp.experts.fc1.weight"), (".mlp.experts.down_proj", ".mlp.experts.fc2.weight"))


def language_model(d: dict) -> dict:
    if d.get("model_type") == "aria":
        t = text_config(d, TEXT_TYPES)
        d = {**t, "model_type": "aria_text", "tie_word_embeddings": bool(d.get("tie_word_embeddings", False)),
             "lm_prefix": "language_model.model.", "lm_head_name": "language_model.lm_head.weight"}
    return {**d, "num_experts_per_tok": d.get("moe_topk", d.get("num_experts_per_tok"))}


def sliding_layers(d: dict, L: int):
    return None


def stored_names(name: str) -> list:
    return renamed(name, RELEASED)


def config(d: dict, common: dict, need) -> dict:
    if d.get("mlp_bias"):
        raise ValueError(f"{common['source']}: mlp_bias is not supported for aria")
    inter = int(need("intermediate_size"))
    bias = bool(d.get("attention_bias", False))
    return dict(dense_intermediate=inter, expert_intermediate=inter, moe_layers=list(range(common["num_layers"])),
                router="topk_softmax", router_tensor="router.weight", qkv_bias=bias, o_bias=bias,
                shared_intermediate=inter * int(d.get("moe_num_shared_experts", 2) or 0), shared_prefix="mlp.shared_experts.")
