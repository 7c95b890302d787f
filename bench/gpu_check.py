"""CUDA checks for a lent GPU, in one short run (prepared on CPU; run it where CUDA exists).

1. Pinned host->device peak: one large pinned copy, CUDA events.
2. Streaming experts through ExpertStore (pinned host slab -> device slots on the side stream):
   achieved GB/s; goal >= 85% of (1) measured in the same run.
3. Decode step time of the engine with lookahead prefetch vs max(compute time, transfer time):
   compute from an all-resident run, transfer from the bytes moved at the GB/s of (2);
   goal <= 1.15x.
4. Quantized experts (issue 9): dequantize + one-token matmul of a K3-shaped MXFP4 expert
   (3584 x 3072 SwiGLU) with ``ExpertCodec`` against the transfer time it saves over bf16 at the
   GB/s of (2); goal: dequant <= 0.5x the saving. Also the same for INT4 and FP8.
5. Hybrid execution (issue 11): batch-1 decode with 25% of experts on the device, transfer-only
   vs hybrid (``--cpu-experts auto``: the cost model computes some misses on the host CPU) vs all
   resident; and one K3-shaped bf16 expert timed on the host CPU at one token against the h200
   profile's prediction (goal: within 25%).
6. Hybrid attention (issue 12): the K3-shaped synthetic model (KDA + MLA, LatentMoE, Block
   AttnRes, MXFP4 experts; recurrent state slots) decoded on the device with 25% of experts
   resident, batch 3, against the same run on the CPU: greedy tokens equal, and the last logits
   of a prefill + decode within 2e-2 (float32).
7. The cuda-marked tests.
8. Tensor parallelism (issue 20): as many ranks as the machine has GPUs (at least 2: with one GPU the ranks
   share it, over gloo), 25% of the experts per rank as slices, against one process: the same greedy tokens,
   the ranks' residency equal, each rank's host->device bytes 1/N of one process's (within 2%), the shared
   host tier mapped (and whether CUDA pinned it), decode tokens/s of both.
Writes $OUT/gpu_check.json (or bench/results/gpu_check.json) and prints it.

``--dry-run`` runs every step on the CPU at toy sizes (no pinned memory, wall-clock timing, no
pytest step), so the script's code paths are exercised where no GPU is lent: CI runs it
(tests/bench/test_gpu_check.py). Its numbers mean nothing.

Usage: python bench/gpu_check.py [--dry-run]
"""
import argparse
import json
import os
import subprocess
import sys
import shutil
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)


