"""Kolibri 1 (``kolibri1``; not 1.1, whose indexed sparse attention and shared KV are new kinds): EXAONE 4's attention - per-head q/k RMSNorm, no biases, sliding
layers (``layer_types``, default every fifth full) with RoPE and global layers without it (NoPE) - in a layer with
sandwich norms (an RMSNorm before and after each sublayer); MoE on every layer with a router that chooses on the
logits + correction bias and weighs the chosen by their logits' sigmoid (``logit_bias``; renormalised with
``norm_topk_prob``), and an ungated shared expert. The release's names - the bias ``moe.router.expert_bias``, the
after-norms ``post_attn_norm`` / ``post_ffn_norm`` - are read too."""
from . import dense_intermediate, renamed, typed_sliding

RELEASED = ((".mlp.gate.e_score_correction_bias", ".moe.router.expert_bias"),
            (".post_self_attn_layernorm.", ".post_attn_norm."), (".post_mlp_layernorm.", ".post_ffn_norm."))


def sliding_layers(d: dict, L: int):
    s = typed_sliding(d)
    return s if s is not None else [i for i in range(L) if (i + 1) % 5]


def stored_names(name: str) -> list:
    return renamed(name, RELEASED)


def config(d: dict, common: dict, need) -> dict:
    L = common["num_layers"]
    sliding = sliding_layers(d, L) if d.get("sliding_window") else []
    return dict(dense_intermediate=dense_intermediate(list(range(L)), L, need),
                expert_intermediate=int(need("moe_intermediate_size")), moe_layers=list(range(L)), router="logit_bias",
                norm_topk_prob=bool(d.get("norm_topk_prob", False)),
                shared_intermediate=int(d.get("shared_expert_intermediate_size", 512) or 0),
                shared_prefix="mlp.shared_experts.", qk_norm="head", norm_placement="sandwich",
                nope_layers=[i for i in range(L) if i not in sliding] if d.get("sliding_window") else [])
