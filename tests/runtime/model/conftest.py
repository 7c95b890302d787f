import os

import pytest
import torch

from helpers import require

transformers = require("transformers", "the test-only reference")

ARCHS = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=16, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(num_experts=16, num_experts_per_tok=2, moe_intermediate_size=32,
                                                                 shared_expert_intermediate_size=48, decoder_sparse_step=1,
                                                                 norm_topk_prob=False)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(num_experts=16, num_experts_per_tok=2, moe_intermediate_size=32,
                                                                 decoder_sparse_step=1, norm_topk_prob=True,
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
        num_experts=16, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1,
        use_sliding_window=True, sliding_window=7)),
    "qwen3_moe_yarn": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_experts=16, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1, attention_bias=True,
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
        first_k_dense_replace=1, use_qk_norm=True, attention_bias=True, routed_scaling_factor=2.5,
        eos_token_id=None, bos_token_id=None, pad_token_id=None)),
    # MiniMax-M2: q/k norm over the whole projection, RoPE on half of each head (transformers' form of the
    # released rotary_dim; test_arch_fixtures checks the two read alike), sigmoid router with a correction bias
    # and plain top-k.
    "minimax_m2": ("MiniMaxM2Config", "MiniMaxM2ForCausalLM", dict(
        num_local_experts=16, num_experts_per_tok=2, head_dim=16, eos_token_id=None, bos_token_id=None,
        pad_token_id=None, rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "partial_rotary_factor": 0.5})),
    # Qwen3.5's language model: the same layers with Gated DeltaNet's projections unfused.
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", dict(
        num_experts=16, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        eos_token_id=None, bos_token_id=None, pad_token_id=None)),
    # DeepSeek-V2: MLA with q LoRA and RoPE on adjacent pairs, softmax router with group_limited_greedy
    # (best 2 of 4 groups by their best expert), routed scaling without renormalising, a shared expert.
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        n_routed_experts=16, num_experts_per_tok=4, topk_method="group_limited_greedy", n_group=4, topk_group=2,
        n_shared_experts=1, moe_intermediate_size=32, first_k_dense_replace=1, q_lora_rank=24, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, num_key_value_heads=4, routed_scaling_factor=2.5,
        eos_token_id=None, bos_token_id=None)),
    # DeepSeek-V2-Lite: no q LoRA, greedy top-k, YaRN as its released config has it (mscale = mscale_all_dim).
    "deepseek_v2_lite": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        n_routed_experts=16, num_experts_per_tok=4, topk_method="greedy", n_shared_experts=2, moe_intermediate_size=32,
        first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=16, num_key_value_heads=4, eos_token_id=None, bos_token_id=None,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707})),
    # Kimi K2.5 as released: the DeepSeek-V3 language model under text_config (model_type kimi_k2) and
    # language_model.*, a vision tower and projector beside it (not read).
    "kimi_k25": ("Kimi_K25Config", "Kimi_K25ForConditionalGeneration", dict(
        text_config=dict(model_type="kimi_k2", n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                         n_shared_experts=1, moe_intermediate_size=32, first_k_dense_replace=1, q_lora_rank=24,
                         kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, num_key_value_heads=4,
                         routed_scaling_factor=2.5, tie_word_embeddings=False, eos_token_id=None, bos_token_id=None),
        vision_config=dict(patch_size=4, pos_emb_height=4, pos_emb_width=4, pos_emb_time=2, num_attention_heads=2,
                           num_hidden_layers=1, hidden_size=32, intermediate_size=48),
        projection_hidden_size=32, tie_word_embeddings=False)),
    # GLM-4.7-Flash: MLA (q LoRA) with GLM-4.5's sigmoid router, a shared expert, the first layer dense;
    # its released rms_norm_eps.
    "glm4_moe_lite": ("Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM", dict(
        n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1, moe_intermediate_size=32,
        q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, num_key_value_heads=4,
        routed_scaling_factor=2.5, rms_norm_eps=1e-5, eos_token_id=None, bos_token_id=None)),
    # dots.llm1: Qwen3 attention (with attention_bias: q/k/v/o biases), DeepSeek-V3's router, a shared
    # expert, a dense first layer.
    "dots1": ("Dots1Config", "Dots1ForCausalLM", dict(
        n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1, moe_intermediate_size=32,
        first_k_dense_replace=1, norm_topk_prob=True, attention_bias=True, routed_scaling_factor=2.5)),
    # ... with sliding-window layers from max_window_layers on (transformers' rule), the window shorter than the text.
    "dots1_swa": ("Dots1Config", "Dots1ForCausalLM", dict(
        n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1, moe_intermediate_size=32,
        first_k_dense_replace=1, norm_topk_prob=True, sliding_window=6, max_window_layers=1)),
    # ERNIE 4.5: interleaved RoPE, softmax router with a correction bias on the probabilities, a shared
    # expert, a dense first layer (moe_layer_start_index), tied embeddings.
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM", dict(
        moe_num_experts=16, moe_k=2, moe_intermediate_size=32, moe_num_shared_experts=1, moe_layer_start_index=1,
        eos_token_id=None, bos_token_id=None, pad_token_id=None)),
    # Qwen3-VL-MoE as released: the Qwen3-MoE language model under text_config and model.language_model.,
    # its experts fused per layer (input-major), a dense (mlp_only) layer; a vision tower beside it.
    "qwen3_vl_moe": ("Qwen3VLMoeConfig", "Qwen3VLMoeForConditionalGeneration", dict(
        text_config=dict(num_experts=16, num_experts_per_tok=2, moe_intermediate_size=24, decoder_sparse_step=1,
                         mlp_only_layers=[1], eos_token_id=None, bos_token_id=None, pad_token_id=None),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, patch_size=4,
                           temporal_patch_size=2, spatial_merge_size=2, deepstack_visual_indexes=[0]))),
    # DeepSeek-V4: per layer a sliding window (6 tokens) alone or with compressed entries (HCA: one per 4
    # tokens; CSA: one per 2, its indexer picking 2 of them per query, so the choice matters within the
    # test's 42 tokens), one shared K=V head with RoPE on its last quarter, attention sinks, the grouped
    # output projection, hyper-connections over 2 streams, the first MoE layer hash-routed, the others by
    # sqrt(softplus) scores with a correction bias, a shared expert, clamped SwiGLU.
    "deepseek_v4": ("DeepseekV4Config", "DeepseekV4ForCausalLM", dict(
        n_routed_experts=16, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=32, head_dim=32,
        num_key_value_heads=1, q_lora_rank=24, o_groups=2, o_lora_rank=16, sliding_window=6,
        compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
        layer_types=["heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention"],
        mlp_layer_types=["hash_moe", "moe", "moe"], index_n_heads=8, index_head_dim=16, index_topk=2, hc_mult=2,
        partial_rotary_factor=0.25, swiglu_limit=6.0, eos_token_id=None, bos_token_id=None, pad_token_id=None)),
    # ... with YaRN on the compressed layers' RoPE (as V4-Flash ships it; its attention factor 1), every layer
    # compressed, two hash-routed layers.
    "deepseek_v4_yarn": ("DeepseekV4Config", "DeepseekV4ForCausalLM", dict(
        n_routed_experts=16, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=32, head_dim=32,
        num_key_value_heads=1, q_lora_rank=24, o_groups=4, o_lora_rank=8, sliding_window=5,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        layer_types=["compressed_sparse_attention", "heavily_compressed_attention", "compressed_sparse_attention"],
        mlp_layer_types=["hash_moe", "hash_moe", "moe"], index_n_heads=8, index_head_dim=16, index_topk=3, hc_mult=3,
        partial_rotary_factor=0.25, eos_token_id=None, bos_token_id=None, pad_token_id=None,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
                         "beta_fast": 32, "beta_slow": 1})),
    # Solar Open: Llama attention (q/k/v biases, no o bias, RoPE over the whole head), GLM-4.5's MoE on every layer.
    "solar_open": ("SolarOpenConfig", "SolarOpenForCausalLM", dict(
        n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1, moe_intermediate_size=32,
        head_dim=16, attention_bias=True, routed_scaling_factor=2.5, eos_token_id=None, bos_token_id=None,
        pad_token_id=None)),
    # MiniCPM5-MoE: Llama attention with a sigmoid output gate ([q | gate] per head in q_proj), DeepSeek-V3's router,
    # a shared expert, a dense first layer.
    "minicpm5_moe": ("MiniCPM5MoeConfig", "MiniCPM5MoeForCausalLM", dict(
        n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1, moe_intermediate_size=32,
        head_dim=16, mlp_layer_types=["dense", "sparse", "sparse"], routed_scaling_factor=2.5, attention_bias=True,
        eos_token_id=None, bos_token_id=None, pad_token_id=None)),
    # GLM-4.5V as released: GLM-4.5's language model (q/k/v biases, RoPE on half of each head, MRoPE the same for
    # text) under text_config and model.language_model.; a vision tower beside it.
    "glm4v_moe": ("Glm4vMoeConfig", "Glm4vMoeForConditionalGeneration", dict(
        text_config=dict(n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1,
                         moe_intermediate_size=32, first_k_dense_replace=1, routed_scaling_factor=2.5,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                          "mrope_section": [2, 1, 1]},
                         eos_token_id=None, bos_token_id=None, pad_token_id=None),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                           patch_size=4, image_size=8, spatial_merge_size=2, temporal_patch_size=2))),
    # Hunyuan 3: biases on q/k/v/o, per-head q/k norm, a sigmoid router (+ correction bias, renormalised, scaled), an
    # ungated shared expert, a dense first layer; saved under the release's names (mlp.router.gate, mlp.expert_bias,
    # mlp.shared_mlp).
    "hy_v3": ("HYV3Config", "HYV3ForCausalLM", dict(
        num_experts=16, num_experts_per_tok=4, num_shared_experts=1, moe_intermediate_size=32, head_dim=16,
        router_scaling_factor=2.5, attention_bias=True, mlp_layer_types=["dense", "sparse", "sparse"],
        eos_token_id=None, bos_token_id=None, pad_token_id=None)),
    # Hunyuan-A13B: biases on q/k/v/o, the per-head q/k norm after RoPE, softmax -> top-k -> renorm on every layer,
    # an ungated shared MLP; ... with the released NTK-alpha RoPE ("dynamic" with a fixed alpha).
    "hunyuan_v1_moe": ("HunYuanMoEV1Config", "HunYuanMoEV1ForCausalLM", dict(
        num_experts=16, moe_topk=2, head_dim=16, attention_bias=True, eos_token_id=None, bos_token_id=None,
        pad_token_id=None)),
    "hunyuan_v1_moe_alpha": ("HunYuanMoEV1Config", "HunYuanMoEV1ForCausalLM", dict(
        num_experts=16, moe_topk=2, head_dim=16, eos_token_id=None, bos_token_id=None, pad_token_id=None,
        rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 1.0, "alpha": 1000.0})),
    # FlexOlmo: OLMo-2's norms after the sublayers and q/k norm over the projection, OLMoE's MoE, q/k/v/o biases.
    "flex_olmo": ("FlexOlmoConfig", "FlexOlmoForCausalLM", dict(
        num_experts=16, num_experts_per_tok=2, attention_bias=True, norm_topk_prob=True, eos_token_id=None,
        pad_token_id=None)),
    # Granite 3 MoE: Mixtral's experts under block_sparse_moe (saved fused as input_linear / output_linear), top-k ->
    # softmax, q/k/v/o biases, Granite's embedding / attention / residual multipliers and logits scaling, tied
    # embeddings (the head reads the scaled embedding).
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", dict(
        num_local_experts=16, num_experts_per_tok=2, attention_bias=True, embedding_multiplier=12.0,
        attention_multiplier=0.0625, residual_multiplier=0.22, logits_scaling=6.0, tie_word_embeddings=True,
        eos_token_id=None, bos_token_id=None, pad_token_id=None)),
    # ... with a shared MLP (stored fused: shared_mlp.input_linear / output_linear), embeddings untied.
    "granitemoeshared": ("GraniteMoeSharedConfig", "GraniteMoeSharedForCausalLM", dict(
        num_local_experts=16, num_experts_per_tok=2, shared_intermediate_size=32, embedding_multiplier=12.0,
        attention_multiplier=0.0625, residual_multiplier=0.22, logits_scaling=6.0, tie_word_embeddings=False,
        eos_token_id=None, bos_token_id=None, pad_token_id=None)),
    # EXAONE MoE: per-head q/k norm, a sliding window (shorter than the test's text) on layers 0-1 with RoPE and a
    # global layer without (NoPE), DeepSeek-V3's router with the correction bias stored beside the gate, a shared
    # expert, a dense first layer.
    "exaone_moe": ("ExaoneMoeConfig", "ExaoneMoeForCausalLM", dict(
        num_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, num_shared_experts=1, moe_intermediate_size=32,
        sliding_window=6, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        mlp_layer_types=["dense", "sparse", "sparse"], eos_token_id=None, bos_token_id=None, pad_token_id=None)),
    # Flint: Qwen3 attention with sinks (saved as softmax_offset), RoPE only on the sliding layer (6 tokens) and none on
    # the full ones, a sigmoid router without a correction bias, an ungated shared expert, a dense first layer.
    "flint": ("FlintConfig", "FlintForCausalLM", dict(
        num_experts=16, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48, head_dim=16,
        sliding_window=6, mlp_only_layers=[0], layer_types=["full_attention", "sliding_attention", "full_attention"],
        eos_token_id=None, bos_token_id=None, pad_token_id=None)),
    # Sarvam-105B: DeepSeek-V3's model (transformers runs its config through DeepseekV3ForCausalLM): MLA without q
    # LoRA, YaRN, a shared expert, a dense first layer.
    "sarvam_mla": ("SarvamMLAConfig", "DeepseekV3ForCausalLM", dict(
        n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1, moe_intermediate_size=32,
        first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=16, num_key_value_heads=4, routed_scaling_factor=2.5, eos_token_id=None, bos_token_id=None,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})),
    # Sarvam-30B and Param2-MoE: GLM-4.5's model (run by Glm4MoeForCausalLM) with RoPE over the whole head, per-head
    # q/k norm, saved under the release's Ling-style names (one query_key_value, attention.dense, word_embeddings,
    # expert_bias); q/k/v biases on Sarvam, two shared experts and a tied head on Param2.
    "sarvam_moe": ("SarvamMoEConfig", "Glm4MoeForCausalLM", dict(
        n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1, moe_intermediate_size=32,
        first_k_dense_replace=1, head_dim=16, attention_bias=True, routed_scaling_factor=2.5, eos_token_id=None,
        bos_token_id=None, pad_token_id=None)),
    "param2moe": ("Param2MoeConfig", "Glm4MoeForCausalLM", dict(
        n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=2, moe_intermediate_size=32,
        first_k_dense_replace=1, head_dim=16, routed_scaling_factor=2.5, eos_token_id=None, bos_token_id=None,
        pad_token_id=None)),
    # Qwen3-Omni's thinker (as its model saves it): the Qwen3-MoE language model under text_config, q/k/v/o biases,
    # interleaved MRoPE (plain RoPE on text), a dense (mlp_only) layer; audio and vision towers beside it.
    "qwen3_omni_moe_thinker": ("Qwen3OmniMoeThinkerConfig", "Qwen3OmniMoeThinkerForConditionalGeneration", dict(
        text_config=dict(num_experts=16, num_experts_per_tok=2, moe_intermediate_size=24, decoder_sparse_step=1,
                         mlp_only_layers=[1], attention_bias=True, eos_token_id=None, bos_token_id=None,
                         pad_token_id=None,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [4, 2, 2],
                                          "mrope_interleaved": True, "interleaved": True}),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, patch_size=4,
                           temporal_patch_size=2, spatial_merge_size=2, deepstack_visual_indexes=[0]),
        audio_config=dict(encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=48, d_model=32, output_dim=64,
                          num_mel_bins=16, downsample_hidden_size=8))),
    # DeepSeek-OCR 2: Llama attention with DeepSeek-V2's MoE (softmax, group_limited_greedy, scaled, not renormalised),
    # two shared experts, a dense first layer; SAM and Qwen2 vision encoders beside it.
    "deepseek_ocr2": ("DeepseekOcr2Config", "DeepseekOcr2ForConditionalGeneration", dict(
        text_config=dict(n_routed_experts=16, num_experts_per_tok=4, topk_method="group_limited_greedy", n_group=4,
                         topk_group=2, n_shared_experts=2, moe_intermediate_size=32, routed_scaling_factor=2.5,
                         mlp_layer_types=["dense", "sparse", "sparse"], eos_token_id=None, bos_token_id=None,
                         pad_token_id=None),
        vision_config=dict(
            sam_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=64, patch_size=16,
                            output_channels=16, downsample_channels=[16, 32], global_attn_indexes=[1], window_size=2,
                            mlp_dim=64),
            encoder_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                num_key_value_heads=1, vocab_size=16)))),
    # Granite MoE SWA: granitemoeshared with a sliding window (6 tokens) on layers 1-2, sinks (randomised: zero at
    # init) on every layer, and a RoPE theta per layer - 0 (NoPE) on the full layer.
    "granitemoe_swa": ("GraniteMoeSWAConfig", "GraniteMoeSWAForCausalLM", dict(
        num_local_experts=16, num_experts_per_tok=2, shared_intermediate_size=32, sliding_window=6,
        layer_types=["full_attention", "sliding_attention", "sliding_attention"], layer_rope_theta=[0, 10000.0, 10000.0],
        embedding_multiplier=12.0, attention_multiplier=0.0625, residual_multiplier=0.22, logits_scaling=6.0,
        eos_token_id=None, bos_token_id=None, pad_token_id=None)),
    # Mistral 4: DeepSeek-V3's MLA (q LoRA, interleaved RoPE, YaRN) with Llama 4's position-dependent q scale (from
    # position 16 on, inside the test's text), a softmax router with renormalisation, a shared expert, a dense layer.
    "mistral4": ("Mistral4Config", "Mistral4ForCausalLM", dict(
        n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1, moe_intermediate_size=32, first_k_dense_replace=1,
        q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, num_key_value_heads=4,
        routed_scaling_factor=2.5, eos_token_id=None, bos_token_id=None, pad_token_id=None,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
                         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "llama_4_scaling_beta": 0.1, "partial_rotary_factor": 0.5})),
    # Granite 4 hybrid: Mamba-2 layers (4 heads of 32 channels, B and C in 2 groups of 8) around a NoPE attention layer,
    # each with MoE + a shared MLP, Granite's multipliers away from 1.
    "granitemoehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", dict(
        num_local_experts=16, num_experts_per_tok=2, shared_intermediate_size=48,
        layer_types=["linear_attention", "full_attention", "linear_attention"], mamba_n_heads=4, mamba_n_groups=2,
        mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, embedding_multiplier=2.0, residual_multiplier=0.5,
        attention_multiplier=0.2, logits_scaling=1.5, eos_token_id=None, bos_token_id=None, pad_token_id=None)),
    # MiMo-V2-Flash: q/k heads of 24 (RoPE on the first 8 of them, theta 5e6 full / 1e4 sliding), values of 16 scaled
    # by 0.707, a full first layer and sliding (6 tokens) layers 1-2 with twice the KV heads and sinks; DeepSeek-V3's
    # router without shared experts, a dense first layer.
    "mimo_v2_flash": ("MiMoV2FlashConfig", "MiMoV2FlashForCausalLM", dict(
        n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, moe_intermediate_size=32, head_dim=24,
        v_head_dim=16, sliding_window=6, layer_types=["full_attention", "sliding_attention", "sliding_attention"],
        mlp_layer_types=["dense", "sparse", "sparse"], routed_scaling_factor=2.0, attention_bias=True,
        eos_token_id=None, bos_token_id=None, pad_token_id=None)),
    # MiniMax: lightning attention on layers 0 and 2 (blocks of 4 tokens in transformers' prefill, so its block form
    # crosses blocks), Mixtral attention on layer 1, and the normed residual with every (alpha, beta) away from 1.
    "minimax": ("MiniMaxConfig", "MiniMaxForCausalLM", dict(
        num_local_experts=16, num_experts_per_tok=2, head_dim=16, block_size=4,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        full_attn_alpha_factor=1.5, full_attn_beta_factor=0.8, linear_attn_alpha_factor=1.3, linear_attn_beta_factor=0.9,
        mlp_alpha_factor=1.2, mlp_beta_factor=0.7, eos_token_id=None, bos_token_id=None, pad_token_id=None)),
    # Kolibri 1: sandwich norms, per-head q/k norm, a sliding window (6 tokens) with RoPE on layers 0-1 and a NoPE global
    # layer, a router choosing on logits + bias with sigmoid weights, an ungated shared expert.
    "kolibri1": ("Kolibri1Config", "Kolibri1ForCausalLM", dict(
        num_experts=16, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48, head_dim=16,
        sliding_window=6, layer_types=["sliding_attention", "sliding_attention", "full_attention"], norm_topk_prob=True,
        eos_token_id=None, bos_token_id=None, pad_token_id=None)),
    # Mellum: Qwen3 attention with q/k/v/o biases, a sliding window (6 tokens) on layers 1-2 whose RoPE has a theta of
    # its own (full: 5e5 with YaRN, sliding: 1e4), a dense first layer.
    "mellum": ("MellumConfig", "MellumForCausalLM", dict(
        num_experts=16, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16, attention_bias=True, sliding_window=6,
        layer_types=["full_attention", "sliding_attention", "sliding_attention"], mlp_layer_types=["dense", "sparse", "sparse"],
        rope_parameters={"full_attention": {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 4.0,
                                            "original_max_position_embeddings": 16},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
        eos_token_id=None, bos_token_id=None, pad_token_id=None)),
    # Aria's language model: Llama attention, top-k -> softmax on every layer, experts saved fused and input-major
    # under the release's fc1 / fc2, two shared experts.
    "aria_text": ("AriaTextConfig", "AriaTextForCausalLM", dict(
        moe_num_experts=16, moe_topk=2, moe_num_shared_experts=2, attention_bias=True, eos_token_id=None,
        bos_token_id=None, pad_token_id=None)),
    # Aria as released: that language model under text_config and language_model.model. / language_model.lm_head, an
    # Idefics3 vision tower and a projector beside it.
    "aria": ("AriaConfig", "AriaForConditionalGeneration", dict(
        text_config=dict(moe_num_experts=16, moe_topk=2, moe_num_shared_experts=2, eos_token_id=None, bos_token_id=None,
                         pad_token_id=None),
        vision_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=14),
        projector_patch_to_query_dict={4: 8})),
    # Llama 4's language model: a dense layer 0 and MoE layers 1-2 (top-2 by logit, the sigmoid weights scaling the
    # experts' input; a shared expert); on layers 0-1 interleaved RoPE with Llama 3.1's scaling (each of its three
    # frequency bands used), a weightless q/k norm and chunked attention (chunks of 8, shorter than the test's texts);
    # layer 2 NoPE with the attention temperature (floor_scale 4: it grows inside the texts).
    "llama4_text": ("Llama4TextConfig", "Llama4ForCausalLM", dict(
        num_local_experts=16, num_experts_per_tok=2, intermediate_size=24, intermediate_size_mlp=48, head_dim=16,
        moe_layers=[1, 2], no_rope_layers=[1, 1, 0], attention_chunk_size=8, floor_scale=4, attn_scale=0.5,
        eos_token_id=None, bos_token_id=None, pad_token_id=None,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 4.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    # Llama 4 as released: that language model under text_config and language_model.*, in Maverick's form (MoE every
    # second layer, top-1, no q/k norm, default RoPE, transformers' default NoPE layer: the fourth), a vision tower and
    # projector beside it.
    "llama4": ("Llama4Config", "Llama4ForConditionalGeneration", dict(
        text_config=dict(num_hidden_layers=4, num_local_experts=16, num_experts_per_tok=1, intermediate_size=24,
                         intermediate_size_mlp=48, head_dim=16, interleave_moe_layer_step=2, use_qk_norm=False,
                         attention_chunk_size=8, floor_scale=4, eos_token_id=None, bos_token_id=None, pad_token_id=None),
        vision_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=48,
                           image_size=28, patch_size=14, vision_output_dim=32, projector_input_dim=32,
                           projector_output_dim=32))),
    # DeepSeek-V3.2: DeepSeek-V3's MLA and MoE (YaRN as released) with DeepSeek Sparse Attention: the indexer (8 heads
    # of 16, rotate-half RoPE) keeps 4 keys per query, fewer than the test's texts, so its pick changes the output.
    "deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM", dict(
        n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1, moe_intermediate_size=32,
        first_k_dense_replace=1, q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        num_key_value_heads=4, routed_scaling_factor=2.5, index_topk=4, index_n_heads=8, index_head_dim=16,
        eos_token_id=None, bos_token_id=None, pad_token_id=None,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})),
    # GLM-5: the same with the indexer's RoPE interleaved, 5 keys per query, and layer 1 "shared" (no indexer: the
    # keys layer 0 picked); GLM-5's router (one group) and rms_norm_eps.
    "glm_moe_dsa": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM", dict(
        n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1, moe_intermediate_size=32,
        mlp_layer_types=["dense", "sparse", "sparse"], q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, num_key_value_heads=4, routed_scaling_factor=2.5, index_topk=5,
        index_n_heads=8, index_head_dim=16, indexer_types=["full", "shared", "full"], eos_token_id=None,
        bos_token_id=None, pad_token_id=None)),
    # Nemotron-H / Nemotron 3: blocks "ME-*M*EM-E*-M" (one mixer or FFN each) - every letter, paired onto 9 layers of
    # ours: each mixer with each FFN kind, an MLP and a MoE block after no mixer (empty attention), Mamba-2 and NoPE
    # attention blocks before another mixer or last (empty FFN); the first block a mixer, as released (transformers
    # 5.25's cache reads its length from block 0's); Mamba-2 of 4 heads of 16 (B and C in 2 groups of 8), DeepSeek-V3's
    # router over ungated relu^2 experts, a relu^2 shared expert.
    "nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM", dict(
        layers_block_type=[{"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}[c]
                           for c in "ME-*M*EM-E*-M"],
        n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=48, routed_scaling_factor=2.5, head_dim=16, mamba_num_heads=4,
        mamba_head_dim=16, n_groups=2, ssm_state_size=8, conv_kernel=4, eos_token_id=None, bos_token_id=None,
        pad_token_id=None)),
}


