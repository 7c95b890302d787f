"""Conversion and loading: bad checkpoints and stores get errors that name the file and tensor."""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from runtime.model import MoEConfig, load_model, route
from runtime.model.convert import convert
from runtime.store import Manifest

from conftest import lm_config


def copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def only_file(d):
    return os.path.join(d, [f for f in os.listdir(d) if f.endswith(".safetensors")][0])


def test_store_layout_and_progress_free_conversion(hf_model):
    name, ref, hf_dir, store_dir = hf_model
    m = Manifest.read(store_dir)
    cfg = MoEConfig.from_hf(hf_dir)
    assert m.num_layers == cfg.num_moe_layers and m.num_experts == 16
    assert m.layer_numbers == cfg.moe_layers
    assert os.path.exists(os.path.join(store_dir, "dense.safetensors"))
    dense = load_file(os.path.join(store_dir, "dense.safetensors"))
    assert not any(".experts." in k for k in dense)
    # every file of the store is readable alike (a container's unprivileged user reads a store root converted)
    mode = lambda f: os.stat(os.path.join(store_dir, f)).st_mode & 0o777   # noqa: E731
    assert mode("dense.safetensors") == mode("layer-000.bin") == mode("manifest.json")


def test_missing_tensor_wrong_shape_truncated_file(hf_model, tmp_path):
    name, ref, hf_dir, _ = hf_model
    d = copy(hf_dir, str(tmp_path / "m"))
    f = only_file(d)
    w = load_file(f)
    # gpt-oss: fused per layer; Granite, Aria: fused, under their releases' names
    victim = [k for k in w if ".experts.3." in k or k.endswith((".experts.down_proj", ".output_linear.weight",
                                                                   ".experts.fc2.weight"))][0]
    save_file({k: v for k, v in w.items() if k != victim}, f)
    with pytest.raises(ValueError, match=f"tensor {victim!r} is missing"):
        convert(d, str(tmp_path / "s1"))
    w2 = dict(w)
    w2[victim] = torch.zeros(3, 3)
    save_file(w2, f)
    with pytest.raises(ValueError, match=rf"\.safetensors: tensor {victim!r} has shape \(3, 3\), expected"):
        convert(d, str(tmp_path / "s2"))
    save_file(w, f)
    with open(f, "r+b") as fh:
        fh.truncate(os.path.getsize(f) // 2)
    with pytest.raises(ValueError, match=r"\.safetensors"):
        convert(d, str(tmp_path / "s3"))


def test_config_errors(hf_model, tmp_path):
    name, ref, hf_dir, _ = hf_model
    d = copy(hf_dir, str(tmp_path / "m"))
    cfg = json.load(open(os.path.join(d, "config.json")))
    json.dump({**cfg, "model_type": "jamba"}, open(os.path.join(d, "config.json"), "w"))
    with pytest.raises(ValueError, match="'jamba' is not supported; supported: mixtral, qwen2_moe, qwen3_moe, olmoe, deepseek_v3, gpt_oss"):
        convert(d, str(tmp_path / "s"))
    bad = json.loads(json.dumps(cfg))
    del lm_config(bad)["hidden_size"]   # the language model's (text_config in a multimodal release)
    json.dump(bad, open(os.path.join(d, "config.json"), "w"))
    with pytest.raises(ValueError, match="config.json: missing config field hidden_size"):
        convert(d, str(tmp_path / "s"))
    with pytest.raises(ValueError, match="no config.json"):
        convert(str(tmp_path), str(tmp_path / "s"))


def test_store_of_another_model_and_budget_minimum(hf_model, tmp_path):
    name, ref, hf_dir, store_dir = hf_model
    d = copy(store_dir, str(tmp_path / "s"))
    cfg = json.load(open(os.path.join(d, "config.json")))
    key = next(k for k in ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts") if k in lm_config(cfg))
    lm_config(cfg)[key] = 32
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    with pytest.raises(ValueError, match="a store of another model"):
        load_model(d)
    m = Manifest.read(store_dir)
    k = MoEConfig.from_hf(store_dir).top_k
    with pytest.raises(ValueError, match=f"the minimum is {k * m.blob_stride:,} bytes"):
        load_model(store_dir, expert_budget=k * m.blob_stride - 1)       # a byte short of the top-k (Llama 4's: 1)
    dense = os.path.getsize(os.path.join(store_dir, "dense.safetensors"))
    with pytest.raises(ValueError, match="cannot hold the dense weights .* the minimum is"):
        load_model(store_dir, device_budget=dense // 2, kv_cache_bytes=1000)


def test_router_variants_against_the_formula():
    torch.manual_seed(0)
    logits = torch.randn(5, 8)
    base = dict(model_type="mixtral", vocab_size=8, hidden_size=8, num_layers=1, num_heads=1, num_kv_heads=1,
                head_dim=8, dense_intermediate=8, expert_intermediate=8, num_experts=8, top_k=2, moe_layers=[0])
    ids, w = route(logits, MoEConfig(**base, router="softmax_topk", norm_topk_prob=False))
    p = logits.softmax(-1)
    assert torch.equal(ids, p.topk(2).indices) and torch.allclose(w, p.gather(1, ids))
    ids, w = route(logits, MoEConfig(**base, router="softmax_topk", norm_topk_prob=True))
    assert torch.allclose(w.sum(-1), torch.ones(5))
    ids, w = route(logits, MoEConfig(**base, router="topk_softmax"))
    assert torch.allclose(w, logits.topk(2).values.softmax(-1))
    # DeepSeek-V3: sigmoid scores, bias only for selection, best 1 of 2 groups, scaled.
    bias = torch.tensor([0, 0, 0, 0, 5.0, 0, 0, 0])
    cfg = MoEConfig(**base, router="sigmoid_group", n_group=2, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5)
    ids, w = route(logits, cfg, bias)
    for t in range(5):
        s = logits[t].sigmoid()
        sel = s + bias
        g = [sel[:4].topk(2).values.sum(), sel[4:].topk(2).values.sum()]
        grp = 0 if g[0] >= g[1] else 1
        cand = list(range(grp * 4, grp * 4 + 4))
        want = sorted(cand, key=lambda e: -sel[e])[:2]
        assert sorted(ids[t].tolist()) == sorted(want)
        ww = s[want] / s[want].sum() * 2.5
        got = {int(e): float(x) for e, x in zip(ids[t], w[t])}
        assert all(abs(got[e] - float(v)) < 1e-6 for e, v in zip(want, ww))


def test_quantized_experts_without_a_quantization_config_are_refused(hf_model, tmp_path):
    name, ref, hf_dir, _ = hf_model
    d = copy(hf_dir, str(tmp_path / "m"))
    f = only_file(d)
    w = load_file(f)
    expert = (".experts.", ".block_sparse_moe.input_linear.", ".block_sparse_moe.output_linear.")   # (Granite's release)
    save_file({k: (v.to(torch.float8_e4m3fn) if any(x in k for x in expert) else v) for k, v in w.items()}, f)
    with pytest.raises(ValueError, match="float8_e4m3fn.*quantization_config"):
        convert(d, str(tmp_path / "s"))


def test_sliding_window_layers_follow_transformers_rules():
    """Which layers slide, for configs without `layer_types` (older checkpoints): transformers'
    own config classes decide, and ours must agree."""
    import transformers
    from runtime.model import MoEConfig
    base = dict(vocab_size=96, hidden_size=64, intermediate_size=48, num_hidden_layers=6, num_attention_heads=4,
                num_key_value_heads=2, num_experts_per_tok=2, sliding_window=5)
    cases = [("mixtral", transformers.MixtralConfig, dict(num_local_experts=8)),
             ("qwen2_moe", transformers.Qwen2MoeConfig, dict(num_experts=8, moe_intermediate_size=16,
                                                             use_sliding_window=True, max_window_layers=3)),
             ("qwen2_moe", transformers.Qwen2MoeConfig, dict(num_experts=8, moe_intermediate_size=16,
                                                             use_sliding_window=False))]
    for mt, C, kw in cases:
        hf = C(**base, **kw)
        d = {**base, **kw, "model_type": mt}
        ours = MoEConfig.from_dict(d)
        types = getattr(hf, "layer_types", None) or ["sliding_attention" if hf.sliding_window else "full_attention"] * 6
        want = [i for i, t in enumerate(types) if t == "sliding_attention"] if hf.sliding_window else []
        assert (ours.sliding_layers if ours.sliding_window else []) == want, (mt, kw)
