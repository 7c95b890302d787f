"""DeepSeek Sparse Attention (DeepSeek-V3.2 ``deepseek_v32``, GLM-5 ``glm_moe_dsa``; runtime/model/layers/dsa.py)
beyond the fixtures' checks in test_against_transformers and the other per-architecture suites: the indexer's pick
really changes the output (the same weights keeping every key give other logits, ours and transformers' alike),
GLM-5's shared layers as transformers derives them, the indexer's keys in the one cache budget and the prefix
cache, the layers decoding composed, the MTP layer reported, a pipeline cut at a shared layer refused."""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from runtime.config import RuntimeConfig
from runtime.engine import Engine, SamplingParams
from runtime.model import MoEConfig, Sequence, load_model
from runtime.model.convert import convert
from runtime.model.layers.dsa import IndexedCacheSpec

from conftest import build_hf, hf_config, transformers
from helpers import feed

DSA = ["deepseek_v32", "glm_moe_dsa"]


@pytest.fixture(scope="module", params=DSA)
def dsa(request, tmp_path_factory):
    d = str(tmp_path_factory.mktemp(request.param))
    ref = build_hf(request.param, os.path.join(d, "hf"))
    rep = convert(os.path.join(d, "hf"), os.path.join(d, "store"))
    return request.param, ref, d, rep


def _ours(store_dir: str, prompt: list) -> torch.Tensor:
    """Our logits of every prompt position, fed one token at a time: [len, vocab]."""
    model, store = load_model(store_dir)
    try:
        s = Sequence()
        return torch.stack([feed(model, [s], [[t]])[0] for t in prompt])
    finally:
        store.close()


def _keeping_every_key(d: str, ref):
    """The store and transformers' model with index_topk past any context: plain MLA on the same weights."""
    wide = os.path.join(d, "wide")
    shutil.copytree(os.path.join(d, "store"), wide, dirs_exist_ok=True)
    cfg = json.load(open(os.path.join(wide, "config.json")))
    cfg["index_topk"] = 10_000
    json.dump(cfg, open(os.path.join(wide, "config.json"), "w"))
    for m in ref.modules():
        if hasattr(m, "index_topk"):
            m.index_topk = 10_000
    return wide


