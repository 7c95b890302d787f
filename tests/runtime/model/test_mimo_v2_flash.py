"""MiMo-V2-Flash's config as transformers' config class derives it, and its attention's per-layer shapes and caches
(the model itself against transformers: the per-architecture suite, conftest's ``mimo_v2_flash`` fixture)."""
import pytest
import torch

from conftest import hf_config
from helpers import require
from runtime.model.config import MoEConfig
from runtime.model.layers.kinds import cache_specs

transformers = require("transformers", "the test-only reference")


def test_config_as_transformers_derives_it():
    """Defaults where config.json leaves fields out are transformers' (its __post_init__): layer kinds (full on the
    first and every sixth), the per-type RoPE (theta 5e6 / 1e4, rotary dim int(head_dim x 0.334)), the dense first
    layer; the reference implementation's sliding_window_size reads as one more window token."""
    C = transformers.MiMoV2FlashConfig
    base = dict(vocab_size=96, hidden_size=64, num_hidden_layers=12, num_attention_heads=4, num_key_value_heads=2,
                head_dim=24, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                intermediate_size=48, max_position_embeddings=256)
    ref = C(**base)
    a = MoEConfig.from_dict({**base, "model_type": "mimo_v2_flash"})     # no layer_types / rope_parameters / mlp types
    assert a.sliding_layers == [i for i, t in enumerate(ref.layer_types) if t == "sliding_attention"]
    assert a.moe_layers == [i for i, t in enumerate(ref.mlp_layer_types) if t == "sparse"]
    assert a.rope_theta == ref.rope_parameters["full_attention"]["rope_theta"]
    assert a.sliding_rope_theta == ref.rope_parameters["sliding_attention"]["rope_theta"]
    assert a.rotary_dim == int(24 * ref.rope_parameters["full_attention"]["partial_rotary_factor"]) == 8
    assert a.sliding_window == ref.sliding_window
    assert MoEConfig.from_dict({**base, "model_type": "mimo_v2_flash", "sliding_window_size": 128}).sliding_window == \
        C(**base, sliding_window_size=128).sliding_window == 129
    d = hf_config("mimo_v2_flash").to_dict()
    d["rope_parameters"]["sliding_attention"]["partial_rotary_factor"] = 0.5
    with pytest.raises(ValueError, match="sliding-layer RoPE"):
        MoEConfig.from_dict(d)


def test_per_layer_heads_dims_and_caches():
    """The sliding layers cache twice the key-value heads, every layer keys of head_dim and values of v_head_dim;
    sinks on the sliding layers only; the fused decode and tensor-parallel head splits step aside by name."""
    from runtime.model.layers.attention import Attention
    from runtime.store.slices import Shard
    cfg = MoEConfig.from_dict(hf_config("mimo_v2_flash").to_dict())
    specs = cache_specs(cfg)
    assert (specs[0].heads, specs[0].dim, specs[0].v_dim) == (2, 24, 16) and not hasattr(specs[0], "window")
    assert (specs[1].heads, specs[1].dim, specs[1].v_dim, specs[1].window) == (4, 24, 16, 6)
    assert specs[1].bytes_per_sequence(torch.float32) == 6 * 4 * (24 + 16) * 4
    assert [cfg.sinks_on(i) for i in range(3)] == [False, True, True]
    t = Attention.tensors(cfg, 1)
    assert t["model.layers.1.self_attn.v_proj.weight"] == (4 * 16, 64)
    assert t["model.layers.1.self_attn.o_proj.weight"] == (64, 4 * 16) and "model.layers.0.self_attn.sinks" not in \
        Attention.tensors(cfg, 0)
    assert "MiMo" in Attention.head_split(cfg, Shard(0, 2)).why
