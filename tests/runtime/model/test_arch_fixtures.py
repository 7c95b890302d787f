"""The per-architecture fixtures (conftest ARCHS) and the architectures of issue 17 item 6: every
fixture's config is its transformers class's with no field the class does not define; the new
architectures' router variants, layouts and released config forms against transformers' own code;
their unsupported options refused by name. The logits / greedy / batched / tier / replay / conversion
checks run for them with every other architecture (ARCHS)."""
import json
import os
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from runtime.model import MoEConfig
from runtime.model.convert import convert, dense_names
from runtime.model.layers.router import route

from conftest import ARCHS, build_hf, fixture_kwargs, hf_config, transformers, undefined_fields


@pytest.mark.parametrize("name", list(ARCHS))
def test_fixture_configs_define_every_field(name):
    """A strict transformers 5 config keeps (and saves) any keyword, defined or not: a fixture leaning on
    one its class does not define tests a config no release has (Qwen3.5 once got an intermediate_size)."""
    C, kw = fixture_kwargs(name)
    assert undefined_fields(C, kw) == [], name


def test_the_field_check_names_undefined_fields(monkeypatch):
    """The check refuses a fixture that adds a field its class (or its text_config's class) does not
    define, and accepts attribute_map aliases."""
    cfg_cls, model_cls, kw = ARCHS["qwen3_5_moe_text"]
    monkeypatch.setitem(ARCHS, "qwen3_5_moe_text", (cfg_cls, model_cls, {**kw, "intermediate_size": 48}))
    with pytest.raises(ValueError, match="Qwen3_5MoeTextConfig does not define intermediate_size"):
        hf_config("qwen3_5_moe_text")
    cfg_cls, model_cls, kw = ARCHS["kimi_k25"]
    monkeypatch.setitem(ARCHS, "kimi_k25", (cfg_cls, model_cls, {**kw, "text_config": {**kw["text_config"],
                                                                                        "rotary_dim": 4}}))
    with pytest.raises(ValueError, match=r"does not define text_config\.rotary_dim"):
        hf_config("kimi_k25")
    assert undefined_fields(transformers.Ernie4_5_MoeConfig, {"num_experts": 8, "moe_k": 2}) == []   # an alias
    assert undefined_fields(transformers.Qwen3MoeConfig, {"head_dim": 16}) == ["head_dim"]


def test_an_all_moe_model_needs_no_dense_intermediate():
    """Qwen3.5's text config has no intermediate_size (every layer is MoE, whatever mlp_only_layers says);
    a model with a dense layer still needs one."""
    d = hf_config("qwen3_5_moe_text").to_dict()
    assert "intermediate_size" not in d
    c = MoEConfig.from_dict({**d, "mlp_only_layers": [1]})
    assert c.moe_layers == [0, 1, 2] and c.dense_intermediate == 0
    n = hf_config("qwen3_next").to_dict()
    del n["intermediate_size"]
    with pytest.raises(ValueError, match="missing config field intermediate_size"):
        MoEConfig.from_dict(n)
    assert MoEConfig.from_dict({**n, "mlp_only_layers": []}).dense_intermediate == 0


