"""CUDA checks for a lent GPU, in one short run (prepared on CPU; run it where CUDA exists).

1. Pinned host->device peak: one large pinned copy, CUDA events.
2. Streaming experts through ExpertStore (pinned host slab -> device slots on the side stream):
   achieved GB/s; goal >= 85% of (1) measured in the same run.
3. Decode step time of the engine with lookahead prefetch vs max(compute time, transfer time):
   compute from an all-resident run, transfer from the bytes moved at the GB/s of (2);
   goal <= 1.15x.
4. The cuda-marked tests.
Writes $OUT/gpu_check.json (or bench/results/gpu_check.json) and prints a table.

Usage: python bench/gpu_check.py [--quick]
"""
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)


def main():
    if not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device here; run it on the lent GPU machine")
    from runtime.store import ExpertStore, Manifest, StoreWriter
    out_dir = os.environ.get("OUT") or os.path.join(HERE, "results")
    R = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}
    MiB = 2 ** 20
    # 1. pinned peak
    n = 512 * MiB
    src = torch.empty(n, dtype=torch.uint8, pin_memory=True).random_(0, 255)
    dst = torch.empty(n, dtype=torch.uint8, device="cuda")
    ts = []
    for _ in range(6):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); dst.copy_(src, non_blocking=True); b.record(); torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    peak = n / sorted(ts)[len(ts) // 2] / 1e9
    R["pinned_peak_GBps"] = round(peak, 1)
    del src, dst
    # 2. streaming experts (DeepSeek-V2-Lite-sized bf16 experts: 2048 x 1408 SwiGLU, ~17 MB)
    from runtime.quant import expert_weight_specs, get_format
    work = tempfile.mkdtemp(prefix="tiered-moe-gpu-")
    L, E, H, I = 2, 32, 2048, 1408
    w = StoreWriter(work, model="gpu-check", num_layers=L, num_experts=E,
                    weights=expert_weight_specs(H, I, get_format("bf16")))
    blob = {"gate_up": torch.randn(2 * I, H).to(torch.bfloat16), "down": torch.randn(H, I).to(torch.bfloat16)}
    for l in range(L):
        for e in range(E):
            w.write(l, e, blob)
    w.close()
    m = Manifest.read(work)
    with ExpertStore(work, device_budget=8 * m.blob_stride, device="cuda", threads=4) as st:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        moved0 = st.stats.bytes["host_to_device"]
        for rep in range(3):
            for l in range(L):
                for e0 in range(0, E, 4):
                    st.request(l, list(range(e0, e0 + 4)), rep * 100 + l * 10 + e0).wait()
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        gbps = (st.stats.bytes["host_to_device"] - moved0) / dt / 1e9
    R["store_stream_GBps"] = round(gbps, 1)
    R["store_stream_vs_peak"] = round(gbps / peak, 3)
    R["store_stream_goal_met"] = gbps >= 0.85 * peak
    # 3. decode step with prefetch
    from runtime.engine import Engine, SamplingParams
    from runtime.model import load_model
    from runtime.model.convert import convert
    from runtime.model.synthetic import SyntheticModelSpec, build_checkpoint
    # 4 layers x 16 experts of 12.6 MB (fp32): ~0.8 GB to write, small enough for a short device session.
    spec = SyntheticModelSpec(hidden_size=1024, intermediate_size=1024, num_layers=4, num_experts=16)
    hf, store = os.path.join(work, "hf"), os.path.join(work, "store")
    build_checkpoint(hf, spec)
    convert(hf, store)
    m = Manifest.read(store)

    def run(frac, prefetch):
        model, st = load_model(store, expert_budget=max(2, int(frac * m.num_layers * m.num_experts)) * m.blob_stride,
                               device="cuda")
        try:
            eng = Engine(model, st, max_batch=1, prefill_chunk=8, prefetch=prefetch)
            eng.add_request(list(range(8)), SamplingParams(max_tokens=48, ignore_eos=True))
            eng.run()
            dec = [s for s in eng.steps if s.tokens == 1][4:]
            return (sum(s.seconds for s in dec) / len(dec), sum(s.bytes["host_to_device"] for s in dec) / len(dec))
        finally:
            st.close()
    compute, _ = run(1.0, "none")
    step, moved = run(0.25, "lookahead")
    transfer = moved / (gbps * 1e9)
    R["decode"] = {"compute_ms": compute * 1e3, "transfer_ms": transfer * 1e3, "step_ms_with_prefetch": step * 1e3,
                   "ratio_to_max": step / max(compute, transfer), "goal_met": step <= 1.15 * max(compute, transfer)}
    # 4. cuda tests
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "cuda", "tests"], cwd=ROOT, capture_output=True, text=True)
    R["cuda_tests"] = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else p.stderr[-500:]
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "gpu_check.json"), "w") as f:
        json.dump(R, f, indent=1)
    print(json.dumps(R, indent=1))


if __name__ == "__main__":
    main()