# The sizes every fixture shrinks to, where its config class defines the field (Qwen3.5's text config
# has no intermediate_size: every layer is MoE); a multimodal fixture's go to its text_config.
SIZES = dict(vocab_size=96, hidden_size=64, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)


def defined_fields(C) -> set:
    """The fields a transformers config class defines: its dataclass fields (transformers 5's configs
    are strict dataclasses, which still accept and save any extra keyword - hence this check), else
    its ``__init__`` parameters; plus its ``attribute_map`` aliases (``num_experts`` for
    ``n_routed_experts``...)."""
    import dataclasses
    import inspect
    if dataclasses.is_dataclass(C):
        names = {f.name for f in dataclasses.fields(C)}
    else:
        names = {n for n, p in inspect.signature(C.__init__).parameters.items()
                 if n != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    return names | set(getattr(C, "attribute_map", None) or {})


def undefined_fields(C, kw: dict) -> list:
    """Keywords of ``kw`` that config class ``C`` does not define, sub-configs given as dicts
    (``text_config``, ``vision_config``) checked against their own classes (``model_type`` there
    picks the class)."""
    bad = sorted(k for k in kw if k not in defined_fields(C))
    subs = {k: v for k, v in kw.items() if isinstance(v, dict) and k in (getattr(C, "sub_configs", None) or {})}
    if subs:
        c = C(**{k: v for k, v in kw.items() if k in subs})
        for k, v in subs.items():
            bad += [f"{k}.{f}" for f in sorted(v) if f != "model_type" and f not in defined_fields(type(getattr(c, k)))]
    return bad


def fixture_kwargs(name: str):
    """(config class, keywords) of fixture ``name``: its ARCHS fields over the SIZES its class defines."""
    cfg_cls, _, kw = ARCHS[name]
    C = getattr(transformers, cfg_cls)
    kw = dict(kw)
    if isinstance(kw.get("text_config"), dict):
        T = type(C(text_config=kw["text_config"]).text_config)
        kw["text_config"] = {**{k: v for k, v in SIZES.items() if k in defined_fields(T)}, **kw["text_config"]}
    else:
        kw = {**{k: v for k, v in SIZES.items() if k in defined_fields(C)}, **kw}
    return C, kw


def hf_config(name: str):
    """The fixture's transformers config, refused where a field is one its class does not define."""
    C, kw = fixture_kwargs(name)
    cfg_cls = C.__name__
    bad = undefined_fields(C, kw)
    if bad:
        raise ValueError(f"fixture {name}: {cfg_cls} does not define {', '.join(bad)} (a strict transformers config "
                         f"keeps and saves any keyword: a fixture must not lean on one its class does not define)")
    return C(**kw)


def build_hf(name: str, out_dir: str, seed: int = 0):
    _, model_cls, _ = ARCHS[name]
    M = getattr(transformers, model_cls)
    torch.manual_seed(seed)
    c = hf_config(name)
    if name.startswith(("gpt_oss", "flint", "granitemoe_swa", "mimo_v2_flash")):
        c._attn_implementation = "eager"   # transformers' sink-aware attention on CPU
    m = M(c).eval()
    if name == "qwen3_omni_moe_thinker":
        # the release's thinker_config carries vision_start_token_id, which transformers' thinker generate reads but
        # its config class does not define (so not a fixture field): the released value, outside the test vocab
        m.config.vision_start_token_id = 151652
    # Random init is tiny; scale the weights so routing and logits are far from ties.
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" not in n and not n.endswith(("A_log", "dt_bias")):   # KDA's / GDN's decay keeps its init range
                p.mul_(4.0)
        for n, b in m.named_buffers():   # a non-zero correction bias, so it matters for the test
            if n.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape) * 0.5)
        for n, p in m.named_parameters():   # ERNIE's is a parameter, on the scale of softmax probabilities
            if n.endswith("e_score_correction_bias"):
                p.copy_(torch.randn(p.shape) * 0.05)
        for n, p in m.named_parameters():   # Granite SWA's sinks start at zero: make them matter
            if name in ("granitemoe_swa", "mimo_v2_flash") and n.endswith(".sinks"):
                p.copy_(torch.randn(p.shape))
        for n, b in m.named_buffers():   # DeepSeek-V4's token -> experts table: distinct experts per token, as shipped
            if n.endswith("tid2eid"):
                b.copy_(torch.stack([torch.randperm(c.n_routed_experts)[:b.shape[1]] for _ in range(b.shape[0])]))
    m.save_pretrained(out_dir)
    if name in RELEASED_LAYOUT:
        m = released_layout(m, out_dir, RELEASED_LAYOUT[name])
    return m