class Clock:
    """CUDA events on a GPU, perf_counter (after a sync) elsewhere."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def time(self, fn, reps: int) -> float:
        """Median seconds of ``fn()``."""
        ts = []
        for _ in range(reps):
            if self.cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                torch.cuda.synchronize()
                ts.append(a.elapsed_time(b) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
        return sorted(ts)[len(ts) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dry-run", action="store_true", help="CPU, toy sizes: check the code paths, not the machine")
    a = ap.parse_args()
    dry = a.dry_run
    if not dry and not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device here; run it on the lent GPU machine (or --dry-run)")
    dev = "cpu" if dry else "cuda"
    clock = Clock(not dry)
    out_dir = os.environ.get("OUT") or os.path.join(HERE, "results")
    R = {"gpu": "dry run (cpu)" if dry else torch.cuda.get_device_name(0), "torch": torch.__version__}
    # 1. pinned peak
    peak = pinned_peak(clock, dev, dry)
    R["pinned_peak_GBps"] = round(peak, 1)
    # 2. streaming experts
    work = tempfile.mkdtemp(prefix="tiered-moe-gpu-")
    try:
        gbps = store_stream(clock, work, dev, dry)
        R["store_stream_GBps"] = round(gbps, 1)
        R["store_stream_vs_peak"] = round(gbps / peak, 3)
        R["store_stream_goal_met"] = gbps >= 0.85 * peak
        # 3. decode step with prefetch
        store = build_decode_store(work, dry)
        compute, R["decode"] = decode_check(store, dev, dry, gbps)
        # 4. quantized experts: dequantize + matmul vs the transfer saved
        R["quantized"] = quantized_check(clock, dev, dry, gbps)
        # 5. hybrid execution: transfer-only vs the cost model's split vs all resident, batch 1
        R["hybrid"] = hybrid_check(store, dev, dry, compute)
        # 6. hybrid attention on the device against the CPU
        R["hybrid_attention"] = hybrid_attention_check(work, dev)
        # 8. tensor parallelism (issue 20): as many ranks as GPUs, at least 2 (one GPU is shared by the ranks, over
        # gloo); 25% of the experts per rank as slices; against one process: tokens, bytes per rank, speed
        R["tensor_parallel"] = tensor_parallel_check(store, dry)
        # 7. cuda tests
        R["cuda_tests"] = cuda_tests(dry)
    finally:
        shutil.rmtree(work, ignore_errors=True)     # the stores written here (16 MB dry, GBs on the GPU machine)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "gpu_check_dry_run.json" if dry else "gpu_check.json"), "w") as f:
        json.dump(R, f, indent=1)
    print(json.dumps(R, indent=1))


def pinned_peak(clock: Clock, dev: str, dry: bool) -> float:
    """1. GB/s of one large pinned host->device copy."""
    MiB = 2 ** 20
    n = (8 if dry else 512) * MiB
    src = torch.empty(n, dtype=torch.uint8, pin_memory=not dry).random_(0, 255)
    dst = torch.empty(n, dtype=torch.uint8, device=dev)
    return n / clock.time(lambda: dst.copy_(src, non_blocking=True), 6) / 1e9


def store_stream(clock: Clock, work: str, dev: str, dry: bool) -> float:
    """2. GB/s of experts streamed through ExpertStore (DeepSeek-V2-Lite-sized bf16 experts: 2048 x 1408
    SwiGLU, ~17 MB)."""
    from runtime.store import ExpertStore, Manifest, StoreWriter
    from runtime.quant import expert_weight_specs, get_format
    L, E, H, I = (2, 8, 256, 128) if dry else (2, 32, 2048, 1408)
    sdir = os.path.join(work, "stream")
    w = StoreWriter(sdir, model="gpu-check", num_layers=L, num_experts=E,
                    weights=expert_weight_specs(H, I, get_format("bf16")))
    blob = {"gate_up": torch.randn(2 * I, H).to(torch.bfloat16), "down": torch.randn(H, I).to(torch.bfloat16)}
    for l in range(L):
        for e in range(E):
            w.write(l, e, blob)
    w.close()
    m = Manifest.read(sdir)
    with ExpertStore(sdir, device_budget=8 * m.blob_stride, device=dev, threads=4) as st:
        clock.sync()
        t0 = time.perf_counter()
        moved0 = st.stats.bytes["host_to_device"]
        for rep in range(3):
            for l in range(L):
                for e0 in range(0, E, 4):
                    st.request(l, list(range(e0, e0 + 4)), rep * 100 + l * 10 + e0).wait()
        clock.sync()
        dt = time.perf_counter() - t0
        return (st.stats.bytes["host_to_device"] - moved0) / dt / 1e9


def build_decode_store(work: str, dry: bool) -> str:
    """The synthetic model of steps 3, 5 and 8, converted: its store's path."""
    from runtime.model.convert import convert
    from runtime.model.synthetic import SyntheticModelSpec, build_checkpoint
    # 4 layers x 16 experts of 12.6 MB (fp32): ~0.8 GB to write, small enough for a short device session.
    spec = (SyntheticModelSpec(hidden_size=64, intermediate_size=64, num_layers=2, num_experts=8, vocab_size=256) if dry
            else SyntheticModelSpec(hidden_size=1024, intermediate_size=1024, num_layers=4, num_experts=16))
    hf, store = os.path.join(work, "hf"), os.path.join(work, "store")
    build_checkpoint(hf, spec)
    convert(hf, store)
    return store


