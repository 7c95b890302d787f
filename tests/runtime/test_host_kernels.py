"""The host expert kernels (runtime/kernels/moe_cpu.c) against the reference: every format's blob
dequantized by the format's own definition (checked against the specs in model/test_quantized.py),
then the expert FFN in float64 here. The kernel decodes each element to its exact float32 value, so
the only difference is the order of float32 sums: a relative error of a few float32 ulps of the
output's scale, checked at 2e-5 of the largest output."""
import math
import os

import numpy as np
import pytest
import torch

from runtime import kernels
from runtime.kernels.moe import HostMoE, unsupported
from runtime.quant import ExpertCodec, encode_expert, expert_weight_specs, get_format

if kernels.lib() is None:
    pytest.skip(f"host kernels unavailable: {kernels.unavailable()}", allow_module_level=True)

# Every build this CPU runs (the widest is the default; the others are what CPUs without AVX-512 or
# VNNI load): each test below runs on each.
ISAS = [name for name, needs, _ in kernels.ISAS if all(f in kernels._cpu_flags() for f in needs)]


@pytest.fixture(params=ISAS, autouse=True)
def isa(request, monkeypatch):
    monkeypatch.setenv("TIERED_MOE_HOST_ISA", request.param)
    kernels.reset()
    assert kernels.isa() == request.param, kernels.unavailable()
    yield request.param
    monkeypatch.delenv("TIERED_MOE_HOST_ISA", raising=False)        # (a test may have dropped it)
    kernels.reset()

FORMATS = [("fp32", {}), ("bf16", {}), ("fp16", {}), ("mxfp4", {}), ("int4", {"group": 32, "scale_dtype": "bfloat16"}),
           ("int4", {"group": 64, "scale_dtype": "float32"}), ("int4", {"group": 128, "scale_dtype": "float16"}),
           ("int8", {"group": 32, "scale_dtype": "float16"}), ("int8", {"group": 64, "scale_dtype": "bfloat16"}),
           ("fp8_e4m3", {"block": (128, 128)}), ("fp8_e4m3", {"block": (32, 32)}), ("fp8_e4m3", {"block": (1, 192)})]


