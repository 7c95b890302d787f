"""Quantized experts: each format against an independent definition, and tiny checkpoints in the
released layouts (gpt-oss MXFP4, DeepSeek-V3 FP8, Kimi-K2-style compressed-tensors INT4) against
transformers run on the same, dequantized, weights."""
import json
import math
import os
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from runtime.engine import Engine, SamplingParams
from runtime.model import Sequence, load_model
from runtime.model.convert import convert
from runtime.quant import ExpertCodec, blob_tensor_specs, expert_weight_specs, get_format
from runtime.store import Manifest

from helpers import check_against_transformers, require, feed  # noqa: E402


def _model_conftest():
    """build_hf from this folder's conftest (conftest modules are not importable by name)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("model_conftest", os.path.join(os.path.dirname(__file__), "conftest.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


build_hf = _model_conftest().build_hf

ct_helpers = require("compressed_tensors.compressors.pack_quantized.helpers", "the INT4 reference")   # INT4 tests only


# -- the formats' definitions, written here from the specs (numpy, no product code) ---------------
def e2m1(code):
    """OCP FP4 E2M1: sign bit 3, exponent bits 1-2 (bias 1), mantissa bit 0; exponent 0 is subnormal."""
    code = np.asarray(code, dtype=np.int64)
    s, e, m = (code >> 3) & 1, (code >> 1) & 3, code & 1
    mag = np.where(e == 0, m * 0.5, (1 + m / 2) * 2.0 ** (e - 1))
    return np.where(s == 1, -mag, mag)


def e4m3(byte):
    """OCP FP8 E4M3 (fn): sign bit 7, 4 exponent bits (bias 7), 3 mantissa bits; S.1111.111 is NaN."""
    b = np.asarray(byte, dtype=np.int64)
    s, e, m = (b >> 7) & 1, (b >> 3) & 15, b & 7
    mag = np.where(e == 0, m / 8 * 2.0 ** -6, (1 + m / 8) * 2.0 ** (e - 7))
    mag = np.where((e == 15) & (m == 7), np.nan, mag)
    return np.where(s == 1, -mag, mag)


def mxfp4_ref(blocks, scales):
    """blocks [O, I/2] uint8 (element 2j in the low nibble), scales [O, I/32] E8M0 -> [O, I] float64."""
    b = np.asarray(blocks, dtype=np.int64)
    codes = np.stack([b & 15, b >> 4], -1).reshape(b.shape[0], -1)
    return e2m1(codes) * np.repeat(2.0 ** (np.asarray(scales, dtype=np.int64) - 127), 32, axis=1)


def mxfp4_quantize_ref(w):
    """Brute force, per element: scale 2^(floor(log2 amax) - 2) per 32, nearest E2M1 value (ties to
    the even code), saturating."""
    w = np.asarray(w, dtype=np.float64)
    O, I = w.shape
    g = w.reshape(O, I // 32, 32)
    amax = np.abs(g).max(-1)
    e = np.clip(np.floor(np.log2(np.maximum(amax, 2.0 ** -127))) - 2, -127, 127)
    x = g / 2.0 ** e[..., None]
    vals = e2m1(np.arange(16))
    codes = np.zeros(x.shape, dtype=np.int64)
    for idx in np.ndindex(x.shape):
        d = np.abs(vals - x[idx])
        best = [c for c in range(16) if d[c] == d.min()]
        best = [c for c in best if (c >= 8) == (x[idx] < 0)] or best       # the sign of the input
        codes[idx] = min(best, key=lambda c: (c & 1, c))                  # ties -> even code
    return codes.reshape(O, I), (e + 127).astype(np.int64)


def test_mxfp4_matches_its_definition_and_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    torch.manual_seed(0)
    w = torch.randn(24, 96) * torch.logspace(-3, 2, 24)[:, None]       # rows over 5 decades
    w[3, :32] = 0                                                      # an all-zero block
    w[4, 5] = 0.75 * 2 ** int(math.floor(math.log2(w[4, :32].abs().max())) - 2)   # an exact tie
    f = get_format("mxfp4")
    p = f.quantize(w)
    codes, sc = mxfp4_quantize_ref(w.numpy())
    got_codes = np.stack([p["blocks"].numpy() & 15, p["blocks"].numpy() >> 4], -1).reshape(24, 96)
    assert np.array_equal(got_codes, codes) and np.array_equal(p["scales"].numpy(), sc)
    out = torch.empty(24, 96)
    f.dequantize(p, out)
    assert np.array_equal(out.numpy(), mxfp4_ref(p["blocks"], p["scales"]).astype(np.float32))
    # transformers' own MXFP4 dequantization (gpt-oss layout [E, out, in/32, 16]; returns [E, in, out])
    ref = convert_moe_packed_tensors(p["blocks"].view(1, 24, 3, 16), p["scales"].view(1, 24, 3), dtype=torch.float32)
    assert torch.equal(out, ref[0].t())
    assert f.bits_per_param((24, 96)) == 4.25


def test_fp8_matches_its_definition():
    torch.manual_seed(1)
    for block, shape in (((128, 128), (256, 384)), ((32, 32), (40, 70)), ((1, 70), (40, 70))):   # tiles, ragged, per channel
        w = torch.randn(shape) * 3
        f = get_format("fp8_e4m3", block=block)
        p = f.quantize(w)
        out = torch.empty(shape)
        f.dequantize(p, out)
        s = np.kron(p["scale_inv"].numpy().astype(np.float64), np.ones(block))[: shape[0], : shape[1]]
        want = (e4m3(p["weight"].view(torch.uint8).numpy()) * s).astype(np.float32)
        assert np.array_equal(out.numpy(), want), block
        assert (out - w).abs().max() <= w.abs().max() / 8                # E4M3 has 3 mantissa bits


@pytest.mark.parametrize("scale_dtype", ["bfloat16", "float32"])
def test_int4_matches_compressed_tensors(scale_dtype):
    torch.manual_seed(2)
    w = torch.randn(16, 128)
    f = get_format("int4", group=32, scale_dtype=scale_dtype)
    p = f.quantize(w)
    q = ct_helpers.unpack_from_int32(p["packed"], 4, torch.Size([16, 128]))          # the packing: theirs
    assert torch.equal(ct_helpers.pack_to_int32(q, 4), p["packed"])
    want = q.double().numpy() * np.repeat(p["scale"].float().double().numpy(), 32, axis=1)
    out = torch.empty(16, 128)
    f.dequantize(p, out)
    assert np.array_equal(out.numpy(), want.astype(np.float32))
    assert int(q.min()) >= -8 and int(q.max()) <= 7
    assert f.bits_per_param((16, 128)) == (4.5 if scale_dtype == "bfloat16" else 5.0)


def test_codec_dequantizes_into_reused_scratch_and_bf16():
    H, I = 64, 32
    f = get_format("mxfp4")
    specs = expert_weight_specs(H, I, f)
    ws = {"gate": torch.randn(I, H), "up": torch.randn(I, H), "down": torch.randn(H, I)}
    raw = {f"{k}.{s}": t for k, v in ws.items() for s, t in f.quantize(v).items()}
    c = ExpertCodec(specs, torch.float32, "cpu")
    a = c.weights(raw)
    ptr = a.gate_up_t.data_ptr()
    b = c.weights(raw)
    assert b.gate_up_t.data_ptr() == ptr                                # no new buffer per call
    ref = {k: torch.tensor(mxfp4_ref(raw[k + ".blocks"], raw[k + ".scales"]), dtype=torch.float32) for k in ws}
    assert torch.equal(a.gate_up_t, torch.cat([ref["gate"], ref["up"]]).t())
    assert torch.equal(a.down_t, ref["down"].t())
    # the GPU path: dequantized in float32, cast once to the model's bf16 (MXFP4 values are exact in bf16)
    cb = ExpertCodec(specs, torch.bfloat16, "cpu", compute_dtype=torch.bfloat16).weights(raw)
    assert cb.gate_up_t.dtype == torch.bfloat16 and torch.equal(cb.gate_up_t.float(), a.gate_up_t)
    # on a CPU a bf16 model's experts are computed in float32 (CPU bf16 matmuls are slow)
    assert ExpertCodec(specs, torch.bfloat16, "cpu").compute_dtype == torch.float32
    dense = expert_weight_specs(H, I, get_format("bf16"))
    draw = {"gate_up.t": torch.randn(H, 2 * I).bfloat16(), "down.t": torch.randn(I, H).bfloat16()}
    cw = ExpertCodec(dense, torch.bfloat16, "cpu").weights(draw)
    assert cw.gate_up_t.dtype == torch.float32 and torch.equal(cw.gate_up_t, draw["gate_up.t"].float())
    cv = ExpertCodec(dense, torch.bfloat16, "cpu", compute_dtype=torch.bfloat16).weights(draw)
    assert cv.gate_up_t.data_ptr() == draw["gate_up.t"].data_ptr()    # a view of the blob, no copy


def test_codec_keeps_widened_experts_within_its_budget():
    """bf16 experts computed in float32 on a CPU: widened once per expert key, the least recently
    used dropped (its buffers reused) when the budget is full; no key - scratch as before."""
    H, I = 64, 32
    dense = expert_weight_specs(H, I, get_format("bf16"))
    blobs = [{"gate_up.t": torch.randn(H, 2 * I).bfloat16(), "down.t": torch.randn(I, H).bfloat16()} for _ in range(3)]
    c = ExpertCodec(dense, torch.float32, "cpu", cache_bytes=0)
    assert c.widen and c.cache_bytes == 0
    c.cache_bytes = 2 * c.operand_bytes
    a = c.weights(blobs[0], (0, 0))
    assert torch.equal(a.gate_up_t, blobs[0]["gate_up.t"].float()) and torch.equal(a.down_t, blobs[0]["down.t"].float())
    assert c.weights(blobs[0], (0, 0)) is a                               # a hit: no conversion
    c.weights(blobs[1], (0, 1))
    c.weights(blobs[0], (0, 0))                                          # (0, 1) is now the least recently used
    ptr = c.weights(blobs[1], (0, 1)).gate_up_t.data_ptr()
    z = c.weights(blobs[2], (0, 2))                                      # evicts (0, 0), reuses its buffers
    assert z.gate_up_t.data_ptr() == a.gate_up_t.data_ptr() and torch.equal(z.gate_up_t, blobs[2]["gate_up.t"].float())
    assert set(c._cache) == {(0, 1), (0, 2)} and c.cached_bytes == 2 * c.operand_bytes
    assert c.weights(blobs[1], (0, 1)).gate_up_t.data_ptr() == ptr
    s = c.weights(blobs[0])                                              # no key: the scratch
    assert s.gate_up_t.data_ptr() not in {ptr, z.gate_up_t.data_ptr()} and torch.equal(s.down_t, blobs[0]["down.t"].float())
    c.drop()
    assert not c._cache and c.cached_bytes == 0
    # a float32 blob computed in float32 is the operand itself: nothing to keep
    assert ExpertCodec(expert_weight_specs(H, I, get_format("fp32")), torch.float32, "cpu", cache_bytes=1 << 30).cache_bytes == 0


# -- tiny checkpoints in the released layouts --------------------------------------------------------
def fp8_quantize_ref(w, block):
    """Test-side FP8 tiles: scale = amax / 448; the cast to E4M3 is torch's (round to nearest even)."""
    O, I = w.shape
    bo, bi = block
    go, gi = -(-O // bo), -(-I // bi)
    pad = np.zeros((go * bo, gi * bi))
    pad[:O, :I] = np.abs(w.numpy())
    amax = pad.reshape(go, bo, gi, bi).max((1, 3))
    scale = np.where(amax > 0, amax / 448, 1.0).astype(np.float32)
    s = np.kron(scale, np.ones(block))[:O, :I]
    q = torch.from_numpy((w.numpy() / s).astype(np.float32)).clamp(-448, 448).to(torch.float8_e4m3fn)
    deq = torch.from_numpy((e4m3(q.view(torch.uint8).numpy()) * s).astype(np.float32))
    return q, torch.from_numpy(scale), deq


def write_fp8_deepseek(hf_dir, out_dir, block=(32, 32)):
    """DeepSeek-V3's released layout: every Linear but the router, embeddings and lm_head in FP8
    with weight_scale_inv tiles. Returns the dequantized state dict (what transformers runs)."""
    os.makedirs(out_dir, exist_ok=True)
    w = load_file(os.path.join(hf_dir, "model.safetensors"))
    out, deq = {}, {}
    for k, v in w.items():
        if k.endswith(".weight") and v.dim() == 2 and "embed_tokens" not in k and "lm_head" not in k and not k.endswith("mlp.gate.weight"):
            q, s, d = fp8_quantize_ref(v, block)
            out[k], out[k + "_scale_inv"], deq[k] = q, s, d
        else:
            out[k] = deq[k] = v
    save_file(out, os.path.join(out_dir, "model.safetensors"))
    cfg = json.load(open(os.path.join(hf_dir, "config.json")))
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(block)}
    json.dump(cfg, open(os.path.join(out_dir, "config.json"), "w"))
    return deq