def decode_run(store: str, dev: str, dry: bool, frac: float, prefetch: str, stall: "list | None" = None,
               **kw) -> "tuple[float, float]":
    """Batch-1 decode with ``frac`` of the experts on the device: (seconds, host->device bytes) per step, the
    first decode steps left out; ``stall``: gets the seconds per step compute waited for experts."""
    from runtime.engine import Engine, SamplingParams
    from runtime.model import load_model
    from runtime.store import Manifest
    m = Manifest.read(store)
    model, st = load_model(store, expert_budget=max(2, int(frac * m.num_layers * m.num_experts)) * m.blob_stride,
                           device=dev, **kw)
    try:
        eng = Engine(model, st, max_batch=1, prefill_chunk=8, prefetch=prefetch)
        eng.add_request(list(range(8)), SamplingParams(max_tokens=16 if dry else 48, ignore_eos=True))
        eng.run()
        dec = [s for s in eng.steps if s.tokens == 1][4:]
        if stall is not None:
            stall.append(sum(s.stall_seconds for s in dec) / len(dec))
        return (sum(s.seconds for s in dec) / len(dec), sum(s.bytes["host_to_device"] for s in dec) / len(dec))
    finally:
        st.close()


def decode_check(store: str, dev: str, dry: bool, gbps: float) -> "tuple[float, dict]":
    """3. Decode step with lookahead prefetch vs max(compute, transfer): (all-resident step seconds, the report)."""
    compute, _ = decode_run(store, dev, dry, 1.0, "none")
    stall: list = []
    step, moved = decode_run(store, dev, dry, 0.25, "lookahead", stall)
    step_none, _ = decode_run(store, dev, dry, 0.25, "none", stall)
    transfer = moved / (gbps * 1e9)
    # the stall with the lookahead prefetch (issued when the layer before routes: issue 28) and without one
    return compute, {"compute_ms": compute * 1e3, "transfer_ms": transfer * 1e3, "step_ms_with_prefetch": step * 1e3,
                     "step_ms_no_prefetch": step_none * 1e3, "stall_ms_lookahead": stall[0] * 1e3,
                     "stall_ms_no_prefetch": stall[1] * 1e3,
                     "ratio_to_max": step / max(compute, transfer), "goal_met": step <= 1.15 * max(compute, transfer)}


def quantized_check(clock: Clock, dev: str, dry: bool, gbps: float) -> dict:
    """4. Dequantize (+ one-token matmul) of a K3-shaped expert per format vs the transfer it saves over bf16."""
    from runtime.quant import ExpertCodec, expert_weight_specs, get_format
    Hq, Iq = (256, 128) if dry else (3584, 3072)
    bf16_bytes = 3 * Hq * Iq * 2
    out = {"expert_shape": f"{Hq} x {Iq} SwiGLU"}
    for name in ("mxfp4", "int4", "fp8"):
        fmt = get_format({"fp8": "fp8_e4m3"}.get(name, name))
        specs = expert_weight_specs(Hq, Iq, fmt)
        g = torch.Generator().manual_seed(0)
        views = {f"{s.name}.{k}": v.to(dev) for s in specs
                 for k, v in fmt.quantize(torch.randn(s.shape, generator=g) * 0.02).items()}
        qbytes = sum(v.numel() * v.element_size() for v in views.values())
        codec = ExpertCodec(specs, torch.bfloat16, dev)
        x = torch.randn(1, Hq, dtype=codec.compute_dtype, device=dev)

        def expert():
            t = codec.weights(views)
            h = x @ t.gate_up_t
            return (torch.nn.functional.silu(h[:, :Iq]) * h[:, Iq:]) @ t.down_t
        deq = clock.time(lambda: codec.weights(views), 10)
        full = clock.time(expert, 10)
        saved = (bf16_bytes - qbytes) / (gbps * 1e9)
        out[name] = {"bytes": qbytes, "dequant_us": deq * 1e6, "dequant_plus_matmul_us": full * 1e6,
                     "transfer_saved_us": saved * 1e6, "dequant_vs_saved": deq / saved,
                     "goal_met": deq <= 0.5 * saved}
    return out


