"""GLM-4.7-Flash (``glm4_moe_lite``): DeepSeek-V3's MLA (q LoRA, compressed KV latent, interleaved
RoPE unless ``rope_interleave`` is false) with GLM-4.5's MoE (sigmoid router with a correction bias,
group-limited top-k, routed scaling, shared experts); which layers are dense comes from
``mlp_layer_types`` (transformers' default: the first).

Its multi-token-prediction layer (config.json's ``num_nextn_predict_layers``: 1, a field Glm4MoeLiteConfig lacks;
stored in DeepSeek-V3's layout as ``model.layers.{L}.*`` - enorm, hnorm, eh_proj, an MLA decoder layer with MoE
experts, shared_head; transformers skips ``model.layers.47.*`` at load, vLLM's glm4_moe_lite_mtp.py reads it) is read
by convert into the store's ``mtp/`` part and drafts for ``--speculative mtp`` (runtime/model/mtp.py)."""
from . import dense_intermediate
from .deepseek_v3 import mtp_layers  # noqa: F401 - DeepSeek-V3's MTP layout


def sliding_layers(d: dict, L: int):
    return None


def config(d: dict, common: dict, need) -> dict:
    L, src = common["num_layers"], common["source"]
    kinds = d.get("mlp_layer_types")
    if kinds is None:
        # transformers ignores first_k_dense_replace here (its default: only the first layer is dense)
        if int(d.get("first_k_dense_replace", 1) or 0) != 1:
            raise ValueError(f"{src}: first_k_dense_replace {d['first_k_dense_replace']} without mlp_layer_types is not "
                             f"supported for glm4_moe_lite (transformers makes only layer 0 dense; give mlp_layer_types)")
        kinds = ["dense"] + ["sparse"] * (L - 1)
    if len(kinds) != L or any(t not in ("dense", "sparse") for t in kinds):
        raise ValueError(f"{src}: mlp_layer_types must give 'dense' or 'sparse' for each of {L} layers, got {kinds!r}")
    if d.get("topk_method", "noaux_tc") != "noaux_tc" or d.get("scoring_func", "sigmoid") != "sigmoid":
        raise ValueError(f"{src}: topk_method {d.get('topk_method')!r} / scoring_func {d.get('scoring_func')!r} are not "
                         f"supported for glm4_moe_lite (noaux_tc / sigmoid are)")
    moe = [i for i, t in enumerate(kinds) if t == "sparse"]
    rope_dim = int(need("qk_rope_head_dim"))
    common["head_dim"] = rope_dim
    moe_inter = int(need("moe_intermediate_size"))
    return dict(dense_intermediate=dense_intermediate(moe, L, need), expert_intermediate=moe_inter,
                moe_layers=moe, router="sigmoid_group", n_group=int(d.get("n_group") or 1),
                topk_group=int(d.get("topk_group") or 1), norm_topk_prob=bool(d.get("norm_topk_prob", True)),
                routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
                shared_intermediate=moe_inter * int(d.get("n_shared_experts") or 0),
                shared_prefix="mlp.shared_experts.", attention="mla", qkv_bias=bool(d.get("attention_bias", False)),
                q_lora_rank=int(d.get("q_lora_rank") or 0), kv_lora_rank=int(need("kv_lora_rank")),
                qk_rope_head_dim=rope_dim, qk_nope_head_dim=int(need("qk_nope_head_dim")),
                v_head_dim=int(need("v_head_dim")), rope_interleave=bool(d.get("rope_interleave", True)))
