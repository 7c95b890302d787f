"""Hunyuan-A13B (``hunyuan_v1_moe``): Llama attention (biases on q/k/v/o with ``attention_bias``) whose per-head q/k
RMSNorm comes after RoPE (``query_layernorm`` / ``key_layernorm``), RoPE with a fixed NTK ``alpha`` (the release's
"dynamic" type with ``alpha``: the base stretched to theta * alpha ** (d / (d - 2)), the same at every length);
every layer MoE - softmax -> top-k -> renormalised (``moe_topk``), experts and an ungated shared MLP
(``mlp.shared_mlp``) all ``intermediate_size`` wide (transformers reads neither ``moe_intermediate_size`` nor
``num_shared_expert``), the router at ``mlp.gate.wg``. Where config.json leaves it out, rms_norm_eps 1e-5."""
from . import hf_defaults, renamed

_RELEASED = ((".self_attn.q_norm.", ".self_attn.query_layernorm."), (".self_attn.k_norm.", ".self_attn.key_layernorm."))


def language_model(d: dict) -> dict:
    """The release's fields as ``from_dict`` reads them: one top-k and expert count (a per-layer list must be
    uniform), the NTK-alpha RoPE as the default RoPE of its stretched base."""
    d = dict(d)
    for ours, theirs in (("num_experts_per_tok", "moe_topk"), ("num_experts", "num_experts")):
        v = d.get(theirs)
        if isinstance(v, list):
            if len(set(v)) != 1:
                raise ValueError(f"{theirs} differs between layers ({v}): not supported for hunyuan_v1_moe")
            v = v[0]
        if v is not None:
            d[ours] = v
    if d.get("use_cla"):
        raise ValueError("use_cla (cross-layer attention) is not supported for hunyuan_v1_moe")
    rope = {**(d.pop("rope_scaling", None) or {}), **(d.get("rope_parameters") or {})}
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind == "dynamic":
        if not rope.get("alpha"):
            raise ValueError("hunyuan_v1_moe's dynamic RoPE without alpha (the NTK-alpha base) is not supported")
        hd = int(d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"])
        theta = float(rope.get("rope_theta", d.get("rope_theta", 10000.0)))
        rope = {"rope_type": "default", "rope_theta": theta * float(rope["alpha"]) ** (hd / (hd - 2))}
    if rope:
        d["rope_parameters"] = rope
    return d


def sliding_layers(d: dict, L: int):
    return None


def stored_names(name: str) -> list:
    """Where a checkpoint may hold our tensor ``name``: under our name, or transformers' and the release's."""
    return renamed(name, _RELEASED)


def config(d: dict, common: dict, need) -> dict:
    hf_defaults(d, common, rms_norm_eps=1e-5)
    inter = int(need("intermediate_size"))
    bias = bool(d.get("attention_bias", False))
    return dict(dense_intermediate=inter, expert_intermediate=inter, moe_layers=list(range(common["num_layers"])),
                router="softmax_topk", norm_topk_prob=True, router_tensor="gate.wg.weight",
                shared_intermediate=inter, shared_prefix="mlp.shared_mlp.", qkv_bias=bias, o_bias=bias,
                qk_norm="head_post_rope")