def test_the_pick_changes_the_output(dsa):
    """The fixture keeps 4-5 keys per query of a 24-token text: transformers' logits move far when every key is
    kept instead, and ours follow it both ways - the check against transformers cannot pass without the indexer."""
    name, ref, d, _ = dsa
    prompt = torch.randint(0, 96, (24,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.no_grad():
        sparse = ref(torch.tensor([prompt])).logits[0]
    assert (_ours(os.path.join(d, "store"), prompt) - sparse).abs().max() < 1e-4, name
    wide = _keeping_every_key(d, ref)
    try:
        with torch.no_grad():
            dense = ref(torch.tensor([prompt])).logits[0]
        assert (_ours(wide, prompt) - dense).abs().max() < 1e-4, name
    finally:
        for m in ref.modules():
            if hasattr(m, "index_topk"):
                m.index_topk = hf_config(name).index_topk
    # the first index_topk positions see no more keys than are kept: the same; later ones differ
    k = hf_config(name).index_topk
    assert (sparse[:k] - dense[:k]).abs().max() < 1e-4
    assert (sparse[k:] - dense[k:]).abs().amax(-1).min() > 1e-3, name


def test_cache_specs_and_composed_decode(dsa):
    """Layers with an indexer cache its key per token beside MLA's latent, in the one budget; a shared layer
    caches MLA's latent only. Every layer decodes composed, saying why."""
    name, ref, d, rep = dsa
    model, store = load_model(os.path.join(d, "store"))
    try:
        cfg = model.cfg
        specs = model.cache_specs()
        lat = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        for i, s in specs.items():
            if i in cfg.index_shared_layers:
                assert not isinstance(s, IndexedCacheSpec) and s.bytes_per_token(torch.float32) == lat * 4
            else:
                assert s == IndexedCacheSpec(lat, cfg.index_head_dim)
        assert model.kv_bytes_per_token() == 4 * sum(lat + (0 if i in cfg.index_shared_layers else cfg.index_head_dim)
                                                      for i in range(cfg.num_layers))
        assert cfg.index_shared_layers == ([1] if name == "glm_moe_dsa" else [])
        assert all(w is not None and ("DeepSeek sparse attention" in w or "host kernels" in w) for w in model.fused_why)
    finally:
        store.close()


def test_a_shared_prefix_is_served_from_the_cache(dsa):
    """Prompts sharing 40 tokens: with prefix caching the later ones read the first one's blocks - MLA's latents
    and the indexer's keys - and give the tokens they give without it."""
    name, ref, d, _ = dsa
    g = torch.Generator().manual_seed(1)
    system = torch.randint(3, 96, (40,), generator=g).tolist()
    prompts = [system + torch.randint(3, 96, (5 + i,), generator=g).tolist() for i in range(3)]

    def run(caching: bool):
        model, store = load_model(os.path.join(d, "store"))
        try:
            eng = Engine(model, store, max_batch=2, prefill_chunk=16, prefix_caching=caching)
            out = []
            for p in prompts:
                i = eng.add_request(p, SamplingParams(max_tokens=6, ignore_eos=True))
                eng.run()
                out.append(eng.done[i].output)
            return out, eng.kv.hits
        finally:
            store.close()
    off, _ = run(False)
    on, hits = run(True)
    assert on == off and hits == 2 * 32, name


def test_scores_in_blocks_of_rows_pick_the_same(dsa, monkeypatch):
    """On a long context the indexer scores its queries in blocks of rows (dsa.SCORE_ELEMENTS at a time): one row
    at a time - prefill chunks and batched decode - gives the same tokens."""
    from runtime.model.layers import dsa as layer
    name, ref, d, _ = dsa
    prompts = [list(range(3, 16)), [8, 1, 6], list(range(20, 40))]

    def run():
        model, store = load_model(os.path.join(d, "store"))
        try:
            eng = Engine(model, store, max_batch=3, prefill_chunk=7)
            ids = [eng.add_request(p, SamplingParams(max_tokens=10, ignore_eos=True)) for p in prompts]
            eng.run()
            return [eng.done[i].output for i in ids]
        finally:
            store.close()
    whole = run()
    monkeypatch.setattr(layer, "SCORE_ELEMENTS", 1)
    assert run() == whole, name


def test_mtp_layer_reported_not_read(dsa, tmp_path):
    """The release stores its multi-token-prediction layer after the last one (num_nextn_predict_layers). A layer
    shipped only in part (here two of its tensors) cannot draft: convert reports it unread and stores the model
    without it (a whole one is kept for --speculative mtp: tests/runtime/model/test_mtp.py)."""
    name, ref, d, _ = dsa
    hf = str(tmp_path / "hf")
    shutil.copytree(os.path.join(d, "hf"), hf)
    f = os.path.join(hf, "model.safetensors")
    w = load_file(f)
    L = hf_config(name).num_hidden_layers
    mtp = {f"model.layers.{L}.eh_proj.weight": torch.zeros(64, 128),
           f"model.layers.{L}.self_attn.indexer.wk.weight": torch.zeros(16, 64)}
    save_file({**w, **mtp}, f, metadata={"format": "pt"})
    cfg = json.load(open(os.path.join(hf, "config.json")))
    json.dump({**cfg, "num_nextn_predict_layers": 1}, open(os.path.join(hf, "config.json"), "w"))
    rep = convert(hf, str(tmp_path / "s"))
    assert sorted(rep.unread) == sorted(mtp)
    a = load_file(os.path.join(d, "store", "dense.safetensors"))
    b = load_file(str(tmp_path / "s" / "dense.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("kw", [dict(index_topk_freq=2), dict(index_topk_freq=3, index_skip_topk_offset=1),
                                dict(index_topk_pattern="FSSFSF"), dict(index_topk_pattern=["full", "shared"] * 3), {}])
def test_glm_shared_layers_as_transformers_derives_them(kw):
    """GLM-5's indexer types from a pattern or the freq / offset schedule, as GlmMoeDsaConfig.__post_init__ makes
    them (a config.json without indexer_types)."""
    t = transformers.GlmMoeDsaConfig(num_hidden_layers=6, **kw)
    d = {k: v for k, v in t.to_dict().items() if k != "indexer_types"}
    c = MoEConfig.from_dict(d, source="c.json")
    assert c.index_shared_layers == [i for i, k in enumerate(t.indexer_types) if k == "shared"]
    assert c.sparse_mla and c.index_rope_interleave and not MoEConfig.from_dict(
        transformers.DeepseekV32Config(num_hidden_layers=6).to_dict()).index_rope_interleave


def test_a_pipeline_stage_cannot_start_at_a_shared_layer(dsa, tmp_path):
    """Stages hand over hidden states, not the indexer's pick: a cut before a shared layer is refused by name (the
    fixture's stages start at layer 2: made shared here)."""
    name, ref, d, _ = dsa
    store = str(tmp_path / "s")
    shutil.copytree(os.path.join(d, "store"), store)
    RuntimeConfig(model=store, pipeline_parallel=2)
    if name != "glm_moe_dsa":
        return
    cfg = json.load(open(os.path.join(store, "config.json")))
    json.dump({**cfg, "indexer_types": ["full", "shared", "shared"]}, open(os.path.join(store, "config.json"), "w"))
    with pytest.raises(ValueError, match="a stage would start at layer 2, which attends to the keys the layer before"):
        RuntimeConfig(model=store, pipeline_parallel=2)
