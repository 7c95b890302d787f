"""Hybrid-attention models (issue 12): Kimi-Linear (KDA + MLA), Qwen3-Next / Qwen3.5 (Gated DeltaNet +
gated attention); one cache budget for per-token KV and per-sequence recurrent state. The logits /
greedy / batched / tier / replay checks against transformers run for them with every other
architecture (conftest ARCHS); these are the parts specific to them."""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from runtime.engine import Engine, SamplingParams
from runtime.engine.kv_manager import KVManager
from runtime.model import MoEConfig, Sequence, load_model
from runtime.model.convert import convert, load_dense
from runtime.model.linear_attention import GatedDeltaNet, GatedDeltaNetConfig, KDAConfig, KimiDeltaAttention
from runtime.model.moe import StateCacheSpec, TokenCacheSpec

from conftest import build_hf
from helpers import check_against_transformers, feed


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("kimi"))
    ref = build_hf("kimi_linear", os.path.join(d, "hf"))
    convert(os.path.join(d, "hf"), os.path.join(d, "store"))
    return ref, os.path.join(d, "hf"), os.path.join(d, "store")


def test_chunked_prefill_logits_match_transformers(kimi):
    """Prefill in chunks of 5 (the chunked delta rule, state carried between chunks) gives
    transformers' logits at every chunk end."""
    ref, _, store_dir = kimi
    prompt = torch.randint(0, 96, (1, 23), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = ref(prompt).logits[0]
    model, store = load_model(store_dir)
    try:
        s, got = Sequence(), []
        for a in range(0, 23, 5):
            got.append((min(a + 5, 23) - 1, feed(model, [s], [prompt[0, a:a + 5].tolist()])[0]))
        for pos, logits in got:
            assert (logits - want[pos]).abs().max().item() < 1e-4, pos
    finally:
        store.close()


def test_released_config_form_equals_transformers_form(kimi):
    """The released checkpoint's config (linear_attn_config with 1-indexed kda/full layer lists,
    first_k_dense_replace) and the transformers-saved one (layer_types, mlp_layer_types) describe the
    same model."""
    _, hf_dir, _ = kimi
    d = json.load(open(os.path.join(hf_dir, "config.json")))
    a = MoEConfig.from_dict(d)
    rel = {k: v for k, v in d.items() if k not in ("layer_types", "mlp_layer_types", "linear_head_dim", "linear_num_heads",
                                                    "linear_conv_kernel_dim")}
    rel.update(linear_attn_config={"kda_layers": [1, 3], "full_attn_layers": [2], "head_dim": 16, "num_heads": 4,
                                   "short_conv_kernel_size": 4}, first_k_dense_replace=1, mla_use_nope=True,
               moe_router_activation_func="sigmoid")
    b = MoEConfig.from_dict(rel)
    assert a.linear_layers == b.linear_layers == [0, 2]
    assert a.attention_layers == [1] and a.moe_layers == b.moe_layers == [1, 2]
    assert (b.linear_num_heads, b.linear_head_dim, b.linear_conv_kernel) == (4, 16, 4)
    assert not a.mla_rope and a.shared_intermediate == 32 and a.router == "sigmoid_group"


def test_bad_layer_kinds_and_missing_state_tensor(kimi, tmp_path):
    _, hf_dir, _ = kimi
    d = json.load(open(os.path.join(hf_dir, "config.json")))
    with pytest.raises(ValueError, match=r"layer 1 has kind 'sliding_attention', which tiered-moe does not implement"):
        MoEConfig.from_dict({**d, "layer_types": ["linear_attention", "sliding_attention", "linear_attention"]})
    with pytest.raises(ValueError, match=r"kda_layers names layer 4, outside 1..3"):
        MoEConfig.from_dict({**{k: v for k, v in d.items() if k != "layer_types"},
                             "linear_attn_config": {"kda_layers": [1, 4], "full_attn_layers": [2]}})
    with pytest.raises(ValueError, match="moe_router_activation_func 'softmax'"):
        MoEConfig.from_dict({**d, "moe_router_activation_func": "softmax"})
    # A checkpoint without a KDA layer's convolution weights: the error names the tensor.
    m = str(tmp_path / "m")
    shutil.copytree(hf_dir, m)
    f = os.path.join(m, "model.safetensors")
    w = load_file(f)
    victim = "model.layers.2.self_attn.k_conv1d.weight"
    save_file({k: v for k, v in w.items() if k != victim}, f)
    with pytest.raises(ValueError, match=f"tensor {victim!r} is missing"):
        convert(m, str(tmp_path / "s"))


def test_cache_specs_and_one_budget(kimi):
    """Per-layer specs: MLA layers cache latent + rotary key per token, KDA layers a fixed state per
    sequence; the budget pays for state slots first and states the minimum when too small."""
    _, _, store_dir = kimi
    model, store = load_model(store_dir)
    try:
        specs = model.cache_specs()
        assert specs[1] == TokenCacheSpec(1, 16 + 8, False)
        assert specs[0] == specs[2] == StateCacheSpec(recurrent=(4, 16, 16), conv=(3 * 64, 3))
        f32 = 4   # a float32 checkpoint: activations and KV in float32
        assert model.kv_bytes_per_token() == 1 * (16 + 8) * f32                        # one MLA layer
        per_seq = 2 * (4 * 16 * 16 * 4 + 3 * 64 * 3 * f32)                            # two KDA layers
        assert model.state_bytes_per_sequence() == per_seq
        assert model.cache_bytes(1000) == 1000 * 24 * f32 + per_seq
        kv = model.init_kv(3 * per_seq + 10 * 16 * 24 * f32, max_seqs=3)
        assert (kv.state_slots, kv.num_blocks, KVManager.for_cache(kv).free_sequences) == (3, 10, 3)
        assert kv.nbytes == 3 * per_seq + 10 * 16 * 24 * f32
        with pytest.raises(ValueError, match=rf"the recurrent state of 3 sequences \({3 * per_seq:,} bytes\).*the minimum is "
                                             rf"{3 * per_seq + 16 * 24 * f32:,} bytes"):
            model.init_kv(3 * per_seq, max_seqs=3)
    finally:
        store.close()


def load_dense_bytes(store_dir):
    return list(load_dense(store_dir, MoEConfig.from_hf(store_dir)).values())


def test_device_budget_minimum_counts_the_state_of_max_batch_sequences(kimi):
    _, _, store_dir = kimi
    model, store = load_model(store_dir)
    try:
        dense = sum(t.numel() * 4 for t in load_dense_bytes(store_dir))
        per_seq = model.state_bytes_per_sequence()
        experts = model.cfg.top_k * store.m.blob_stride
    finally:
        store.close()
    need = dense + 8 * per_seq + experts
    with pytest.raises(ValueError, match=rf"the fixed per-sequence caches \(recurrent state, sliding-window rings\) of "
                                         rf"--max-batch 8 sequences \({8 * per_seq:,} bytes\).*"
                                         rf"the minimum is {need:,} bytes"):
        load_model(store_dir, device_budget=need - 1, max_batch=8)
    _, st = load_model(store_dir, device_budget=need, max_batch=8)
    st.close()


def test_state_slots_limit_admission_and_are_reset(kimi):
    """With one state slot, requests run one after the other; each starts from a zero state in the
    slot the one before left (same tokens as decoding alone), also a one-token prompt, whose first
    step is a decode-shaped step."""
    _, _, store_dir = kimi
    prompts = [[5, 9, 11, 2, 40, 7], [60], [60, 3, 3, 17]]
    alone = []
    for p in prompts:
        model, store = load_model(store_dir)
        try:
            eng = Engine(model, store, max_batch=1)
            rid = eng.add_request(p, SamplingParams(max_tokens=10, ignore_eos=True))
            eng.run()
            alone.append(eng.done[rid].output)
        finally:
            store.close()
    model, store = load_model(store_dir)
    try:
        model.init_kv(model.state_bytes_per_sequence() + 4 * 16 * model.kv_bytes_per_token(), max_seqs=1)
        eng = Engine(model, store, max_batch=2)
        ids = [eng.add_request(p, SamplingParams(max_tokens=10, ignore_eos=True)) for p in prompts]
        eng.step()
        assert len(eng.running) == 1 and eng.kv.free_sequences == 0     # the others wait for the slot
        eng.run()
        assert [eng.done[i].output for i in ids] == alone
        assert eng.kv.free_sequences == 1
    finally:
        store.close()


def check_step_against_call(layer, prefills):
    """Sequences after prefills of the given lengths, then one decode token each: the batched
    ``step`` against ``__call__`` on each sequence alone. Returns (x, new recurrent, new conv)."""
    states = [layer(torch.randn(n, 32))[1] for n in prefills]
    x = torch.randn(len(prefills), 32)
    y, rec, conv = layer.step(x, torch.stack([s.recurrent for s in states]), torch.stack([s.conv for s in states]))
    for b, s in enumerate(states):
        yb, sb = layer(x[b:b + 1], s, mode="recurrent")
        assert torch.allclose(y[b], yb[0], atol=1e-5)
        assert torch.allclose(rec[b], sb.recurrent, atol=1e-5) and torch.allclose(conv[b], sb.conv, atol=1e-6)
    return x, rec, conv


def test_batched_step_equals_each_sequence_alone():
    """KimiDeltaAttention.step (decode, B sequences with their own states) against __call__ per sequence."""
    torch.manual_seed(0)
    cfg = KDAConfig(hidden_size=32, num_heads=2, head_dim=8)
    HK = 16
    shapes = {"q_proj.weight": (HK, 32), "k_proj.weight": (HK, 32), "v_proj.weight": (HK, 32),
              "q_conv1d.weight": (HK, 1, 4), "k_conv1d.weight": (HK, 1, 4), "v_conv1d.weight": (HK, 1, 4),
              "f_a_proj.weight": (8, 32), "f_b_proj.weight": (HK, 8), "dt_bias": (HK,), "A_log": (2,),
              "b_proj.weight": (2, 32), "g_a_proj.weight": (8, 32), "g_b_proj.weight": (HK, 8), "o_norm.weight": (8,),
              "o_proj.weight": (32, HK)}
    layer = KimiDeltaAttention(cfg, {k: torch.randn(s) * 0.5 for k, s in shapes.items()})
    _, rec, _ = check_step_against_call(layer, (3, 7, 1))              # three sequences after different prefills
    assert torch.isfinite(rec).all() and rec.abs().max() > 0


def test_gated_deltanet_batched_step_equals_each_sequence_alone():
    torch.manual_seed(1)
    cfg = GatedDeltaNetConfig(hidden_size=32, num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=6)
    conv = 2 * 16 + 24
    shapes = {"in_proj_qkv.weight": (conv, 32), "in_proj_z.weight": (24, 32), "in_proj_b.weight": (4, 32),
              "in_proj_a.weight": (4, 32), "conv1d.weight": (conv, 1, 4), "dt_bias": (4,), "A_log": (4,),
              "norm.weight": (6,), "out_proj.weight": (32, 24)}
    layer = GatedDeltaNet(cfg, {k: torch.randn(s) * 0.5 for k, s in shapes.items()})
    x, rec, cv = check_step_against_call(layer, (2, 9))
    with pytest.raises(ValueError, match=r"decode states must be \[2, 4, 8, 6\]"):
        layer.step(x, rec[:, :, :, :5], cv)


def test_qwen3_next_config_and_cache_specs(tmp_path):
    """Qwen3-Next's default layer kinds (every 4th layer full attention), partial RoPE, Gated DeltaNet
    state shapes; partial RoPE stays refused for architectures that do not use it."""
    d = dict(model_type="qwen3_next", vocab_size=96, hidden_size=64, num_hidden_layers=8, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, intermediate_size=48, moe_intermediate_size=32, num_experts=16,
             num_experts_per_tok=2, shared_expert_intermediate_size=48, linear_num_key_heads=2,
             linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=6,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
    c = MoEConfig.from_dict(d)
    assert c.attention_layers == [3, 7] and c.linear_layers == [0, 1, 2, 4, 5, 6]
    assert c.rotary_dim == 4 and c.attn_output_gate and c.norm_offset == 1.0
    from runtime.model.moe import cache_specs, kv_bytes_per_token, state_bytes_per_sequence
    specs = cache_specs(c)
    assert specs[0] == StateCacheSpec(recurrent=(4, 8, 6), conv=(2 * 16 + 24, 3))
    assert specs[3] == TokenCacheSpec(2, 16, True)
    assert kv_bytes_per_token(c, torch.bfloat16) == 2 * (2 * 16 * 2 * 2)
    assert state_bytes_per_sequence(c, torch.bfloat16) == 6 * (4 * 8 * 6 * 4 + 56 * 3 * 2)
    with pytest.raises(ValueError, match="layer 2 has kind 'mamba'"):
        MoEConfig.from_dict({**d, "layer_types": ["linear_attention"] * 2 + ["mamba"] + ["full_attention"] * 5})
    with pytest.raises(ValueError, match="partial_rotary_factor is not supported for qwen3_moe"):
        MoEConfig.from_dict({**d, "model_type": "qwen3_moe"})


@pytest.mark.slow
def test_qwen3_5_multimodal_checkpoint_loads_its_language_model(tmp_path):
    """The released Qwen3.5-MoE layout: config under text_config, the language model under
    model.language_model., a vision tower beside it. Converting reads the language model only (the
    vision tensors are reported as not read) and decodes as transformers' multimodal model does on text."""
    import transformers
    torch.manual_seed(0)
    text = dict(vocab_size=96, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=256, num_experts=16, num_experts_per_tok=2,
                moe_intermediate_size=32, shared_expert_intermediate_size=48, linear_num_key_heads=2,
                linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                layer_types=["linear_attention", "full_attention", "linear_attention"],
                eos_token_id=None, bos_token_id=None, pad_token_id=None)
    vision = dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, patch_size=4,
                  temporal_patch_size=2, spatial_merge_size=2)
    ref = transformers.Qwen3_5MoeForConditionalGeneration(
        transformers.Qwen3_5MoeConfig(text_config=text, vision_config=vision)).eval()
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if "norm" not in n and not n.endswith(("A_log", "dt_bias")):
                p.mul_(4.0)
    hf, store = str(tmp_path / "hf"), str(tmp_path / "store")
    ref.save_pretrained(hf)
    rep = convert(hf, store)
    assert rep.unread and all(n.startswith("model.visual.") for n in rep.unread)
    cfg = MoEConfig.from_hf(store)
    assert cfg.model_type == "qwen3_5_moe_text" and cfg.lm_prefix == "model.language_model."
    check_against_transformers(ref, store, 1.0, "qwen3_5_moe")
    with pytest.raises(ValueError, match="qwen3_5_moe config.json has no text_config"):
        MoEConfig.from_dict({"model_type": "qwen3_5_moe"}, source="c.json")


@pytest.mark.parametrize("arch", ["mixtral_swa", "gpt_oss"])
def test_sliding_window_layers_keep_a_ring_of_the_window(arch, tmp_path):
    """Sliding-window layers cache only their last W keys per sequence (a ring in the sequence's
    slot), full-attention layers stay paged. A prefill chunk longer than the ring, then decode past
    several wraps, gives transformers' logits at every position."""
    ref = build_hf(arch, str(tmp_path / "hf"))
    convert(str(tmp_path / "hf"), str(tmp_path / "store"))
    model, store = load_model(str(tmp_path / "store"))
    try:
        cfg = model.cfg
        W = cfg.sliding_window
        specs = model.cache_specs()
        from runtime.model.moe import WindowCacheSpec
        assert {i for i, s in specs.items() if isinstance(s, WindowCacheSpec)} == set(cfg.sliding_layers)
        assert all(s.window == W for s in specs.values() if isinstance(s, WindowCacheSpec))
        per_tok = model.kv_bytes_per_token()
        assert per_tok == len(cfg.paged_layers) * 2 * cfg.num_kv_heads * cfg.head_dim * 4
        prompt = torch.randint(0, 96, (1, 3 * W + 4), generator=torch.Generator().manual_seed(7))
        with torch.no_grad():
            want = ref(prompt).logits[0]
        s = Sequence()
        first = 2 * W + 1                                                # longer than the ring
        got = [(first - 1, feed(model, [s], [prompt[0, :first].tolist()])[0])]
        got += [(p, feed(model, [s], [[int(prompt[0, p])]])[0]) for p in range(first, prompt.shape[1])]
        for p, logits in got:
            assert (logits - want[p]).abs().max().item() < 1e-4, p
    finally:
        store.close()
