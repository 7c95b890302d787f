"""The host kernels inside the model: a bf16 checkpoint (experts read as bf16, dense weights kept in
bf16) against transformers on the same (upcast) weights, and the kernel path against the reference
path (TIERED_MOE_HOST_KERNELS=0) of the same store for bf16 and each quantized format. (The released
MXFP4 / FP8 / INT4 layouts run against transformers on the kernels in test_quantized.py: the kernels
are the default path.)"""
import os

import pytest
import torch

from runtime import kernels
from runtime.model import Sequence, load_model
from runtime.model.convert import convert
from runtime.store import Manifest

from helpers import check_against_transformers, feed  # noqa: E402

pytestmark = pytest.mark.slow
if kernels.lib() is None:
    pytest.skip(f"host kernels unavailable: {kernels.unavailable()}", allow_module_level=True)


def _build(tmp_path_factory):
    import importlib.util
    spec = importlib.util.spec_from_file_location("mc", os.path.join(os.path.dirname(__file__), "conftest.py"))
    mc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mc)
    d = tmp_path_factory.mktemp("hk")
    hf = str(d / "hf")
    m = mc.build_hf("qwen3_moe", hf)
    m.to(torch.bfloat16).save_pretrained(hf)          # as released: bf16
    import transformers   # the reference reloaded in float32 (its RoPE buffers rebuilt, not bf16-rounded)
    return transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval(), hf, d


@pytest.fixture(scope="module")
def bf16(tmp_path_factory):
    m, hf, d = _build(tmp_path_factory)
    convert(hf, str(d / "bf16"))
    return m, hf, d


def _logits(store_dir, tokens):
    model, store = load_model(store_dir)
    try:
        s = Sequence()
        return torch.stack([feed(model, [s], [[t]])[0] for t in tokens]), model
    finally:
        store.close()


@pytest.mark.parametrize("frac", [1.0, 0.1])
def test_bf16_store_matches_transformers_on_the_kernels(bf16, frac):
    ref, hf, d = bf16
    model, store = load_model(str(d / "bf16"))
    try:
        assert model.executor.kernel is not None and model.executor.kernel.format == "bf16"
        assert model.layers[0].attn.qkv.kept and model.head.kept          # dense weights stay bf16
        assert model.codec.cache_bytes == 0                               # no float32 copies of experts
    finally:
        store.close()
    check_against_transformers(ref, str(d / "bf16"), frac, "qwen3_moe bf16 on the host kernels")


@pytest.mark.parametrize("which", ["bf16", "int4", "mxfp4", "fp8"])
def test_kernel_path_equals_reference_path(bf16, which, monkeypatch):
    ref, hf, d = bf16
    store = str(d / which)
    if not Manifest.current(store):
        convert(hf, store, quantize=which)
    tokens = list(range(3, 19))
    fast, model = _logits(store, tokens)
    assert model.executor.kernel is not None
    monkeypatch.setenv("TIERED_MOE_HOST_KERNELS", "0")
    kernels.reset()
    try:
        slow, model = _logits(store, tokens)
        assert model.executor.kernel is None and not model.layers[0].attn.qkv.kept
        assert "TIERED_MOE_HOST_KERNELS=0" in kernels.unavailable()
    finally:
        monkeypatch.delenv("TIERED_MOE_HOST_KERNELS")
        kernels.reset()
    assert (fast - slow).abs().max().item() < 1e-4 * max(1.0, slow.abs().max().item())
    assert torch.equal(fast.argmax(-1), slow.argmax(-1))


def _bf16(t: torch.Tensor) -> torch.Tensor:
    """Rounded to bf16 (nearest, ties to even), back in float64."""
    return t.to(torch.bfloat16).double()


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max()).item()


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def torch_threads(request):
    """torch's intra-op threads for one test (2: the bf16 experts split over threads, experts.expert_parallel)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def test_expert_parallel_splits_jobs_over_single_threaded_workers(torch_threads):
    """Every job once, in order within contiguous parts of about equal rows; with 2 threads the parts run in worker
    threads whose torch ops are single-threaded, under the caller's inference mode; with 1, here."""
    import threading
    from runtime.model.layers.experts import expert_parallel
    jobs = [(f"e{i}", 0, n) for i, n in enumerate([40, 3, 25, 9, 30, 1, 12])]
    seen = []

    def fn(part):
        seen.append((list(part), threading.current_thread() is threading.main_thread(), torch.get_num_threads(),
                     torch.is_inference_mode_enabled()))
    with torch.inference_mode():
        expert_parallel(fn, jobs)
    parts = sorted(seen, key=lambda s: jobs.index(s[0][0]))
    assert [j for p in parts for j in p[0]] == jobs
    if torch_threads == 1:
        assert len(parts) == 1 and parts[0][1:] == (True, 1, True)
    else:
        assert len(parts) == 2 and all(not main and n == 1 and inf for _, main, n, inf in parts)
        rows = [sum(j[2] for j in p[0]) for p in parts]
        assert max(rows) - min(rows) <= 40                   # cut at the job that passes half of the rows