def test_minimax_released_rotary_dim_reads_as_transformers_partial_rotary_factor():
    d = hf_config("minimax_m2").to_dict()
    released = {**d, "rotary_dim": 8, "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0}}
    a, b = MoEConfig.from_dict(d), MoEConfig.from_dict(released)
    assert a.rotary_dim == b.rotary_dim == 8 and a == b


# -- router variants against transformers' router modules ------------------------------------------

def _as_dict(ids, w):
    return [{int(e): float(x) for e, x in zip(i, ww)} for i, ww in zip(ids, w.detach())]


def _same_routing(ours, theirs):
    for a, b in zip(_as_dict(*ours), _as_dict(*theirs)):
        assert a.keys() == b.keys() and all(abs(a[e] - b[e]) < 1e-6 for e in a)


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_deepseek_v2_router_equals_transformers(method):
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    c = transformers.DeepseekV2Config(vocab_size=32, hidden_size=16, intermediate_size=8, num_hidden_layers=2,
                                      num_attention_heads=2, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                                      topk_group=2, topk_method=method, routed_scaling_factor=2.5,
                                      moe_intermediate_size=8, first_k_dense_replace=1)
    torch.manual_seed(1)
    r = DeepseekV2TopkRouter(c)
    r.weight.data.normal_()
    x = torch.randn(64, 16)
    _, w, ids = r(x)
    cfg = MoEConfig.from_dict(c.to_dict())
    assert cfg.router == ("softmax_group" if method == "group_limited_greedy" else "softmax_topk")
    _same_routing(route(F.linear(x, r.weight), cfg), (ids, w))


def test_ernie_router_equals_transformers():
    from transformers.models.ernie4_5_moe.modeling_ernie4_5_moe import Ernie4_5_MoeTopKRouter
    c = transformers.Ernie4_5_MoeConfig(vocab_size=32, hidden_size=16, intermediate_size=8, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, moe_num_experts=16, moe_k=4,
                                        moe_intermediate_size=8)
    torch.manual_seed(2)
    r = Ernie4_5_MoeTopKRouter(c)
    r.weight.data.normal_()
    r.moe_statics.e_score_correction_bias.data.normal_(std=0.05)
    x = torch.randn(64, 16)
    _, w, ids = r(x)
    cfg = MoEConfig.from_dict(c.to_dict())
    assert cfg.router == "softmax_bias"
    _same_routing(route(F.linear(x, r.weight), cfg, r.moe_statics.e_score_correction_bias), (ids, w))
    # the bias only chooses: with a large one on expert 3 it is always chosen, its weight the unbiased one
    bias = torch.zeros(1, 16)
    bias[0, 3] = 10.0
    ids, w = route(F.linear(x, r.weight), cfg, bias)
    assert (ids == 3).any(-1).all()


# -- layouts --------------------------------------------------------------------------------------

def test_ernie_interleaved_rope_equals_rotate_half_on_deinterleaved_heads():
    """Conversion's q/k row reordering: transformers' interleaved RoPE scores equal rotate-half RoPE
    scores of the reordered heads, so the forward pass needs no interleaved RoPE of its own."""
    from transformers.models.ernie4_5_moe import modeling_ernie4_5_moe as me
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as rotate_half_rope

    from runtime.model.arch.ernie4_5_moe import deinterleave_rows
    c = transformers.Ernie4_5_MoeConfig(hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                                        num_hidden_layers=1, vocab_size=8)
    hd, T = 16, 7
    torch.manual_seed(3)
    wq, wk, x = torch.randn(2 * hd, 32), torch.randn(hd, 32), torch.randn(T, 32)
    cos, sin = me.Ernie4_5_MoeRotaryEmbedding(c)(x, torch.arange(T)[None])
    q, k = (x @ wq.t()).view(1, T, 2, hd).transpose(1, 2), (x @ wk.t()).view(1, T, 1, hd).transpose(1, 2)
    qe, ke = me.apply_rotary_pos_emb(q, k, cos, sin)
    want = qe @ ke.transpose(-1, -2)
    q2 = (x @ deinterleave_rows(wq, 2, hd).t()).view(1, T, 2, hd).transpose(1, 2)
    k2 = (x @ deinterleave_rows(wk, 1, hd).t()).view(1, T, 1, hd).transpose(1, 2)
    qe2, ke2 = rotate_half_rope(q2, k2, cos, sin)
    assert torch.allclose(qe2 @ ke2.transpose(-1, -2), want, atol=1e-4)
    assert not torch.allclose(q2, q)


def test_qwen3_vl_mrope_is_plain_rope_on_text_positions():
    """Interleaved MRoPE gives each frequency the temporal, height or width position; text tokens have
    the three equal, and then it is plain RoPE with the runtime's frequencies."""
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeTextRotaryEmbedding

    from runtime.model.layers.rope import rope_frequencies
    c = transformers.Qwen3VLMoeTextConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=1, vocab_size=8,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0, "mrope_section": [2, 3, 3],
                         "mrope_interleaved": True})
    rot = Qwen3VLMoeTextRotaryEmbedding(c)
    T = 11
    x = torch.zeros(1, T, 64)
    cos, sin = rot(x, torch.arange(T).view(1, 1, T).expand(3, 1, T))
    d = transformers.Qwen3VLMoeConfig(text_config={**c.to_dict(), "num_local_experts": 4}).to_dict()
    inv, factor = rope_frequencies(MoEConfig.from_dict(d))
    freqs = torch.arange(T)[:, None].float() * inv
    emb = torch.cat([freqs, freqs], -1)
    assert factor == 1.0 and torch.allclose(cos[0], emb.cos(), atol=1e-6) and torch.allclose(sin[0], emb.sin(), atol=1e-6)
    hw = torch.stack([torch.arange(T), torch.zeros(T, dtype=torch.long), 2 * torch.arange(T)]).view(3, 1, T)
    assert not torch.allclose(rot(x, hw)[0][0], emb.cos())   # image positions: it is MRoPE


