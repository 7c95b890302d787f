"""Llama 4 beside the per-architecture suite (conftest ARCHS ``llama4_text`` / ``llama4``): Llama 3.1's RoPE scaling
against transformers' own (Scout's equal low and high factors included), the layer plans of the released config forms
(which layers are MoE, NoPE, chunked) as transformers' config class derives them, and the fused experts read
input-major where their shape would also fit the output-major reading (hidden = 2 x intermediate)."""
import json

import pytest
import torch

from runtime.model import MoEConfig
from runtime.model.convert import convert
from runtime.model.layers.rope import rope_frequencies

from conftest import ARCHS, build_hf, transformers
from helpers import check_against_transformers

SMALL = dict(vocab_size=96, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             intermediate_size=24, intermediate_size_mlp=48, num_local_experts=4, max_position_embeddings=1 << 17)


def _ours_and_theirs(**kw):
    hf = transformers.Llama4TextConfig(**{**SMALL, **kw})
    return MoEConfig.from_dict(json.loads(hf.to_json_string(use_diff=False)), source="c.json"), hf


@pytest.mark.parametrize("rope", [
    {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    {"factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 1.0, "original_max_position_embeddings": 8192},
    {"factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}])
@pytest.mark.parametrize("head_dim", [16, 128])
def test_llama3_rope_equals_transformers(rope, head_dim):
    """Llama 3.1's scaled inverse frequencies: Llama 3.1's own parameters, Scout's (low = high: no ramp), the test
    fixture's (every band at head_dim 16) - as transformers' Llama 4 rotary embedding computes them."""
    from transformers.models.llama4.modeling_llama4 import Llama4TextRotaryEmbedding
    ours, hf = _ours_and_theirs(head_dim=head_dim, rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, **rope})
    inv, factor = rope_frequencies(ours)
    want = Llama4TextRotaryEmbedding(hf)
    assert factor == want.attention_scaling == 1.0
    assert torch.allclose(inv, want.inv_freq, rtol=1e-6, atol=0) and not torch.isnan(inv).any()


@pytest.mark.parametrize("kw", [
    dict(num_hidden_layers=8),                                          # Scout: every layer MoE, every 4th NoPE
    dict(num_hidden_layers=8, interleave_moe_layer_step=2, use_qk_norm=False),     # Maverick
    dict(num_hidden_layers=6, moe_layers=[0, 5], no_rope_layers=[1, 0, 1, 1, 0, 1], attn_temperature_tuning=False),
    dict(num_hidden_layers=4, attention_chunk_size=None),               # no chunks: every layer full
])
def test_layer_plans_follow_transformers(kw):
    """MoE, NoPE and chunked layers, the q/k norm and the temperature as transformers' config class derives them
    from the released forms (moe_layers null, no_rope_layers empty, layer_types absent - then saved)."""
    ours, hf = _ours_and_theirs(**kw)
    L = hf.num_hidden_layers
    assert ours.moe_layers == hf.moe_layers
    assert ours.nope_layers == [i for i in range(L) if not hf.no_rope_layers[i]]
    chunked = [i for i, t in enumerate(hf.layer_types) if t == "chunked_attention"]
    assert ours.window_layers == chunked and (not chunked or ours.sliding_window == hf.attention_chunk_size)
    assert ours.chunked_windows == bool(chunked)
    assert ours.qk_norm == ("weightless_rope" if hf.use_qk_norm else "none")
    assert ours.q_scale_layers == (ours.nope_layers if hf.attn_temperature_tuning else [])
    assert (ours.q_scale_beta, ours.q_scale_len, ours.q_scale_offset) == (
        (hf.attn_scale, hf.floor_scale, 1) if hf.attn_temperature_tuning else (0.0, hf.floor_scale, 1))
    assert ours.dense_intermediate == (hf.intermediate_size_mlp if len(hf.moe_layers) < L else 0)
    assert ours.shared_intermediate == ours.expert_intermediate == hf.intermediate_size
    assert ours.router_scales_input and ours.router == "logit_bias" and not ours.norm_topk_prob
    # the released configs leave out what transformers defaults
    d = {k: v for k, v in json.loads(hf.to_json_string(use_diff=False)).items()
         if k not in ("head_dim", "rms_norm_eps", "rope_parameters", "attention_chunk_size", "floor_scale")}
    bare = MoEConfig.from_dict({**d, "hidden_size": 5120, "num_attention_heads": 40}, source="c.json")
    assert (bare.head_dim, bare.rms_norm_eps, bare.rope_theta, bare.q_scale_len) == (128, 1e-5, 5e5, 8192)
    assert not bare.window_layers or bare.sliding_window == 8192


def test_fused_experts_read_input_major_when_hidden_is_twice_the_width(tmp_path, monkeypatch):
    """hidden 64 = 2 x intermediate 32: [E, 64, 64] fits both orientations; Llama 4's is input-major (transformers
    keeps it as stored), so that is how it reads - logits and greedy tokens still transformers'."""
    cfg_cls, model_cls, kw = ARCHS["llama4_text"]
    monkeypatch.setitem(ARCHS, "llama4_text", (cfg_cls, model_cls, {**kw, "intermediate_size": 32}))
    ref = build_hf("llama4_text", str(tmp_path / "hf"))
    assert tuple(ref.model.layers[1].feed_forward.experts.gate_up_proj.shape) == (16, 64, 64)
    convert(str(tmp_path / "hf"), str(tmp_path / "store"))
    check_against_transformers(ref, str(tmp_path / "store"), 1.0, "llama4_text")