def hybrid_check(store: str, dev: str, dry: bool, compute: float) -> dict:
    """5. Batch-1 decode, transfer-only vs hybrid (some misses on the host CPU) vs all resident (``compute``); one
    K3-shaped bf16 expert on the host CPU against the h200 profile's prediction."""
    moved_only, _ = decode_run(store, dev, dry, 0.25, "none")
    hybrid, hybrid_moved = decode_run(store, dev, dry, 0.25, "none", cpu_experts="auto", profile="h200")
    from cache_policy.cost_model import expert_params, load_profile
    Hk, Ik = (256, 128) if dry else (3584, 3072)
    g = torch.Generator().manual_seed(0)
    wgu = (torch.randn(Hk, 2 * Ik, generator=g) * 0.02).to(torch.bfloat16)     # input-major, as the store keeps it
    wd = (torch.randn(Ik, Hk, generator=g) * 0.02).to(torch.bfloat16)
    xh = torch.randn(1, Hk, generator=g).to(torch.bfloat16)

    def host_expert():
        h = xh @ wgu
        return (torch.nn.functional.silu(h[:, :Ik]) * h[:, Ik:]) @ wd
    host_s = Clock(False).time(host_expert, 20)
    pred = float(load_profile("h200").host_compute_seconds(1, expert_params(Hk, Ik)))
    return {"transfer_only_ms": moved_only * 1e3, "hybrid_ms": hybrid * 1e3, "resident_ms": compute * 1e3,
            "hybrid_h2d_MB_per_step": hybrid_moved / 1e6, "hybrid_vs_transfer_only": moved_only / hybrid,
            "host_threads": torch.get_num_threads(), "host_expert_us_measured": host_s * 1e6,
            "host_expert_us_predicted": pred * 1e6, "prediction_within_25pct": abs(host_s - pred) <= 0.25 * host_s}


def hybrid_attention_check(work: str, dev: str) -> dict:
    """6. The K3-shaped synthetic model (MXFP4 experts, 25% resident) on ``dev`` against the CPU: greedy tokens
    equal, logits of a prefill + decode within 2e-2."""
    from runtime.model.convert import convert
    from runtime.model.synthetic import K3ShapeSpec, build_k3_checkpoint
    k3 = K3ShapeSpec(vocab_size=256, hidden_size=128, latent_size=64, expert_intermediate=64, num_layers=4,
                     num_experts=32, top_k=8, kda_heads=2, kda_head_dim=32, mla_heads=2, kv_lora_rank=32,
                     qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, topics=4)
    k3hf, k3store = os.path.join(work, "k3-hf"), os.path.join(work, "k3-store")
    build_k3_checkpoint(k3hf, k3)
    convert(k3hf, k3store, quantize="mxfp4")
    dev_logits, dev_tokens = k3_run(k3store, dev)
    cpu_logits, cpu_tokens = k3_run(k3store, "cpu")
    diff = float((dev_logits - cpu_logits).abs().max())
    return {"max_logit_diff": diff, "tokens_equal": dev_tokens == cpu_tokens,
            "goal_met": diff <= 2e-2 and dev_tokens == cpu_tokens}