@pytest.fixture(scope="module")
def qwen3_vl(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("qwen3_vl"))
    build_hf("qwen3_vl_moe", os.path.join(d, "hf"))
    return d


def test_qwen3_vl_fused_experts_either_orientation_convert_alike(qwen3_vl):
    """The release ships each layer's experts fused input-major ([E, H, 2I], [E, I, H]); transformers
    5.24 saves them output-major. Both convert to the same store; only the vision tower is unread."""
    hf, d = os.path.join(qwen3_vl, "hf"), qwen3_vl
    saved = os.path.join(d, "saved")
    shutil.copytree(hf, saved)
    f = [n for n in os.listdir(saved) if n.endswith(".safetensors")][0]
    w = load_file(os.path.join(saved, f))
    fused = [k for k in w if k.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"))]
    assert fused and all(w[k].shape[1] == 64 for k in fused if k.endswith("gate_up_proj"))   # [E, H, 2I] as released
    save_file({k: (v.transpose(1, 2).contiguous() if k in fused else v) for k, v in w.items()}, os.path.join(saved, f))
    rep = convert(hf, os.path.join(d, "s1"))
    convert(saved, os.path.join(d, "s2"))
    assert rep.unread and all(n.startswith("model.visual.") for n in rep.unread)
    for n in sorted(os.listdir(os.path.join(d, "s1"))):
        if n.endswith(".bin"):
            assert open(os.path.join(d, "s1", n), "rb").read() == open(os.path.join(d, "s2", n), "rb").read(), n
    a, b = load_file(os.path.join(d, "s1", "dense.safetensors")), load_file(os.path.join(d, "s2", "dense.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    cfg = MoEConfig.from_hf(os.path.join(d, "s1"))
    assert (cfg.model_type, cfg.lm_prefix, cfg.norm_topk_prob, cfg.tie_word_embeddings) == (
        "qwen3_moe", "model.language_model.", True, False)
    bad = dict(w)
    bad[fused[0]] = w[fused[0]][:, :, :-1].contiguous()
    save_file(bad, os.path.join(saved, f))
    with pytest.raises(ValueError, match=rf"tensor {fused[0]!r} has shape .*, expected"):
        convert(saved, os.path.join(d, "s3"))


def test_kimi_k25_released_layout(tmp_path):
    """Kimi K2.5 as released: the language model under language_model.model. with its head at
    language_model.lm_head.weight, text_config's model_type kimi_k2 (deepseek_v3 as transformers saves
    it); the vision tower and projector are reported as not read."""
    hf = str(tmp_path / "hf")
    build_hf("kimi_k25", hf)
    rep = convert(hf, str(tmp_path / "s"))
    assert rep.unread and all(n.startswith(("vision_tower.", "mm_projector.", "model.mm_projector.")) for n in rep.unread)
    d = json.load(open(os.path.join(hf, "config.json")))
    a = MoEConfig.from_dict(d)
    assert (a.model_type, a.lm_prefix, a.lm_head_name, a.tie_word_embeddings) == (
        "deepseek_v3", "language_model.model.", "language_model.lm_head.weight", False)
    released = {**d, "text_config": {**d["text_config"], "model_type": "kimi_k2"}}
    del released["tie_word_embeddings"]                 # the language model's own flag then decides
    assert MoEConfig.from_dict(released) == a
    assert "lm_head.weight" in load_file(str(tmp_path / "s" / "dense.safetensors"))


def test_kolibri_router_equals_transformers():
    """Kolibri's router - top-k of the logits + correction bias, the chosen logits' sigmoid, renormalised - against
    transformers' own on the same logits and bias."""
    import transformers
    torch.manual_seed(0)
    c = hf_config("kolibri1")
    r = transformers.models.kolibri1.modeling_kolibri1.Kolibri1TopKRouter(c)
    with torch.no_grad():
        r.weight.normal_()
        r.e_score_correction_bias.normal_()
    x = torch.randn(11, c.hidden_size)
    _, w_ref, ids_ref = r(x)
    cfg = MoEConfig.from_dict(json.loads(c.to_json_string(use_diff=False)), source="c.json")
    ids, w = route(F.linear(x, r.weight), cfg, r.e_score_correction_bias)
    order, order_ref = ids.sort(-1), ids_ref.sort(-1)
    assert torch.equal(order.values, order_ref.values)
    assert torch.allclose(w.gather(1, order.indices), w_ref.gather(1, order_ref.indices), atol=1e-6)


def test_qwen3_omni_released_layout(tmp_path):
    """Qwen3-Omni as released: the thinker's config under thinker_config and its tensors under thinker.model. /
    thinker.lm_head (talker and code-to-wave beside them, not read) - the same store as the thinker's own layout."""
    hf = str(tmp_path / "hf")
    build_hf("qwen3_omni_moe_thinker", hf)
    convert(hf, str(tmp_path / "thinker"))
    rel = tmp_path / "rel"
    rel.mkdir()
    d = json.load(open(os.path.join(hf, "config.json")))
    json.dump({"model_type": "qwen3_omni_moe", "thinker_config": d, "talker_config": {"model_type": "talker"},
               "enable_audio_output": True}, open(rel / "config.json", "w"))
    w = load_file(os.path.join(hf, "model.safetensors"))
    save_file({**{"thinker." + k: v for k, v in w.items()}, "talker.model.norm.weight": torch.ones(4)},
              str(rel / "model.safetensors"))
    rep = convert(str(rel), str(tmp_path / "s"))
    assert "talker.model.norm.weight" in rep.unread
    a, b = load_file(str(tmp_path / "thinker" / "dense.safetensors")), load_file(str(tmp_path / "s" / "dense.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert MoEConfig.from_hf(str(tmp_path / "s")).lm_prefix == "thinker.model."


# -- unsupported options, by name -----------------------------------------------------------------

def _lm(d):
    return d["text_config"] if isinstance(d.get("text_config"), dict) else d


BAD = [
    ("deepseek_v2", {"topk_method": "noaux_tc"}, "topk_method 'noaux_tc' is not supported for deepseek_v2"),
    ("deepseek_v2", {"scoring_func": "sigmoid"}, "scoring_func 'sigmoid' is not supported for deepseek_v2"),
    ("deepseek_v2", {"norm_topk_prob": True}, "norm_topk_prob true is not supported for deepseek_v2"),
    ("deepseek_v2", {"moe_layer_freq": 2}, "moe_layer_freq 2 is not supported for deepseek_v2"),
    ("deepseek_v2", {"mlp_bias": True}, "mlp_bias is not supported for deepseek_v2"),
    ("deepseek_v2", {"topk_group": 1, "num_experts_per_tok": 5}, "group_limited_greedy needs"),
    ("deepseek_v2", {"attention_bias": True}, "attention_bias with MLA is not supported"),
    ("glm4_moe_lite", {"mlp_layer_types": ["dense", "moe", "sparse"]}, "mlp_layer_types must give"),
    ("glm4_moe_lite", {"mlp_layer_types": None, "first_k_dense_replace": 2}, "first_k_dense_replace 2 without"),
    ("glm4_moe_lite", {"topk_method": "greedy"}, "topk_method 'greedy' / scoring_func None are not supported"),
    ("dots1", {"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ("dots1", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}, "rope_type 'dynamic'"),
    ("dots1", {"n_group": 3}, "n_group 3 / topk_group 2 do not divide"),
    ("ernie4_5_moe", {"use_bias": True}, "use_bias .* is not supported for ernie4_5_moe"),
    ("ernie4_5_moe", {"moe_norm_min": 1e-6}, "moe_norm_min 1e-06 is not supported"),
    ("ernie4_5_moe", {"moe_layer_start_index": [1, 1]}, r"moe_layer_start_index \[1, 1\] is not supported"),
    ("ernie4_5_moe", {"moe_layer_interval": 0}, "moe_layer_interval 0 must be positive"),
    ("kimi_k25", {"model_type": "qwen3_moe"}, "kimi_k25 text_config model_type 'qwen3_moe' is not supported"),
    ("kimi_k25", {"attention_bias": True}, "attention_bias with MLA is not supported"),
    ("qwen3_vl_moe", {"model_type": "qwen3_moe"}, "qwen3_vl_moe text_config model_type 'qwen3_moe' is not supported"),
    ("qwen3_vl_moe", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}},
     "rope_type 'dynamic'"),
    ("glm4v_moe", {"model_type": "glm4_moe"}, "glm4v_moe text_config model_type 'glm4_moe' is not supported"),
    ("qwen3_omni_moe_thinker", {"model_type": "qwen3_moe"},
     "qwen3_omni_moe_thinker text_config model_type 'qwen3_moe' is not supported"),
    ("minicpm5_moe", {"use_gated_attention": False}, "without gated attention"),
    ("minicpm5_moe", {"mlp_layer_types": ["dense", "moe", "sparse"]}, "mlp_layer_types must give"),
    ("hy_v3", {"mlp_bias": True}, "mlp_bias is not supported for hy_v3"),
    ("hunyuan_v1_moe", {"use_cla": True}, "use_cla .cross-layer attention. is not supported"),
    ("flex_olmo", {"clip_qkv": 8.0}, "clip_qkv is not supported yet"),
    ("mellum", {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 5e5},
                                    "sliding_attention": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0,
                                                          "original_max_position_embeddings": 16}}},
     "mellum's sliding-layer RoPE .* is not supported"),
    ("mistral4", {"n_group": 2, "topk_group": 1}, "mistral4 with n_group 2 is not supported"),
    ("mistral4", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, "mistral4 with RoPE 'default'"),
    ("granitemoe_swa", {"layer_rope_theta": [1e4, 5e5, 0]}, r"several non-zero thetas \[10000.0, 500000.0\]"),
    ("granitemoe_swa", {"layer_rope_theta": [1e4, 0]}, "layer_rope_theta has 2 entries for 3 layers"),
    ("hunyuan_v1_moe", {"moe_topk": [2, 1, 2]}, r"moe_topk differs between layers \(\[2, 1, 2\]\)"),
    ("hunyuan_v1_moe", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}},
     "dynamic RoPE without alpha"),
    ("llama4_text", {"layer_types": ["chunked_attention", "sliding_attention", "full_attention"]},
     "layer_types must give one of chunked_attention / full_attention for each of 3 layers"),
    ("llama4_text", {"attention_chunk_size": 0}, "chunked_attention layers without an attention_chunk_size"),
    ("llama4_text", {"no_rope_layers": [1, 0]}, "no_rope_layers has 2 entries for 3 layers"),
    ("llama4_text", {"floor_scale": 0}, "floor_scale 0 must be positive"),
    ("llama4_text", {"sliding_window": 4}, "sliding_window is not supported for llama4_text"),
    ("llama4_text", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}},
     "llama3 RoPE needs factor, low_freq_factor, high_freq_factor, original_max_position_embeddings"),
    ("llama4", {"model_type": "llama4_vision_model"},
     "llama4 text_config model_type 'llama4_vision_model' is not supported"),
    ("deepseek_v32", {"q_lora_rank": 0}, "indexer reads the q LoRA residual: it needs a q_lora_rank, got 0"),
    ("deepseek_v32", {"index_topk": 0}, "needs positive index_n_heads and index_topk .* got 8 / 0 / 16"),
    ("deepseek_v32", {"index_head_dim": 4}, "an index_head_dim of at least qk_rope_head_dim 8"),
    ("deepseek_v32", {"scoring_func": "softmax"}, "scoring_func 'softmax' are not supported for deepseek_v32"),
    ("glm_moe_dsa", {"indexer_types": ["shared", "full", "full"]}, "indexer_types starts with a shared layer"),
    ("glm_moe_dsa", {"indexer_types": ["full", "sparse", "full"]}, "indexer_types must give 'full' or 'shared'"),
    ("glm_moe_dsa", {"indexer_types": None, "index_topk_pattern": "FSX"}, "letters F .full. and S .shared."),
]