def lm_config(cfg: dict) -> dict:
    """The part of a config.json dict describing the language model: ``text_config`` in a multimodal
    release (kimi_k25, qwen3_vl_moe), else the whole dict; editing it edits ``cfg``."""
    return cfg["text_config"] if isinstance(cfg.get("text_config"), dict) else cfg


def released_layout(m, out_dir: str, rename=lambda k, v: (k, v)):
    """The saved checkpoint rewritten tensor by tensor (``rename``: name, tensor -> name, tensor) into the
    layout a model is released in, which tiered-moe reads; the reference is then transformers' model
    loaded back from that directory, checked to hold the same language-model weights."""
    from safetensors.torch import load_file, save_file
    assert not os.path.exists(os.path.join(out_dir, "model.safetensors.index.json")), "sharded save: rewrite the index"
    for f in [f for f in os.listdir(out_dir) if f.endswith(".safetensors")]:
        path = os.path.join(out_dir, f)
        save_file(dict(rename(k, v) for k, v in load_file(path).items()), path, metadata={"format": "pt"})
    ref = type(m).from_pretrained(out_dir).eval()
    got = ref.state_dict()
    for k, v in m.state_dict().items():
        if k.startswith(("model.language_model.", "lm_head.")):
            assert torch.equal(got[k], v), f"transformers does not read {k} back from the released layout"
    return ref