def test_the_kernel_pool_spins_in_decode_only(bf16, monkeypatch):
    """A prefill forward sets the pool's spin to 0 (its torch ops thread over the same cores), a decode forward back
    to TIERED_MOE_SPIN_US; the library is called on a change only."""
    ref, hf, d = bf16
    calls = []
    lib = kernels.lib()
    model, store = load_model(str(d / "bf16"))
    monkeypatch.setenv("TIERED_MOE_SPIN_US", "1500")
    real = lib.tm_set_spin_us
    monkeypatch.setattr(lib, "tm_set_spin_us", lambda us: (calls.append(us), real(us)))
    monkeypatch.delitem(kernels._state, "spin_us", raising=False)
    try:
        s = Sequence()
        feed(model, [s], [[5, 6, 7, 8]])
        assert calls[-1] == 0
        feed(model, [s], [[9]])
        feed(model, [s], [[10]])
        assert calls[-2:] == [0, 1500]                   # the second decode step changed nothing
    finally:
        monkeypatch.delenv("TIERED_MOE_SPIN_US")
        kernels.spin_for(True)                              # the real pool back to its default
        store.close()


def test_bf16_activations_past_the_gemv_follow_their_definition(bf16, torch_threads):
    """--host-act-quant q8 (the CLI's default) on a bf16 store: a product of more rows than the GEMV takes
    (prefill) rounds x to bf16 and its result to bf16 (oneDNN sums in float32), as llama.cpp computes BF16
    weights - dense weights, and experts with more rows than the kernel's bf16 threshold, whose SwiGLU then
    runs on the rounded h and is rounded again. The roundings written out here in float64; only the sums'
    order differs, which flips a bf16 rounding now and then (measured: 0 for the experts, 4e-4 of the output's
    scale for the dense product), while leaving the roundings out errs ~4e-3: the test tells them apart. The
    experts of a few rows in the same call run the kernel on float32 rows (2e-5, as test_host_kernels)."""
    ref, hf, d = bf16
    model, store = load_model(str(d / "bf16"), host_act_quant="q8")
    g = torch.Generator().manual_seed(3)
    try:
        lin = model.layers[0].attn.qkv
        assert lin.kept and lin.bf16_acts
        x = torch.randn(40, lin.in_features, generator=g)
        y = lin(x)
        exact = x.double() @ lin.w.double().T
        assert _err(y, _bf16(_bf16(x) @ lin.w.double().T)) <= 1.5e-3 < _err(y, exact)
        ex = model.executor
        assert ex.bf16_acts and ex.bf16_rows < 40
        rows = [40, 3, 0, 25]
        f = store.request(0, list(range(len(rows))), 0)
        f.wait()
        views = [f.tensors(e) for e in range(len(rows))]
        row0 = [0, 40, 43, 43]
        xs = torch.randn(sum(rows), ex.codec.shapes[0], generator=g)
        ys = torch.full((sum(rows), ex.codec.shapes[2]), float("nan"))
        ex.grouped(ex.codec, views, row0, rows, xs, ys)
        I = ex.I
        for v, a, n in zip(views, row0, rows):
            if not n:
                continue
            gu, dn = v["gate_up.t"].double(), v["down.t"].double()         # [in, 2I], [I, out]
            h = xs[a:a + n].double() @ gu
            exact = (torch.nn.functional.silu(h[:, :I]) * h[:, I:]) @ dn
            if n > ex.bf16_rows:
                h = _bf16(_bf16(xs[a:a + n]) @ gu)
                act = _bf16(_bf16(torch.nn.functional.silu(h[:, :I])) * h[:, I:])
                assert _err(ys[a:a + n], _bf16(act @ dn)) <= 1.5e-3 < _err(ys[a:a + n], exact), n
            else:
                assert _err(ys[a:a + n], exact) <= 2e-5, n
    finally:
        store.close()