@pytest.mark.parametrize("arch,change,msg", BAD, ids=[f"{a}-{'-'.join(c)}" for a, c, _ in BAD])
def test_unsupported_options_are_refused_by_name(arch, change, msg):
    d = json.loads(hf_config(arch).to_json_string(use_diff=False))
    _lm(d).update(change)
    d = {k: v for k, v in d.items() if v is not None or k not in change}
    with pytest.raises(ValueError, match=msg):
        dense_names(MoEConfig.from_dict(d, source="c.json"))


@pytest.mark.parametrize("arch", ["kimi_k25", "qwen3_vl_moe", "glm4v_moe", "llama4"])
def test_multimodal_config_without_text_config(arch):
    with pytest.raises(ValueError, match=f"c.json: {arch} config.json has no text_config"):
        MoEConfig.from_dict({"model_type": arch}, source="c.json")


def test_an_unknown_qk_norm_is_refused_by_name():
    """A q/k norm placement the attention does not implement is an error at the config, not a silent no-norm."""
    import dataclasses
    cfg = MoEConfig.from_dict(json.loads(hf_config("hunyuan_v1_moe").to_json_string(use_diff=False)), source="c.json")
    assert cfg.qk_norm == "head_post_rope"
    with pytest.raises(ValueError, match="qk_norm 'after_o' is not one of none, head, full, head_post_rope"):
        dataclasses.replace(cfg, qk_norm="after_o")


