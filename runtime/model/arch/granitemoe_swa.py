"""Granite MoE with sliding windows (``granitemoe_swa``): ``granitemoeshared`` with a sliding window on the
``layer_types`` sliding layers (default: all but every fourth from 0), learnable per-head attention sinks on every
layer (transformers scales the output by sigmoid(logsumexp(logits) - sink): the extra softmax logit of gpt-oss's
sinks, in the scaled-logit domain where Granite's attention multiplier, folded into q, leaves it) and a RoPE theta
per layer, ``layer_rope_theta`` - 0 for a layer without RoPE (NoPE); the non-zero ones must agree (tiered-moe keeps
one RoPE table)."""
from . import granitemoeshared, typed_sliding

stored_names = granitemoeshared.stored_names
sliced = granitemoeshared.sliced


def sliding_layers(d: dict, L: int):
    s = typed_sliding(d)
    return s if s is not None else [i for i in range(L) if i % 4]


def config(d: dict, common: dict, need) -> dict:
    L, src = common["num_layers"], common["source"]
    if not d.get("sliding_window") and sliding_layers(d, L):
        raise ValueError(f"{src}: granitemoe_swa with sliding layers needs sliding_window")
    thetas = d.get("layer_rope_theta") or [common["rope_theta"]] * L
    if len(thetas) != L:
        raise ValueError(f"{src}: layer_rope_theta has {len(thetas)} entries for {L} layers")
    rotated = {float(t) for t in thetas if t}
    if len(rotated) > 1:
        raise ValueError(f"{src}: layer_rope_theta with several non-zero thetas {sorted(rotated)} is not supported "
                         f"(one RoPE table per model; 0 = NoPE is)")
    if rotated:
        common["rope_theta"] = rotated.pop()
    return dict(granitemoeshared.config(d, common, need), attn_sinks=True,
                nope_layers=[i for i, t in enumerate(thetas) if not t])