@pytest.mark.parametrize("dq,tol", [("int8", 0.05), ("int4", 0.35)])
def test_dense_quant_quantizes_every_projection_and_stays_close(bf16, dq, tol):
    """--dense-quant: attention and the head (int8 under int4, as llama.cpp keeps it above 4 bits) run on
    codes, routers stay float (their top-k picks the experts); the logits stay near the float model's
    (measured: 2.4% for int8, 21% for int4 through 3 layers of this fixture's x4-scaled random weights;
    a wrong code layout gives ~100%)."""
    ref, hf, d = bf16
    tokens = list(range(3, 19))
    want, _ = _logits(str(d / "bf16"), tokens)
    model, store = load_model(str(d / "bf16"), dense_quant=dq)
    try:
        for layer in model.layers:
            assert layer.attn.qkv.quant == dq and layer.attn.o.quant == dq
            if hasattr(layer.ffn, "router"):
                assert layer.ffn.router.quant == "none"
        assert model.head.quant == "int8"
        s = Sequence()
        got = torch.stack([feed(model, [s], [[t]])[0] for t in tokens])
    finally:
        store.close()
    err = ((got - want).norm() / want.norm()).item()
    assert 0 < err < tol, err


def test_cli_runtime_flags_reach_the_model(bf16):
    from runtime.cli import _runtime_config, build_parser
    ref, hf, d = bf16
    a = build_parser().parse_args(["generate", "--model", str(d / "bf16"), "--prompt", "x", "--dense-quant", "int4",
                                   "--host-act-quant", "q8"])
    cfg = _runtime_config(a)
    assert (cfg.dense_quant, cfg.host_act_quant) == ("int4", "q8")
    # 8-bit activations are the default (llama.cpp's); --host-act-quant none is the exact path, load_model's default
    for argv, want in (([], "q8"), (["--host-act-quant", "none"], "none")):
        got = _runtime_config(build_parser().parse_args(["generate", "--model", str(d / "bf16"), "--prompt", "x",
                                                         *argv]))
        assert (got.host_act_quant, got.dense_quant) == (want, "auto")      # auto: as the store records
    import inspect
    from runtime.model import load_model
    assert inspect.signature(load_model).parameters["host_act_quant"].default == "none"
    model, store = cfg.load()
    try:
        assert model.layers[0].attn.qkv.quant == "int4" and model.layers[0].attn.qkv.args.q8 == 1
        assert model.executor.kernel.act_quant == "none"       # bf16 experts: q8 is for quantized ones
    finally:
        store.close()


def test_a_store_converted_with_dense_quant_runs_it_by_default(bf16, tmp_path):
    """``convert --dense-quant int4`` records the choice in the manifest (the tensors stay as the checkpoint has
    them); load_model's default (auto) then runs the dense projections quantized - bit for bit what
    ``--dense-quant int4`` gives on a plain store -, an explicit --dense-quant none still runs them exact, and the
    CPU plan counts them as kept. A bad recorded value is refused naming it."""
    from runtime.cli import build_parser
    from runtime.model.layers.dense import resolve_dense_quant
    from runtime.plan import plan_cpu
    ref, hf, d = bf16
    store = str(tmp_path / "dq")
    args = build_parser().parse_args(["convert", "--model", hf, "--out", store, "--dense-quant", "int4"])
    assert args.func(args) == 0
    assert Manifest.read(store).extra["dense_quant"] == "int4" and "dense_quant" not in Manifest.read(str(d / "bf16")).extra
    tokens = list(range(3, 11))

    def run(store_dir, **kw):
        model, st = load_model(store_dir, **kw)
        try:
            s = Sequence()
            return model.layers[0].attn.o.quant, torch.stack([feed(model, [s], [[t]])[0] for t in tokens])
        finally:
            st.close()
    q_auto, auto = run(store)
    q_hand, hand = run(str(d / "bf16"), dense_quant="int4")
    q_none, exact = run(store, dense_quant="none")
    q_plain, plain = run(str(d / "bf16"))
    assert (q_auto, q_hand, q_none, q_plain) == ("int4", "int4", "none", "none")
    assert torch.equal(auto, hand) and torch.equal(exact, plain) and not torch.equal(auto, plain)
    assert plan_cpu(store, context=64, batch=1, memory=2**30, probe_disk=False)["dense"] == \
        plan_cpu(str(d / "bf16"), context=64, batch=1, memory=2**30, probe_disk=False, dense_quant="int4")["dense"]
    with pytest.raises(ValueError, match="records dense_quant 'int3'"):
        resolve_dense_quant("auto", {"dense_quant": "int3"})
    with pytest.raises(ValueError, match="--dense-quant 'fp4'"):
        resolve_dense_quant("fp4", {})
    with pytest.raises(ValueError, match="--dense-quant 'int2' is not supported"):
        convert(hf, str(tmp_path / "bad"), dense_quant="int2")
