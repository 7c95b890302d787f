"""FlexOlmo (``flex_olmo``): OLMo-2's layer - the RMSNorms after the sublayers (x += norm(attn(x)),
x += norm(ffn(x)); no input norm) and q/k RMSNorm over the whole projection - with OLMoE's MoE on every layer
(softmax -> top-k, renormalised with ``norm_topk_prob``). Llama attention: biases on q/k/v/o with
``attention_bias``. Where config.json leaves it out, transformers' rope_theta 5e5."""
from . import hf_defaults


def sliding_layers(d: dict, L: int):
    return None


def config(d: dict, common: dict, need) -> dict:
    if d.get("clip_qkv") is not None:
        raise ValueError(f"{common['source']}: clip_qkv is not supported yet")
    hf_defaults(d, common, rope_theta=5e5)
    inter = int(need("intermediate_size"))
    bias = bool(d.get("attention_bias", False))
    return dict(dense_intermediate=inter, expert_intermediate=inter, moe_layers=list(range(common["num_layers"])),
                qk_norm="full", qkv_bias=bias, o_bias=bias, norm_topk_prob=bool(d.get("norm_topk_prob", False)),
                norm_placement="post")