def k3_run(k3store: str, device: str) -> "tuple[torch.Tensor, list]":
    """Logits of a prefill + three decode steps, and the greedy tokens of three requests at batch 3."""
    from runtime.engine import Engine, SamplingParams
    from runtime.engine.kv_manager import KVManager
    from runtime.model import Sequence, load_model
    from runtime.store import Manifest
    mk = Manifest.read(k3store)
    model, st = load_model(k3store, expert_budget=max(8, mk.num_layers * mk.num_experts // 4) * mk.blob_stride,
                           device=device, dtype=torch.float32)
    try:
        s, kv = Sequence(), KVManager.for_model(model)
        logits = []
        for chunk in (list(range(1, 12)), [5], [9], [40]):
            kv.prepare([s], [chunk])
            logits.append(model.forward([s], [chunk])[0].float().cpu())
        kv.release(s)
        eng = Engine(model, st, max_batch=3, prefill_chunk=4)
        ids = [eng.add_request(p, SamplingParams(max_tokens=12, ignore_eos=True))
               for p in ([3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7, 9])]
        eng.run()
        return torch.stack(logits), [eng.done[i].output for i in ids]
    finally:
        st.close()


def cuda_tests(dry: bool) -> str:
    """7. The last line of pytest's summary of the cuda-marked tests."""
    if dry:
        return "skipped (dry run)"
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "cuda", "tests"], cwd=ROOT, capture_output=True,
                       text=True)
    return p.stdout.strip().splitlines()[-1] if p.stdout.strip() else p.stderr[-500:]


def tensor_parallel_check(store: str, dry: bool) -> dict:
    from runtime.config import RuntimeConfig
    from runtime.engine import SamplingParams
    from runtime.parallel.group import Group
    from runtime.parallel.shard import Shard, rank_manifest
    from runtime.store import Manifest
    m = Manifest.read(store)
    ranks = 2 if dry or torch.cuda.device_count() < 2 else torch.cuda.device_count()
    n = max(2, m.num_layers * m.num_experts // 4)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 8, 7]]
    out = {"ranks": ranks, "gpus": 0 if dry else torch.cuda.device_count()}
    for tp in (1, ranks):
        stride = m.blob_stride if tp == 1 else rank_manifest(m, Shard(0, tp)).blob_stride
        cfg = RuntimeConfig(model=store, max_batch=2, expert_budget=n * stride, policy="lru", tensor_parallel=tp)
        group = None
        try:
            if tp == 1:
                model, st = cfg.load()
                eng = cfg.engine(model, st)
            else:
                group = Group(cfg)
                model, st = group.load()
                eng = group.make_engine(model, st)
            ids = [eng.add_request(p, SamplingParams(max_tokens=8 if dry else 32, ignore_eos=True)) for p in prompts]
            t0 = time.perf_counter()
            eng.run()
            wall = time.perf_counter() - t0
            s = eng.summary()
            snaps = eng.gather("snapshot") if tp > 1 else [st.snapshot()]
            r = {"tokens": [eng.done[i].output for i in ids], "decode_tokens_per_s": s["decode_tokens_per_s"],
                 "wall_s": wall, "h2d_bytes_per_rank": [x["bytes"]["host_to_device"] for x in snaps]}
            if tp > 1:
                lay = eng.gather("layout")
                r.update(backend=group.rank.backend, host_shared=all(x["host_shared"] for x in lay),
                         host_pinned=[x["host_pinned"] for x in lay],
                         residency_equal=len({json.dumps(x) for x in eng.gather("residency")}) == 1)
            st.close()
        finally:
            if group is not None:
                group.close()
        out[f"tp{tp}"] = r
    one, many = out["tp1"], out[f"tp{ranks}"]
    out["tokens_equal"] = one["tokens"] == many["tokens"]
    out["bytes_ratio_per_rank"] = [b / max(1, one["h2d_bytes_per_rank"][0]) for b in many["h2d_bytes_per_rank"]]
    out["goal_met"] = (out["tokens_equal"] and many["residency_equal"]
                       and all(abs(x * ranks - 1) < 0.02 for x in out["bytes_ratio_per_rank"]))
    return out


if __name__ == "__main__":
    main()
