"""DeepSeek-V4 beyond the float fixtures of test_against_transformers (which run the ``deepseek_v4`` and
``deepseek_v4_yarn`` fixtures through logits, greedy tokens, batching, offloading, replay and hybrid
tests): the released checkpoint layout - DeepSeek's tensor names, FP4 routed experts (E2M1 pairs in int8
+ E8M0 scales per 32, ``expert_dtype: fp4``) or FP8 ones (V4-Flash-Base), FP8 dense weights with E8M0
128x128-style tile scales (``scale_fmt: ue8m0``), an MTP layer - against transformers on the
dequantized weights; the released config's legacy fields; the caches' bytes; bad input."""
import json
import os

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from runtime.model import MoEConfig, Sequence, load_model
from runtime.model.arch.deepseek_v4 import released_name
from runtime.model.convert import convert
from runtime.store import Manifest

from helpers import check_against_transformers, require, feed  # noqa: E402

transformers = require("transformers", "the reference")


def _model_conftest():
    import importlib.util
    spec = importlib.util.spec_from_file_location("model_conftest", os.path.join(os.path.dirname(__file__), "conftest.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


mc = _model_conftest()
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def e4m3(byte):
    """OCP FP8 E4M3 (fn): sign bit 7, 4 exponent bits (bias 7), 3 mantissa bits."""
    b = np.asarray(byte, dtype=np.int64)
    s, e, m = (b >> 7) & 1, (b >> 3) & 15, b & 7
    mag = np.where(e == 0, m / 8 * 2.0 ** -6, (1 + m / 8) * 2.0 ** (e - 7))
    return np.where(s == 1, -mag, mag)


def fp4_quantize(w: torch.Tensor):
    """DeepSeek-V4's FP4 experts as this test writes them: per 32 of a row a power-of-two scale
    2^(ceil(log2(amax / 6))) as an E8M0 byte, elements to the nearest E2M1 code (the lower code on a
    tie), two per int8 byte with element 2j in the low nibble. -> (int8 [O, I/2], E8M0 [O, I/32], dequantized)."""
    x = w.double().numpy()
    O, I = x.shape
    g = x.reshape(O, I // 32, 32)
    e = np.ceil(np.log2(np.maximum(np.abs(g).max(-1), 1e-30) / 6.0)).clip(-127, 127)
    v = g / 2.0 ** e[..., None]
    codes = np.abs(v[..., None] - E2M1).argmin(-1)                     # first minimum: the lower code on a tie
    deq = (E2M1[codes] * 2.0 ** e[..., None]).reshape(O, I)
    c = codes.reshape(O, I)
    packed = (c[:, 0::2] | (c[:, 1::2] << 4)).astype(np.uint8)
    scale = torch.from_numpy((e + 127).astype(np.uint8)).view(torch.float8_e8m0fnu)
    return torch.from_numpy(packed).view(torch.int8), scale, torch.from_numpy(deq).float()


def fp8_quantize(w: torch.Tensor, block: int):
    """FP8 E4M3 with one E8M0 (power-of-two) scale per block x block tile: 2^ceil(log2(amax / 448));
    the cast is torch's. -> (e4m3 [O, I], E8M0 [O/b, I/b], dequantized)."""
    O, I = w.shape
    go, gi = -(-O // block), -(-I // block)                             # ragged edge tiles, as shipped
    pad = np.zeros((go * block, gi * block))
    pad[:O, :I] = np.abs(w.double().numpy())
    e = np.ceil(np.log2(np.maximum(pad.reshape(go, block, gi, block).max((1, 3)), 1e-30) / 448.0)).clip(-127, 127)
    s = np.kron(2.0 ** e, np.ones((block, block)))[:O, :I]
    q = torch.from_numpy(w.double().numpy() / s).float().clamp(-448, 448).to(torch.float8_e4m3fn)
    deq = torch.from_numpy(e4m3(q.view(torch.uint8).numpy()) * s).float()
    return q, torch.from_numpy((e + 127).astype(np.uint8)).view(torch.float8_e8m0fnu), deq


FP8_DENSE = (".attn.wq_a.", ".attn.wq_b.", ".attn.wkv.", ".attn.wo_a.", ".attn.wo_b.", ".shared_experts.", ".indexer.wq_b.")


def write_released(m, out_dir: str, expert_dtype: str, block: int = 16) -> dict:
    """transformers' model ``m`` -> DeepSeek-V4's released layout in ``out_dir``: its tensor names, routed
    experts per expert in ``expert_dtype`` (fp4 / fp8), attention / shared-expert / indexer-query
    Linears in FP8, the rest (compressor projections, routers, norms, hyper-connections, embeddings,
    head) as they are; an MTP tensor beside. Returns the dequantized state dict under transformers'
    names (what the reference runs)."""
    os.makedirs(out_dir, exist_ok=True)
    out, deq = {}, {}
    sd = m.state_dict()
    E = m.config.n_routed_experts
    for k, v in sd.items():
        if k.endswith("experts.gate_up_proj") or k.endswith("experts.down_proj"):
            layer = k.split(".")[2]
            I = m.config.moe_intermediate_size
            for e in range(E):
                mats = {"w1": v[e, :I], "w3": v[e, I:]} if k.endswith("gate_up_proj") else {"w2": v[e]}
                for wn, wt in mats.items():
                    base = f"layers.{layer}.ffn.experts.{e}.{wn}."
                    q, s, d = fp4_quantize(wt) if expert_dtype == "fp4" else fp8_quantize(wt, block)
                    out[base + "weight"], out[base + "scale"] = q, s
                    mats[wn] = d
                if k.endswith("gate_up_proj"):
                    deq.setdefault(k, v.clone())[e] = torch.cat([mats["w1"], mats["w3"]])
                else:
                    deq.setdefault(k, v.clone())[e] = mats["w2"]
            continue
        r = released_name(k)
        if r.endswith(".weight") and v.dim() == 2 and any(f in "." + r for f in FP8_DENSE):
            q, s, d = fp8_quantize(v, block)
            out[r], out[r[: -len("weight")] + "scale"], deq[k] = q, s, d
        else:
            out[r], deq[k] = v, v
    out["mtp.0.embed.weight"] = torch.zeros(4, 4)                       # the MTP layer: reported, not read
    save_file({k: v.contiguous() for k, v in out.items()}, os.path.join(out_dir, "model.safetensors"))
    cfg = m.config.to_dict()
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                  "activation_scheme": "dynamic", "weight_block_size": [block, block]}
    cfg["expert_dtype"] = expert_dtype                                 # top level, as V4-Flash ships it
    json.dump(cfg, open(os.path.join(out_dir, "config.json"), "w"))
    return deq


@pytest.fixture(scope="module", params=["fp4", "fp8"])
def released(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(f"v4_{request.param}")
    m = mc.build_hf("deepseek_v4", str(d / "hf"))
    deq = write_released(m, str(d / "q"), request.param)
    ref = type(m)(m.config).eval()
    ref.load_state_dict(deq)
    rep = convert(str(d / "q"), str(d / "store"))
    return request.param, ref, str(d / "q"), str(d / "store"), rep


def test_released_names_are_the_ones_transformers_reads(tmp_path):
    """Our map to DeepSeek's names, checked by transformers' own loader: a float checkpoint written under
    the released names loads back into transformers with every tensor where it was."""
    m = mc.build_hf("deepseek_v4", str(tmp_path / "hf"))
    sd = m.state_dict()
    out = {}
    for k, v in sd.items():
        if k.endswith("experts.gate_up_proj") or k.endswith("experts.down_proj"):
            continue                      # transformers merges per-expert w1 / w3 / w2; written below
        out[released_name(k)] = v
    I, E = m.config.moe_intermediate_size, m.config.n_routed_experts
    for l in range(m.config.num_hidden_layers):
        gu, dn = sd[f"model.layers.{l}.mlp.experts.gate_up_proj"], sd[f"model.layers.{l}.mlp.experts.down_proj"]
        for e in range(E):
            out[released_name(f"model.layers.{l}.mlp.experts.{e}.gate_proj.weight")] = gu[e, :I]
            out[released_name(f"model.layers.{l}.mlp.experts.{e}.up_proj.weight")] = gu[e, I:]
            out[released_name(f"model.layers.{l}.mlp.experts.{e}.down_proj.weight")] = dn[e]
    os.makedirs(tmp_path / "rel")
    save_file({k: v.contiguous() for k, v in out.items()}, str(tmp_path / "rel" / "model.safetensors"))
    m.config.save_pretrained(str(tmp_path / "rel"))
    back = type(m).from_pretrained(str(tmp_path / "rel")).state_dict()
    assert set(back) == set(sd)
    for k, v in sd.items():
        assert torch.equal(back[k], v), k


@pytest.mark.parametrize("frac", [1.0, 0.1])
def test_released_layout_matches_transformers(released, frac):
    dtype, ref, q_dir, store_dir, rep = released
    m = Manifest.read(store_dir)
    assert m.expert_format == ("mxfp4" if dtype == "fp4" else "fp8_e4m3") and rep.source == "shipped fp8"
    check_against_transformers(ref, store_dir, frac, f"deepseek_v4 {dtype}")


def test_shipped_expert_bytes_stored_unchanged_and_mtp_reported(released):
    dtype, ref, q_dir, store_dir, rep = released
    ck = load_file(os.path.join(q_dir, "model.safetensors"))
    assert "mtp.0.embed.weight" in rep.unread and not any(n.startswith("layers.") for n in rep.unread)
    model, store = load_model(store_dir)
    try:
        views = store.request(1, [5], 0).tensors(5)
        p = "layers.1.ffn.experts.5.w2."
        if dtype == "fp4":
            assert torch.equal(views["down.blocks"], ck[p + "weight"].view(torch.uint8))
            assert torch.equal(views["down.scales"], ck[p + "scale"].view(torch.uint8))
        else:
            assert torch.equal(views["down.weight"].view(torch.uint8), ck[p + "weight"].view(torch.uint8))
            assert torch.equal(views["down.scale_inv"], torch.exp2(ck[p + "scale"].view(torch.uint8).float() - 127))
    finally:
        store.close()


def test_legacy_config_fields_read_as_transformers_reads_them():
    """V4-Flash's config.json spells the layer kinds as compress_ratios (0 / 4 / 128), the rates as
    compress_rate_csa / _hca, the hash layers as num_hash_layers, the rotary part as qk_rope_head_dim and
    YaRN as a flat rope_scaling: read into what transformers' DeepseekV4Config makes of them."""
    kw = dict(vocab_size=96, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, head_dim=32,
              q_lora_rank=24, o_groups=2, o_lora_rank=16, n_routed_experts=16, num_experts_per_tok=2,
              moe_intermediate_size=32, index_n_heads=4, index_head_dim=16, index_topk=2, sliding_window=8,
              compress_ratios=[128, 4, 0, 4, 0], compress_rate_csa=4, compress_rate_hca=16, num_hash_layers=2,
              qk_rope_head_dim=8, rope_scaling={"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 64,
                                                "beta_fast": 32, "beta_slow": 1})
    t = transformers.DeepseekV4Config(**kw)
    d = {**kw, "model_type": "deepseek_v4"}
    c = MoEConfig.from_dict(d)
    kinds = {"sliding_attention": "sliding", "compressed_sparse_attention": "csa", "heavily_compressed_attention": "hca"}
    assert c.v4_kinds == [kinds[k] for k in t.layer_types]
    assert c.compress_rates == {kinds[k]: v for k, v in t.compress_rates.items()}
    assert c.hash_layers == [i for i, k in enumerate(t.mlp_layer_types) if k == "hash_moe"]
    assert c.qk_rope_head_dim == t.qk_rope_head_dim == 8
    comp = t.rope_parameters["compress"]
    assert c.compress_rope_theta == comp["rope_theta"] and c.rope_theta == t.rope_parameters["main"]["rope_theta"]
    assert c.compress_rope_scaling["factor"] == comp["factor"] and c.compress_rope_scaling["attention_factor"] == 1.0
    from runtime.model.layers.v4_attention import rope_inv
    ref = transformers.models.deepseek_v4.modeling_deepseek_v4.DeepseekV4RotaryEmbedding(t)
    for kind, rt in (("csa", "compress"), ("sliding", "main")):
        assert torch.allclose(rope_inv(c, kind), getattr(ref, f"{rt}_inv_freq").float(), rtol=1e-6, atol=0)


def _cfg(**over):
    d = dict(model_type="deepseek_v4", vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             head_dim=32, q_lora_rank=24, o_groups=2, o_lora_rank=16, n_routed_experts=8, num_experts_per_tok=2,
             moe_intermediate_size=32, index_n_heads=4, index_head_dim=16, index_topk=2, sliding_window=8,
             layer_types=["compressed_sparse_attention", "heavily_compressed_attention"], num_hash_layers=1)
    d.update(over)
    return d


@pytest.mark.parametrize("over,msg", [
    (dict(layer_types=["compressed_sparse_attention", "dilated_attention"]), "layer 1 has kind 'dilated_attention'"),
    (dict(layer_types=None, compress_ratios=[4, 64]), "compress_ratios [64]"),
    (dict(compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 0}),
     "compress rate of hca layers must be a positive integer"),
    (dict(compress_rates={"ring_attention": 4}), "compress_rates names ['ring_attention']"),
    (dict(scoring_func="softmax"), "scoring_func 'softmax'"),
    (dict(o_groups=3), "o_groups 3 must divide"),
])
def test_bad_configs_are_named(over, msg):
    with pytest.raises(ValueError, match=msg.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")):
        MoEConfig.from_dict({k: v for k, v in _cfg(**over).items() if v is not None})


def test_bad_scale_format_and_hash_table(tmp_path):
    m = mc.build_hf("deepseek_v4", str(tmp_path / "hf"))
    write_released(m, str(tmp_path / "q"), "fp4")
    cfg = json.load(open(tmp_path / "q" / "config.json"))
    cfg["quantization_config"]["scale_fmt"] = "e5m2"
    json.dump(cfg, open(tmp_path / "q" / "config.json", "w"))
    with pytest.raises(ValueError, match="scale_fmt 'e5m2' is not supported"):
        convert(str(tmp_path / "q"), str(tmp_path / "s1"))
    # a token -> experts table of the wrong shape: named (the float checkpoint as transformers saves it)
    f = os.path.join(tmp_path / "hf", "model.safetensors")
    w = load_file(f)
    key = [k for k in w if k.endswith("tid2eid")][0]
    w[key] = w[key][:, :1].contiguous()
    save_file(w, f)
    with pytest.raises(ValueError, match=f"tensor {key!r} has shape"):
        convert(str(tmp_path / "hf"), str(tmp_path / "s2"))
    w[key] = torch.zeros(96, 2, dtype=torch.int64)                      # every token to expert 0 twice
    save_file(w, f)
    convert(str(tmp_path / "hf"), str(tmp_path / "s3"))
    with pytest.raises(ValueError, match="gate.tid2eid row 0 .* the same expert twice"):
        load_model(str(tmp_path / "s3"))


def test_cache_bytes_are_what_the_specs_declare_and_chunking_changes_nothing(tmp_path):
    """Per layer: a ring of W K=V rows and the compressor's open window per sequence, (dim + index dim) /
    rate per token of entries in the paged blocks; the allocated cache is exactly that. A prompt fed in
    chunks of 3 gives the logits it gives token by token (the compressors' windows straddle the chunks)."""
    mc.build_hf("deepseek_v4", str(tmp_path / "hf"))
    convert(str(tmp_path / "hf"), str(tmp_path / "store"))
    model, store = load_model(str(tmp_path / "store"))
    try:
        c = model.cfg
        hd, W, idim, f = c.head_dim, c.sliding_window, c.index_head_dim, 4
        per_tok = (hd + idim) * f / 2 + hd * f / 4                        # CSA every 2 tokens, HCA every 4, sliding 0
        per_seq = 3 * W * hd * f + (2 * 4 * hd) * f + (2 * 2 * 2 * hd + 2 * 2 * hd) * f + \
            (2 * 2 * 2 * idim + 2 * 2 * idim) * f                         # rings; HCA buffer; CSA buffer + overlap; indexer
        assert model.kv_bytes_per_token() == per_tok and model.state_bytes_per_sequence() == per_seq
        kv = model.init_kv(per_seq * 2 + int(per_tok * 16 * 10), max_seqs=2)
        assert kv.num_blocks == 10 and kv.block_size == 16
        assert kv.nbytes == 2 * per_seq + per_tok * 16 * 10
        prompt = torch.randint(0, 96, (23,), generator=torch.Generator().manual_seed(1)).tolist()
        s1, s2 = Sequence(), Sequence()
        one = torch.stack([feed(model, [s1], [[t]])[0] for t in prompt])
        chunks = [prompt[i:i + 3] for i in range(0, len(prompt), 3)]
        last = [feed(model, [s2], [ch])[0] for ch in chunks]
        ends = [min(i + 3, len(prompt)) - 1 for i in range(0, len(prompt), 3)]
        assert (torch.stack(last) - one[ends]).abs().max().item() < 1e-4
    finally:
        store.close()


def test_hash_routed_layers_are_prefetched_exactly(tmp_path):
    """A hash-routed layer's experts follow from the step's tokens: with a prefetcher on, the engine moves
    exactly them before the forward, so that layer never misses (the learned layers still do), and the
    tokens are those of the run without prefetching."""
    from runtime.engine import Engine, SamplingParams
    mc.build_hf("deepseek_v4", str(tmp_path / "hf"))
    convert(str(tmp_path / "hf"), str(tmp_path / "store"))
    m = Manifest.read(str(tmp_path / "store"))
    out, hits = {}, {}
    for prefetch in ("none", "freq"):
        model, store = load_model(str(tmp_path / "store"), expert_budget=12 * m.blob_stride, policy="lru")
        try:
            assert model.known_expert_layers == {0}
            eng = Engine(model, store, max_batch=2, prefill_chunk=4, prefetch=prefetch)
            ids = [eng.add_request(list(range(5, 5 + n)), SamplingParams(max_tokens=10, ignore_eos=True)) for n in (6, 3)]
            eng.run()
            out[prefetch] = [eng.done[i].output for i in ids]
            hits[prefetch] = [list(x) for x in store.stats.layer_hits]
        finally:
            store.close()
    assert out["freq"] == out["none"]
    dev, host, disk = hits["freq"][0]
    assert host == 0 and disk == 0 and dev > 0                       # the hash layer: every access a device hit
    assert sum(hits["none"][0][1:]) > 0 and sum(hits["freq"][1][1:]) > 0   # without it / elsewhere: misses