def make_experts(fmt, params, H, I, n, bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    specs = expert_weight_specs(H, I, get_format(fmt, **params), torch.bfloat16 if bias else None)
    blobs = []
    for _ in range(n):
        gate, up, down = (torch.randn(s, generator=g) * 0.1 for s in ((I, H), (I, H), (H, I)))
        t = {"gate": gate, "up": up, "gate_up": torch.cat([gate, up]), "down": down}
        if bias:
            t["gate_up_bias"], t["down_bias"] = torch.randn(2 * I, generator=g), torch.randn(H, generator=g)
        blobs.append(encode_expert(specs, t))
    return specs, blobs


def reference(specs, blob, x, clamp=None):
    """float64 SwiGLU expert on x [n, H] from the blob's dequantized weights."""
    codec = ExpertCodec(specs, torch.float32, "cpu")
    w = {k: v.double() for k, v in codec.dequantize_all(blob).items()}
    I = w["down"].shape[1]
    gu = torch.cat([w["gate"], w["up"]]) if "gate" in w else w["gate_up"]
    h = x.double() @ gu.T + w.get("gate_up_bias", 0)
    g, u = h[:, :I], h[:, I:]
    if clamp is None:
        a = torch.nn.functional.silu(g) * u
    else:
        limit, alpha = clamp
        g = g.clamp(max=limit)
        a = (u.clamp(-limit, limit) + 1) * g * torch.sigmoid(alpha * g)
    return a @ w["down"].T + w.get("down_bias", 0)


@pytest.mark.parametrize("fmt,params", FORMATS, ids=[f"{f}-{'-'.join(map(str, p.values()))}" for f, p in FORMATS])
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_matches_the_dequantized_reference(fmt, params, threads):
    H, I = 192, 160 if fmt not in ("int4", "int8") or params["group"] <= 32 else 256
    if fmt in ("int4", "int8") and params["group"] >= 64:
        H, I = 256, 256                  # divisible by the group; K = 160 / 192 cover every leftover-chunk count
    specs, blobs = make_experts(fmt, params, H, I, 5, seed=threads)
    kern = HostMoE(specs, H, I, H)
    rows = [1, 4, 0, 7, 2]           # 0: an expert without tokens; 7: row groups of 4 and 3
    row0 = np.cumsum([0] + rows[:-1]).tolist()
    xs = torch.randn(sum(rows), H, generator=torch.Generator().manual_seed(7))
    ys = torch.full((sum(rows), H), float("nan"))
    kern.run(blobs, row0, rows, xs, ys, threads=threads)
    for blob, a, n in zip(blobs, row0, rows):
        if not n:
            continue
        ref = reference(specs, blob, xs[a:a + n])
        err = (ys[a:a + n].double() - ref).abs().max().item()
        assert err <= 2e-5 * ref.abs().max().item(), (fmt, params, err)


@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
def test_biases_and_the_clamped_swiglu(fmt):
    """gpt-oss's experts: biases in bf16 and (up + 1) * g * sigmoid(1.702 g) with clamping at 7."""
    H, I = 128, 96
    specs, blobs = make_experts(fmt, {}, H, I, 3, bias=True)
    for b in blobs:   # push pre-activations past the clamp
        b["gate_up_bias.t"].mul_(8)
    kern = HostMoE(specs, H, I, H, act="swiglu_clamp", limit=7.0, alpha=1.702)
    xs = torch.randn(6, H, generator=torch.Generator().manual_seed(3)) * 4
    ys = torch.empty(6, H)
    kern.run(blobs, [0, 1, 3], [1, 2, 3], xs, ys)
    for blob, a, n in zip(blobs, [0, 1, 3], [1, 2, 3]):
        ref = reference(specs, blob, xs[a:a + n], clamp=(7.0, 1.702))
        assert (ys[a:a + n].double() - ref).abs().max().item() <= 2e-5 * ref.abs().max().item()


def test_layouts_the_kernel_refuses_are_named():
    assert "multiples of 32 (got 64, 48)" in unsupported(expert_weight_specs(64, 48, get_format("int4", group=16)), 64, 48)
    assert "no host kernel" in unsupported([type(w)(w.name, w.shape, "q3", {}) for w in
                                            expert_weight_specs(64, 64, get_format("bf16"))], 64, 64)
    assert "group 16" in unsupported(expert_weight_specs(64, 64, get_format("int4", group=16)), 64, 64)
    with pytest.raises(ValueError, match="multiples of 32"):
        HostMoE(expert_weight_specs(64, 48, get_format("int4", group=16)), 64, 48, 64)


def test_rows_must_be_contiguous_float32():
    specs, blobs = make_experts("bf16", {}, 64, 64, 1)
    kern = HostMoE(specs, 64, 64, 64)
    with pytest.raises(ValueError, match="contiguous float32"):
        kern.run(blobs, [0], [1], torch.randn(1, 64, dtype=torch.bfloat16), torch.empty(1, 64))


@pytest.mark.parametrize("n", [1, 3, 4, 9])
def test_bf16_linear_matches_float64(n):
    g = torch.Generator().manual_seed(n)
    K, N = 200, 75                    # neither a multiple of 8 nor of 16: every tail path
    w = torch.randn(N, K, generator=g).to(torch.bfloat16)
    x = torch.randn(n, K, generator=g)
    y = torch.empty(n, N)
    kernels.lib().tm_linear_bf16(x.data_ptr(), n, K, w.data_ptr(), N, y.data_ptr(), 2)
    ref = x.double() @ w.double().T
    assert (y.double() - ref).abs().max().item() <= 2e-5 * ref.abs().max().item() * math.sqrt(K / 64)


@pytest.mark.parametrize("fmt,params", [("mxfp4", {}), ("int4", {"group": 32, "scale_dtype": "bfloat16"}),
                                        ("int4", {"group": 128, "scale_dtype": "float32"})])
def test_q8_activations_within_their_stated_error(fmt, params):
    """q8 (as llama.cpp's Q8_0): each 32 activations rounded to 8 bits by their own scale (an
    element's error at most amax / 254), then integer dot products. Not exact: the output's relative
    error against the exact kernel is stated as under 2% here (the README's tolerance) and nonzero."""
    H, I = 256, 256
    specs, blobs = make_experts(fmt, params, H, I, 3, seed=5)
    exact, q8 = HostMoE(specs, H, I, H), HostMoE(specs, H, I, H, act_quant="q8")
    xs = torch.randn(5, H, generator=torch.Generator().manual_seed(9))
    ye, yq = torch.empty(5, H), torch.empty(5, H)
    exact.run(blobs, [0, 1, 3], [1, 2, 2], xs, ye)
    q8.run(blobs, [0, 1, 3], [1, 2, 2], xs, yq)
    rel = ((yq - ye).norm() / ye.norm()).item()
    assert 0 < rel < 0.02, rel            # not exact, and within 2% (llama.cpp's Q4_0 x Q8_0 regime)
    with pytest.raises(ValueError, match="not one of"):
        HostMoE(specs, H, I, H, act_quant="q4")


def test_gather_and_combine_in_the_call():
    """Decode's fused call: token rows gathered by index, the k outputs of each token summed by
    weight, against the same done by hand in torch from the ungathered call."""
    H, I, T, k = 128, 96, 3, 2
    specs, blobs = make_experts("mxfp4", {}, H, I, 3)
    kern = HostMoE(specs, H, I, H)
    ids = torch.tensor([[2, 0], [0, 1], [2, 1]])                       # [T, k] routing
    wts = torch.rand(T, k, generator=torch.Generator().manual_seed(1))
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    back = torch.empty_like(order)
    back[order] = torch.arange(order.numel())
    tok = order // k
    counts = torch.bincount(flat, minlength=3).tolist()
    row0 = [0, counts[0], counts[0] + counts[1]]
    xin = torch.randn(T, H, generator=torch.Generator().manual_seed(2))
    ys = torch.empty(T * k, H)
    kern.run(blobs, row0, counts, xin[tok].contiguous(), ys)
    want = (ys[back].view(T, k, H) * wts[:, :, None]).sum(1)
    out = torch.empty(T, H)
    kern.run(blobs, row0, counts, torch.empty(T * k, H), torch.empty(T * k, H), gather=(xin, tok),
             combine=(back, wts, out))
    assert torch.allclose(out, want, rtol=1e-6, atol=1e-6)


def q8_rows(x: torch.Tensor) -> torch.Tensor:
    """The q8 rule written out: each 32 values of a row scaled by amax / 127 and rounded half to even
    to integers (returned dequantized, float64)."""
    n, K = x.shape
    g = x.double().reshape(n, K // 32, 32)
    d = (g.abs().amax(-1, keepdim=True).float() / 127).double()      # the scale as float32 computes it
    q = torch.where(d > 0, torch.round(g / torch.where(d > 0, d, 1.0)), 0.0)
    return (q * d).reshape(n, K)


@pytest.mark.parametrize("fmt,params", [("mxfp4", {}), ("int4", {"group": 32, "scale_dtype": "bfloat16"}),
                                        ("int4", {"group": 64, "scale_dtype": "float32"}),
                                        ("int8", {"group": 32, "scale_dtype": "float16"})])
@pytest.mark.parametrize("H,I", [(256, 256), (160, 96), (224, 288)])   # 4k, 4k + 1, 4k + 3 chunks of 32
def test_q8_path_is_the_q8_rule_exactly(fmt, params, H, I):
    """q8 against its definition: x rounded by q8_rows, the expert in float64 on the dequantized weights,
    its SwiGLU output rounded by q8_rows again before down. The kernel's integer dots are exact, so only
    float32 sums (and a rare rounding tie of h flipped by them) remain: 1e-4 of the output's scale."""
    if params.get("group", 32) > 32 and (H % params["group"] or I % params["group"]):
        pytest.skip("sizes not divisible by the group")
    specs, blobs = make_experts(fmt, params, H, I, 3, seed=11)
    kern = HostMoE(specs, H, I, H, act_quant="q8")
    xs = torch.randn(6, H, generator=torch.Generator().manual_seed(4))
    ys = torch.empty(6, H)
    kern.run(blobs, [0, 1, 4], [1, 3, 2], xs, ys)
    codec = ExpertCodec(specs, torch.float32, "cpu")
    for blob, a, n in zip(blobs, [0, 1, 4], [1, 3, 2]):
        w = {k: v.double() for k, v in codec.dequantize_all(blob).items()}
        h = q8_rows(xs[a:a + n]) @ torch.cat([w["gate"], w["up"]]).T
        act = torch.nn.functional.silu(h[:, :I]) * h[:, I:]
        ref = q8_rows(act.float()) @ w["down"].T
        err = (ys[a:a + n].double() - ref).abs().max().item()
        assert err <= 1e-4 * ref.abs().max().item(), (fmt, err)


@pytest.mark.parametrize("quant", ["int8", "int4"])
@pytest.mark.parametrize("act_quant", ["none", "q8"])
@pytest.mark.parametrize("K,N,n", [(96, 40, 1), (256, 75, 3), (160, 33, 9), (512, 64, 17)])
def test_dense_quant_linear_matches_its_definition(quant, act_quant, K, N, n):
    """--dense-quant: the weight quantized by the int8 / int4 format's own rule (runtime/quant.py, whose
    dequantization test_quantized checks against the specs), x as is or by the q8 rule; float64 here."""
    from runtime.model.layers.dense import Linear
    from runtime.quant import get_format
    g = torch.Generator().manual_seed(K + n)
    w, b, x = torch.randn(N, K, generator=g).to(torch.bfloat16), torch.randn(N, generator=g), torch.randn(n, K, generator=g)
    lin = Linear(w, b, torch.float32, quant=quant, act_quant=act_quant)
    assert lin.quant == quant and lin.nbytes < w.nbytes
    fmt = get_format(quant, group=32, scale_dtype="float16" if quant == "int8" else "bfloat16")
    wd = torch.empty(N, K)
    fmt.dequantize(fmt.quantize(w.float()), wd)
    xr = q8_rows(x) if act_quant == "q8" else x.double()
    ref = xr @ wd.double().T + b.double()
    y = lin(x)
    assert (y.double() - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()


def test_dense_quant_needs_a_multiple_of_32_and_names_bad_values():
    from runtime.model.layers.dense import Linear
    w = torch.randn(8, 40)
    assert Linear(w, None, torch.float32, quant="int8").quant == "none"     # 40 inputs: kept as it is
    with pytest.raises(ValueError, match="not one of none, int8, int4"):
        Linear(w, None, torch.float32, quant="q4")


def test_a_wide_build_the_compiler_refuses_falls_back_to_the_next(monkeypatch):
    """An older gcc without -mavx512vnni (or any wide flag): the narrower build loads, the kernels stay on."""
    if len(ISAS) < 2:
        pytest.skip("the CPU runs one build only")
    real = kernels._build

    def build(cc, flags, extra):
        if extra:
            raise RuntimeError(f"{cc}: unrecognized command-line option '{extra[-1]}'")
        return real(cc, flags, extra)
    monkeypatch.delenv("TIERED_MOE_HOST_ISA")
    monkeypatch.setattr(kernels, "_build", build)
    kernels.reset()
    assert kernels.isa() == "avx2" and kernels.unavailable() is None
    monkeypatch.setenv("TIERED_MOE_HOST_ISA", ISAS[0])       # asked for by name: no fallback, the reason named
    kernels.reset()
    assert kernels.lib() is None and "unrecognized command-line option" in kernels.unavailable()


def test_shipped_builds_load_without_a_compiler(monkeypatch, tmp_path):
    """What setup.py puts in a wheel (build.build_prebuilt: every x86-64 instruction set of this source) loads with
    no compiler on PATH - the widest build the CPU runs -; a build of another source is never loaded (an edited
    moe_cpu.c compiles anew), and with neither a matching build nor a compiler the reason names both."""
    from runtime.kernels import build
    if os.environ.get("TIERED_MOE_HOST_ISA") != ISAS[0]:
        pytest.skip("builds every instruction set itself: once is enough")
    if os.environ.get("TIERED_MOE_KERNEL_SANITIZE") == "1":
        pytest.skip("the sanitizer build is always compiled here (shipped builds are not instrumented)")
    if kernels.unavailable() is not None:
        pytest.skip(f"host kernels unavailable here: {kernels.unavailable()}")
    made, failed = build.build_prebuilt(str(tmp_path / "prebuilt"), os.environ.get("CC") or "gcc")
    assert not failed and len(made) == len(build.ISAS)
    monkeypatch.setattr(kernels, "PREBUILT_DIR", str(tmp_path / "prebuilt"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.delenv("TIERED_MOE_HOST_ISA", raising=False)
    monkeypatch.setenv("TIERED_MOE_KERNEL_CACHE", str(tmp_path / "cache"))
    try:
        kernels.reset()
        assert kernels.lib() is not None and kernels.isa() == ISAS[0]       # the widest this CPU runs
        assert kernels.source() == f"prebuilt ({tmp_path / 'prebuilt' / build.prebuilt_name(ISAS[0], build.source_key())})"
        assert not (tmp_path / "cache").exists()                           # nothing compiled
        # a build of another source (its name keyed by that source's hash) is not this source's
        for f in os.listdir(tmp_path / "prebuilt"):
            os.rename(tmp_path / "prebuilt" / f, tmp_path / "prebuilt" / f.replace(build.source_key(), "0" * 16))
        kernels.reset()
        assert kernels.lib() is None and kernels.source() is None
        why = kernels.unavailable()
        assert "ships in this install" in why and "no C compiler" in why, why
    finally:
        kernels.reset()


def test_extra_compiler_flags_build_apart(monkeypatch, tmp_path):
    """TIERED_MOE_KERNEL_CFLAGS (bench/hugepages.py --ab prefetch-hint) compiles a library of its own, here, even where
    a shipped build exists; the prefetch hint it sets changes no result (the old NTA build against the default T1
    one, an int4 x q8 Linear bit for bit); flags the compiler refuses leave the kernels off with its message."""
    from runtime.model.layers.dense import Linear
    if os.environ.get("TIERED_MOE_HOST_ISA") != ISAS[0] or os.environ.get("TIERED_MOE_KERNEL_SANITIZE") == "1":
        pytest.skip("compiles its own builds: once is enough")
    if kernels.unavailable() is not None:
        pytest.skip(f"host kernels unavailable here: {kernels.unavailable()}")
    g = torch.Generator().manual_seed(3)
    w, x = (torch.randn(64, 256, generator=g) * 0.05).to(torch.bfloat16), torch.randn(3, 256, generator=g)
    want = Linear(w, None, torch.float32, "int4", "q8")(x)                  # the default build (prefetch into L2)
    monkeypatch.setenv("TIERED_MOE_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("TIERED_MOE_KERNEL_CFLAGS", "-DPFH=_MM_HINT_NTA")
    try:
        kernels.reset()
        assert kernels.lib() is not None and kernels.source().startswith(f"compiled here ({tmp_path / 'cache'}")
        assert torch.equal(Linear(w, None, torch.float32, "int4", "q8")(x), want)
        monkeypatch.setenv("TIERED_MOE_KERNEL_CFLAGS", "-DPFH=not_a_hint")
        kernels.reset()
        assert kernels.lib() is None and "not_a_hint" in kernels.unavailable()
    finally:
        kernels.reset()


@pytest.mark.parametrize("fmt,params", [("mxfp4", {}), ("int4", {"group": 32, "scale_dtype": "bfloat16"})])
def test_q8_kernel_takes_a_prompts_rows(fmt, params):
    """With 8-bit activations the kernel computes experts of any row count (prefill at chunk 512 gives an
    expert of a 32-expert top-4 model ~64 rows, some far more): no row bound, and an expert of 150 rows
    (row tiles of every size, then a remainder) still follows the q8 rule."""
    H = I = 128
    specs, blobs = make_experts(fmt, params, H, I, 2, seed=5)
    kern = HostMoE(specs, H, I, H, act_quant="q8")
    assert kern.max_rows >= 1 << 20 and HostMoE(specs, H, I, H).max_rows == 64
    rows = [150, 3]
    xs = torch.randn(sum(rows), H, generator=torch.Generator().manual_seed(9))
    ys = torch.full((sum(rows), H), float("nan"))
    kern.run(blobs, [0, 150], rows, xs, ys)
    codec = ExpertCodec(specs, torch.float32, "cpu")
    for blob, a, n in zip(blobs, [0, 150], rows):
        w = {k: v.double() for k, v in codec.dequantize_all(blob).items()}
        h = q8_rows(xs[a:a + n]) @ torch.cat([w["gate"], w["up"]]).T
        ref = q8_rows((torch.nn.functional.silu(h[:, :I]) * h[:, I:]).float()) @ w["down"].T
        assert (ys[a:a + n].double() - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()