def write_int4_kimi(hf_dir, out_dir):
    """Kimi K2's released layout: routed experts in compressed-tensors pack-quantized int4 (group 32,
    bf16 scales, weight_shape); everything else in the float dtype."""
    os.makedirs(out_dir, exist_ok=True)
    w = load_file(os.path.join(hf_dir, "model.safetensors"))
    out, deq = {}, {}
    for k, v in w.items():
        if ".mlp.experts." in k and k.endswith(".weight"):
            O, I = v.shape
            g = v.reshape(O, I // 32, 32)
            scale = (g.abs().amax(-1) / 7.5).to(torch.bfloat16)                  # compressed-tensors' symmetric rule
            q = torch.round(g / scale.float()[..., None]).clamp(-8, 7).reshape(O, I).to(torch.int8)
            base = k[: -len("weight")]
            out[base + "weight_packed"] = ct_helpers.pack_to_int32(q, 4)
            out[base + "weight_scale"] = scale
            out[base + "weight_shape"] = torch.tensor([O, I])
            deq[k] = (q.float().reshape(O, I // 32, 32) * scale.float()[..., None]).reshape(O, I)
        else:
            out[k] = deq[k] = v
    save_file(out, os.path.join(out_dir, "model.safetensors"))
    cfg = json.load(open(os.path.join(hf_dir, "config.json")))
    cfg["quantization_config"] = {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                  "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                                      "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                      "group_size": 32}}},
                                  "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.gate.*"]}
    json.dump(cfg, open(os.path.join(out_dir, "config.json"), "w"))
    return deq


