import os

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is the test-only reference")

ARCHS = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=16, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(num_experts=16, num_experts_per_tok=2, moe_intermediate_size=32,
                                                                 shared_expert_intermediate_size=48, decoder_sparse_step=1,
                                                                 norm_topk_prob=False)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(num_experts=16, num_experts_per_tok=2, moe_intermediate_size=32,
                                                                 decoder_sparse_step=1, head_dim=16, norm_topk_prob=True,
                                                                 mlp_only_layers=[1])),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=16, num_experts_per_tok=2, eos_token_id=None, pad_token_id=None)),
    # MLA attention, sigmoid group-limited routing with a correction bias, a shared expert, a dense first layer.
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1, moe_intermediate_size=32,
        first_k_dense_replace=1, q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        num_key_value_heads=4, routed_scaling_factor=2.5, eos_token_id=None, bos_token_id=None)),
    # YaRN RoPE as the released DeepSeek-V3 / Kimi K2 configs use it (factor, mscale, mscale_all_dim).
    "deepseek_v3_yarn": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1, moe_intermediate_size=32,
        first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        num_key_value_heads=4, eos_token_id=None, bos_token_id=None,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})),
    # Sliding-window attention, shorter than the test's prompt + 32 generated tokens.
    "mixtral_swa": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=16, num_experts_per_tok=2,
                                                                 sliding_window=6)),
    "qwen2_moe_swa": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        num_experts=16, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        decoder_sparse_step=1, use_sliding_window=True, sliding_window=5, max_window_layers=3)),
    "qwen3_moe_swa": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_experts=16, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1, head_dim=16,
        use_sliding_window=True, sliding_window=7)),
    "qwen3_moe_yarn": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_experts=16, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1, head_dim=16,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16})),
    # Attention sinks, alternating sliding / full layers, biases everywhere, router bias, clamped SwiGLU, YaRN.
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        num_local_experts=16, num_experts_per_tok=2, head_dim=16, sliding_window=6, intermediate_size=32,
        swiglu_limit=2.0, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0,
                                           "beta_slow": 1.0, "original_max_position_embeddings": 16, "truncate": False})),
    # Kimi Delta Attention and MLA without RoPE (layer 1), a dense first layer, DeepSeek-V3's MoE under
    # block_sparse_moe with a shared expert.
    "kimi_linear": ("KimiLinearConfig", "KimiLinearForCausalLM", dict(
        num_local_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1, moe_intermediate_size=32,
        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, num_key_value_heads=4,
        linear_head_dim=16, linear_num_heads=4, routed_scaling_factor=2.5, eos_token_id=None, bos_token_id=None,
        pad_token_id=None, layer_types=["linear_attention", "full_attention", "linear_attention"])),
    # Gated DeltaNet (2 key heads serving 4 value heads) and gated full attention with partial RoPE and
    # (1 + w) norms, a sigmoid-gated shared expert, a dense (mlp_only) layer.
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        num_experts=16, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
        mlp_only_layers=[2], layer_types=["linear_attention", "full_attention", "linear_attention"],
        eos_token_id=None, bos_token_id=None, pad_token_id=None)),
    # GLM-4.5: q/k/v biases, per-head q/k norm, RoPE on half of each head, DeepSeek-V3's router, a shared
    # expert, a dense first layer.
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
        n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1, moe_intermediate_size=32,
        first_k_dense_replace=1, use_qk_norm=True, head_dim=16, attention_bias=True, routed_scaling_factor=2.5,
        eos_token_id=None, bos_token_id=None, pad_token_id=None)),
    # MiniMax-M2: q/k norm over the whole projection, RoPE on rotary_dim channels, sigmoid router with a
    # correction bias and plain top-k.
    "minimax_m2": ("MiniMaxM2Config", "MiniMaxM2ForCausalLM", dict(
        num_local_experts=16, num_experts_per_tok=2, head_dim=16, rotary_dim=8, eos_token_id=None, bos_token_id=None,
        pad_token_id=None)),
    # Qwen3.5's language model: the same layers with Gated DeltaNet's projections unfused.
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", dict(
        num_experts=16, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        eos_token_id=None, bos_token_id=None, pad_token_id=None)),
}


def build_hf(name: str, out_dir: str, seed: int = 0):
    cfg_cls, model_cls, kw = ARCHS[name]
    C = getattr(transformers, cfg_cls)
    M = getattr(transformers, model_cls)
    torch.manual_seed(seed)
    args = dict(vocab_size=96, hidden_size=64, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256)
    c = C(**{**args, **kw})
    if name.startswith("gpt_oss"):
        c._attn_implementation = "eager"   # transformers' sink-aware attention on CPU
    m = M(c).eval()
    # Random init is tiny; scale the weights so routing and logits are far from ties.
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" not in n and not n.endswith(("A_log", "dt_bias")):   # KDA's / GDN's decay keeps its init range
                p.mul_(4.0)
        for n, b in m.named_buffers():   # a non-zero correction bias, so it matters for the test
            if n.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape) * 0.5)
    m.save_pretrained(out_dir)
    return m


@pytest.fixture(scope="session", params=list(ARCHS))
def hf_model(request, tmp_path_factory):
    from runtime.model.convert import convert
    d = str(tmp_path_factory.mktemp(request.param))
    ref = build_hf(request.param, os.path.join(d, "hf"))
    convert(os.path.join(d, "hf"), os.path.join(d, "store"))
    return request.param, ref, os.path.join(d, "hf"), os.path.join(d, "store")