def _kimi_k25(k, v):
    """transformers 5.24 saves Kimi K2.5's language model as ``language_model.model.blocks.N`` (its
    vision rename ``blocks`` -> ``layers`` reversed over every key); the release has ``...layers.N``."""
    return k.replace("language_model.model.blocks.", "language_model.model.layers."), v


def _qwen3_vl_moe(k, v):
    """transformers 5.24 saves Qwen3-VL's fused experts output-major ([E, 2I, H], [E, H, I]); the
    release ships them input-major ([E, H, 2I], [E, I, H])."""
    return k, (v.transpose(1, 2).contiguous() if k.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")) else v)


RELEASED_LAYOUT = {"kimi_k25": _kimi_k25, "qwen3_vl_moe": _qwen3_vl_moe}


# transformers binds fla's / causal_conv1d's kernels in place of its torch fallbacks when those packages import
# (once, at import of the modeling module): the references here are the torch paths, whatever is installed.
LINEAR_ATTENTION_MODULES = ("kimi_linear", "qwen3_next", "qwen3_5_moe", "granitemoehybrid", "nemotron_h")


def _hub_fallback(obj):
    """transformers' `use_kernel_func_from_hub_with_fallback` wrapper behind a module-level name, or None.

    Without the `kernels` package the name is that wrapper itself (a function from hub_kernels.py whose
    __wrapped__ is the torch path); with it (transformers >= 5.25 requires it) the name is an instance of
    kernels' `Func` module whose forward calls the wrapper it closes over."""
    def is_wrapper(fn):
        code = getattr(fn, "__code__", None)
        return code is not None and code.co_filename.endswith("hub_kernels.py") and hasattr(fn, "__wrapped__")
    if is_wrapper(obj):
        return obj
    forward = getattr(type(obj), "forward", None) if isinstance(obj, torch.nn.Module) else None
    for cell in getattr(forward, "__closure__", None) or ():
        try:
            inner = cell.cell_contents
        except ValueError:                      # an empty cell
            continue
        if is_wrapper(inner):
            return inner
    return None


@pytest.fixture(scope="session", autouse=True)
def torch_fallbacks():
    import importlib
    import inspect
    with pytest.MonkeyPatch.context() as mp:
        for arch in LINEAR_ATTENTION_MODULES:
            try:
                mod = importlib.import_module(f"transformers.models.{arch}.modeling_{arch}")
            except ImportError:
                continue                    # no transformers (or too old): the tests that need it fail themselves
            n = 0
            for name, obj in list(vars(mod).items()):
                wrapper = _hub_fallback(obj)
                if wrapper is not None:
                    mp.setattr(mod, name, inspect.unwrap(wrapper))   # the torch function under the fallback wrapper
                    n += 1
            assert n >= 4, f"{mod.__name__}: transformers' kernel fallbacks moved; force its torch path anew"
        yield


# `pytest -m "not slow"` runs the hf_model tests on these (one per attention / routing family: plain, MLA with
# group-limited routing, sinks with sliding windows, KDA and Gated DeltaNet hybrids); every other architecture is slow.
FAST_ARCHS = ("mixtral", "deepseek_v3", "gpt_oss", "kimi_linear", "qwen3_next")
assert set(FAST_ARCHS) <= set(ARCHS), set(FAST_ARCHS) - set(ARCHS)


@pytest.fixture(scope="session", params=[a if a in FAST_ARCHS else pytest.param(a, marks=pytest.mark.slow) for a in ARCHS])
def hf_model(request, tmp_path_factory):
    from runtime.model.convert import convert
    d = str(tmp_path_factory.mktemp(request.param))
    ref = build_hf(request.param, os.path.join(d, "hf"))
    convert(os.path.join(d, "hf"), os.path.join(d, "store"))
    return request.param, ref, os.path.join(d, "hf"), os.path.join(d, "store")