def write_mxfp4_gpt_oss(hf_dir, out_dir):
    """gpt-oss's released layout: per layer, fused [E, out, in/32, 16] blocks and [E, out, in/32]
    scales of gate_up_proj (rows interleave gate and up) and down_proj, packed here by the test's
    own brute-force quantizer; the dequantized weights come from transformers' converter."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    os.makedirs(out_dir, exist_ok=True)
    w = load_file(os.path.join(hf_dir, "model.safetensors"))
    out, deq = {}, {}
    for k, v in w.items():
        if k.endswith(("experts.gate_up_proj", "experts.down_proj")):
            E, In, O = v.shape                                            # transformers keeps them input-major
            blocks, scales = [], []
            for e in range(E):
                codes, sc = mxfp4_quantize_ref(v[e].t().numpy())
                blocks.append(torch.from_numpy((codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)))
                scales.append(torch.from_numpy(sc.astype(np.uint8)))
            b = torch.stack(blocks).view(E, O, In // 32, 16)
            s = torch.stack(scales)
            out[k + "_blocks"], out[k + "_scales"] = b, s
            deq[k] = convert_moe_packed_tensors(b, s, dtype=torch.float32)   # [E, In, O]
        else:
            out[k] = deq[k] = v
    save_file(out, os.path.join(out_dir, "model.safetensors"))
    cfg = json.load(open(os.path.join(hf_dir, "config.json")))
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                     "model.layers.*.mlp.router",
                                                                                     "model.embed_tokens", "lm_head"]}
    json.dump(cfg, open(os.path.join(out_dir, "config.json"), "w"))
    return deq


LAYOUTS = {"gpt_oss_mxfp4": ("gpt_oss", write_mxfp4_gpt_oss, "mxfp4"),
           "deepseek_v3_fp8": ("deepseek_v3", write_fp8_deepseek, "fp8_e4m3"),
           "qwen3_moe_fp8": ("qwen3_moe", write_fp8_deepseek, "fp8_e4m3"),     # Qwen's FP8 releases: the same layout
           # DeepSeek-V3.2 (its indexer's projections too), GLM-5 and MiMo-V2-Flash ship DeepSeek-V3's FP8 layout
           "deepseek_v32_fp8": ("deepseek_v32", write_fp8_deepseek, "fp8_e4m3"),
           "glm_moe_dsa_fp8": ("glm_moe_dsa", write_fp8_deepseek, "fp8_e4m3"),
           "mimo_v2_flash_fp8": ("mimo_v2_flash", write_fp8_deepseek, "fp8_e4m3"),
           "kimi_k2_int4": ("deepseek_v3", write_int4_kimi, "int4")}


@pytest.fixture(scope="module", params=[pytest.param(k, marks=pytest.mark.slow) if k == "gpt_oss_mxfp4" else k
                                        for k in LAYOUTS])   # gpt-oss: 30 s of brute-force MXFP4 packing
def released(request, tmp_path_factory):
    arch, write, fmt = LAYOUTS[request.param]
    d = str(tmp_path_factory.mktemp(request.param))
    build_hf(arch, os.path.join(d, "hf"))
    deq = write(os.path.join(d, "hf"), os.path.join(d, "q"))
    # transformers runs on the same weights, dequantized: saved as a float checkpoint, loaded by its own loader
    os.makedirs(os.path.join(d, "deq"))
    save_file({k: v.contiguous() for k, v in deq.items()}, os.path.join(d, "deq", "model.safetensors"))
    shutil.copy(os.path.join(d, "hf", "config.json"), os.path.join(d, "deq", "config.json"))
    import transformers
    kw = {"attn_implementation": "eager"} if arch == "gpt_oss" else {}
    ref = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(d, "deq"), dtype=torch.float32, **kw).eval()
    rep = convert(os.path.join(d, "q"), os.path.join(d, "store"))
    return request.param, ref, os.path.join(d, "q"), os.path.join(d, "store"), fmt, rep


@pytest.mark.slow
@pytest.mark.parametrize("frac", [1.0, 0.1])
def test_released_layouts_match_transformers(released, frac):
    name, ref, q_dir, store_dir, fmt, rep = released
    m = Manifest.read(store_dir)
    assert m.expert_format == fmt and rep.source.startswith("shipped")
    # the blob holds the quantized bytes as shipped: fewer than 2 bytes a parameter
    assert m.blob_bytes < sum(math.prod(w.shape) for w in m.weights) * 2
    check_against_transformers(ref, store_dir, frac, name)


def test_shipped_bytes_are_stored_unchanged(released):
    """No dequantize/requantize round trip: the store's parts are the checkpoint's bytes."""
    name, ref, q_dir, store_dir, fmt, rep = released
    ck = load_file(os.path.join(q_dir, "model.safetensors"))
    model, store = load_model(store_dir)
    try:
        views = store.request(0, [1], 0).tensors(1)
        layer = Manifest.read(store_dir).layer_numbers[0]
        if fmt == "mxfp4":
            b = ck[f"model.layers.{layer}.mlp.experts.down_proj_blocks"][1].reshape(views["down.blocks"].shape)
            assert torch.equal(views["down.blocks"], b)
            gu = ck[f"model.layers.{layer}.mlp.experts.gate_up_proj_scales"][1]
            assert torch.equal(views["gate.scales"], gu[0::2]) and torch.equal(views["up.scales"], gu[1::2])
        elif fmt == "fp8_e4m3":
            p = f"model.layers.{layer}.mlp.experts.1.down_proj."
            assert torch.equal(views["down.weight"].view(torch.uint8), ck[p + "weight"].view(torch.uint8))
            assert torch.equal(views["down.scale_inv"], ck[p + "weight_scale_inv"])
        else:
            p = f"model.layers.{layer}.mlp.experts.1.up_proj."
            assert torch.equal(views["up.packed"], ck[p + "weight_packed"])
            assert torch.equal(views["up.scale"], ck[p + "weight_scale"])
    finally:
        store.close()


# -- convert --quantize ------------------------------------------------------------------------------
@pytest.mark.parametrize("quant", ["mxfp4", "int4", "fp8"])
def test_quantize_a_float_checkpoint(quant, tmp_path):
    """Reported, not asserted beyond a sanity bound: greedy agreement and mean KL against the float
    model over 32 tokens; the expert error convert prints."""
    hf = str(tmp_path / "hf")
    build_hf("qwen3_moe", hf)
    convert(hf, str(tmp_path / "f"))
    rep = convert(hf, str(tmp_path / "q"), quantize=quant)
    mf, mq = Manifest.read(str(tmp_path / "f")), Manifest.read(str(tmp_path / "q"))
    assert rep.source == "quantized from fp32" and mq.expert_format == {"fp8": "fp8_e4m3"}.get(quant, quant)
    assert mq.blob_bytes < mf.blob_bytes * {"mxfp4": 0.2, "int4": 0.2, "fp8": 0.3}[quant]
    assert 0 < rep.mean_rel_error < {"mxfp4": 0.35, "int4": 0.35, "fp8": 0.1}[quant]
    # The float model's greedy continuation, then both models teacher-forced over the same tokens:
    # KL and argmax agreement position by position on one context.
    logp, seq = {}, list(range(1, 9))
    for k in ("f", "q"):
        model, store = load_model(str(tmp_path / k))
        try:
            s = Sequence()
            out = [feed(model, [s], [seq[:8]])[0]]
            for j in range(31):
                if k == "f":
                    seq.append(int(out[-1].argmax()))
                out.append(feed(model, [s], [[seq[8 + j]]])[0])
            logp[k] = torch.stack(out).log_softmax(-1)                   # [32, vocab]
        finally:
            store.close()
    kl = (logp["f"].exp() * (logp["f"] - logp["q"])).sum(-1).mean().item()
    agree = (logp["f"].argmax(-1) == logp["q"].argmax(-1)).float().mean().item()
    print(f"{quant}: expert rel. error {rep.mean_rel_error:.4f}, mean KL {kl:.4f}, greedy agreement {agree:.2f}")
    assert kl < 1.0 and agree > 0.3


@pytest.mark.parametrize("quant", ["mxfp4", "int4", "int8", "fp8"])
def test_quantize_a_bf16_gpt_oss(quant, tmp_path):
    """A bf16 gpt-oss checkpoint (experts fused, gate and up interleaved, with biases) quantized to each
    format: the conversion's error report reads the biases as the codec names them (it asked for a bias
    part the sample lacked and crashed with KeyError 'gate_up_bias.t'), the biases are stored as they
    were, and the quantized store's next-token distribution stays near the float store's."""
    hf = str(tmp_path / "hf")
    build_hf("gpt_oss", hf)
    for f in [f for f in os.listdir(hf) if f.endswith(".safetensors")]:       # the checkpoint as released: bf16
        path = os.path.join(hf, f)
        save_file({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in load_file(path).items()},
                  path, metadata={"format": "pt"})
    convert(hf, str(tmp_path / "f"))
    rep = convert(hf, str(tmp_path / "q"), quantize=quant)
    assert rep.source == "quantized from bf16"
    assert 0 < rep.mean_rel_error <= rep.max_rel_error < {"fp8": 0.1, "int8": 0.05}.get(quant, 0.35)
    mf, mq = Manifest.read(str(tmp_path / "f")), Manifest.read(str(tmp_path / "q"))
    assert mq.blob_bytes < mf.blob_bytes
    logp, bias = {}, {}
    for k in ("f", "q"):
        model, store = load_model(str(tmp_path / k))
        try:
            v = store.request(0, [1], 0).tensors(1)
            bias[k] = (v["gate_up_bias.t"].float().clone(), v["down_bias.t"].float().clone())
            logp[k] = feed(model, [Sequence()], [list(range(1, 9))])[0].log_softmax(-1)
        finally:
            store.close()
    assert all(torch.equal(a, b) for a, b in zip(bias["f"], bias["q"]))          # biases are not quantized
    kl = (logp["f"].exp() * (logp["f"] - logp["q"])).sum(-1).item()
    assert kl < 0.5, kl


# -- bad input -----------------------------------------------------------------------------------------
def test_bad_quantized_checkpoints(tmp_path):
    hf = str(tmp_path / "hf")
    build_hf("deepseek_v3", hf)
    q = str(tmp_path / "q")
    write_fp8_deepseek(hf, q)
    with pytest.raises(ValueError, match="already quantized \\(fp8\\).*drop --quantize"):
        convert(q, str(tmp_path / "s0"), quantize="mxfp4")
    with pytest.raises(ValueError, match="--quantize 'nf4' is not supported; choose one of mxfp4, int4, fp8"):
        convert(hf, str(tmp_path / "s1"), quantize="nf4")
    cfg = json.load(open(os.path.join(q, "config.json")))
    json.dump({**cfg, "quantization_config": {"quant_method": "awq"}}, open(os.path.join(q, "config.json"), "w"))
    with pytest.raises(ValueError, match="quant_method 'awq' is not supported; supported: fp8, compressed-tensors"):
        convert(q, str(tmp_path / "s2"))
    json.dump(cfg, open(os.path.join(q, "config.json"), "w"))
    w = load_file(os.path.join(q, "model.safetensors"))
    victim = "model.layers.1.mlp.experts.2.gate_proj.weight_scale_inv"
    w[victim] = torch.ones(5, 5)
    save_file(w, os.path.join(q, "model.safetensors"))
    with pytest.raises(ValueError, match="experts.2.gate_proj.weight: fp8_e4m3 part 'scale_inv' is \\(5, 5\\)"):
        convert(q, str(tmp_path / "s3"))


def test_budget_holds_more_quantized_experts(tmp_path):
    """Budgets count real blob bytes: at a realistic expert shape an MXFP4 blob is ~3.8x smaller
    than bf16, so the same device budget holds ~3.8x the experts."""
    H, I = 1024, 512
    bf = sum(math.prod(shape) * dt.itemsize for _, shape, dt in blob_tensor_specs(expert_weight_specs(H, I, get_format("bf16"))))
    mx = sum(get_format("mxfp4").nbytes(s) for s in ((I, H), (I, H), (H, I)))
    assert mx * 8 == 3 * H * I * 4.25 and 3.7 < bf / mx < 3.8


def test_a_stores_trace_replays_with_its_real_expert_size(tmp_path):
    """Replay and the cost model size a store's experts from its manifest (not a geometry x dtype guess)."""
    from cache_policy.replay import ReplayConfig, replay_batch
    from cache_policy.traces import load_trace
    hf = str(tmp_path / "hf")
    build_hf("mixtral", hf)   # expert intermediate 48: not a multiple of 32
    with pytest.raises(ValueError, match=r"expert weight down \(64, 48\) cannot be stored as mxfp4: mxfp4 needs a 2-D "
                                         r"weight whose input size is a multiple of 32"):
        convert(hf, str(tmp_path / "bad"), quantize="mxfp4")
    build_hf("qwen3_moe", hf)
    convert(hf, str(tmp_path / "q"), quantize="mxfp4")
    m = Manifest.read(str(tmp_path / "q"))
    model, store = load_model(str(tmp_path / "q"), expert_budget=8 * m.blob_stride, policy="lru")
    try:
        eng = Engine(model, store, max_batch=2, prefill_chunk=1)
        for p in ([1, 2, 3], [4, 5, 6, 7]):
            eng.add_request(p, SamplingParams(max_tokens=6, ignore_eos=True))
        eng.run()
        eng.trace().save(str(tmp_path / "t.npz"))
        live = store.stats.bytes["host_to_device"]
    finally:
        store.close()
    tr = load_trace(str(tmp_path / "t.npz"))
    assert tr.expert_bytes == m.blob_bytes and tr.expert_dtype == "mxfp4"
    r = replay_batch(tr, ReplayConfig(policy="lru", scope="global", device_capacity="8", profile="h200"), 2)
    assert r["expert_bytes"] == m.blob_bytes and "manifest" in r["expert_size_source"]
    # the replayed bytes are the live store's bytes (same placement, same blob size)
    assert r["bytes_per_token"]["host_to_device"] * tr.num_tokens == live