def test_sarvam_mla_original_config_reads_as_transformers_translates_it():
    """The release's remote-code fields (num_shared_experts, head_dim = kv_lora_rank + rope, deepseek_yarn) read
    as the DeepSeek-V3 format transformers translates them to: the same MoEConfig."""
    import transformers
    d = json.loads(hf_config("sarvam_mla").to_json_string(use_diff=False))
    want = MoEConfig.from_dict(d, source="c.json")
    legacy = {k: v for k, v in d.items() if k not in ("n_shared_experts", "rope_parameters", "head_dim")}
    rope = dict(d["rope_parameters"])
    legacy.update(num_shared_experts=d["n_shared_experts"], head_dim=d["kv_lora_rank"] + d["qk_rope_head_dim"],
                  q_head_dim=d["qk_nope_head_dim"] + d["qk_rope_head_dim"],
                  rope_scaling={**{k: v for k, v in rope.items() if k != "rope_type"}, "type": "deepseek_yarn"})
    assert MoEConfig.from_dict(legacy, source="c.json") == want
    hf = transformers.SarvamMLAConfig(**{k: v for k, v in legacy.items() if k != "model_type"})
    assert hf.rope_parameters["rope_type"] == "yarn" and hf.n_shared_experts == d["n_shared_experts"]
