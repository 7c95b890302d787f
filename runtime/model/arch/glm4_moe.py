"""GLM-4.5 / GLM-4.6 (``glm4_moe``): GQA with q/k/v biases (``attention_bias``), optional per-head q/k
RMSNorm (``use_qk_norm``), RoPE on the first ``partial_rotary_factor`` (0.5) of each head;
DeepSeek-V3's router (sigmoid + correction bias + group-limited top-k + routed scaling), shared
experts, dense first layers (``first_k_dense_replace``). The multi-token-prediction layers
(``num_nextn_predict_layers``, stored after the last layer in DeepSeek-V3's layout) are read by convert into the
store's ``mtp/`` part and draft for ``--speculative mtp`` (runtime/model/mtp.py)."""
from .deepseek_v3 import mtp_layers  # noqa: F401 - DeepSeek-V3's MTP layout

PARTIAL_ROTARY = True


def sliding_layers(d: dict, L: int):
    return None


def config(d: dict, common: dict, need) -> dict:
    L = common["num_layers"]
    first = int(d.get("first_k_dense_replace", 1) or 0)
    moe_inter = int(need("moe_intermediate_size"))
    return dict(dense_intermediate=int(need("intermediate_size")), expert_intermediate=moe_inter,
                moe_layers=[i for i in range(L) if i >= first], router="sigmoid_group",
                n_group=int(d.get("n_group") or 1), topk_group=int(d.get("topk_group") or 1),
                norm_topk_prob=bool(d.get("norm_topk_prob", True)),
                routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
                shared_intermediate=moe_inter * int(d.get("n_shared_experts") or 0), shared_prefix="mlp.shared_experts.",
                qkv_bias=bool(d.get("attention_bias", False)), qk_norm="head" if d.get("use_qk_norm") else "none")
