"""Peak resident memory of `generate` on a checkpoint whose experts are larger than the host budget.

Builds a synthetic Mixtral-format checkpoint with large experts, converts it (its own process,
peak RSS reported too), then runs `tiered-moe generate` with a host budget well below the total
expert bytes and measures the child's peak RSS (getrusage ru_maxrss). The bound it is checked
against: host budget + device budget (on a CPU-only machine the device tier is host memory too)
+ dense weights + KV cache + the overhead of an idle process that imported the same modules
(measured in the same run).

Usage: python bench/memory.py [--workdir DIR] [--out bench/results/memory.md]
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MiB = 2 ** 20


def peak_rss(cmd) -> "tuple[int, float, str]":
    """Run cmd in a fresh child and return its peak RSS in bytes (ru_maxrss of that child alone)."""
    code = ("import resource, subprocess, sys, json, time; t=time.time(); "
            "p = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
            "print(json.dumps({'rc': p.returncode, 'rss': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024, "
            "'secs': time.time()-t, 'err': p.stderr[-2000:], 'out': p.stdout[-2000:]}))")
    out = subprocess.run([sys.executable, "-c", code, *cmd], capture_output=True, text=True, cwd=ROOT)
    d = json.loads(out.stdout)
    if d["rc"] != 0:
        raise SystemExit(f"{' '.join(cmd)} failed: {d['err']}")
    return d["rss"], d["secs"], d["out"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "tiered-moe-bench-memory"))
    ap.add_argument("--out", default=os.path.join(HERE, "results", "memory.md"))
    a = ap.parse_args()
    sys.path.insert(0, ROOT)
    from runtime.model.synthetic import SyntheticModelSpec, build_checkpoint
    spec = SyntheticModelSpec(hidden_size=512, intermediate_size=1024, num_layers=8, num_experts=32, vocab_size=512)
    hf, store = os.path.join(a.workdir, "hf"), os.path.join(a.workdir, "store")
    py = sys.executable
    if not os.path.exists(os.path.join(hf, "config.json")):
        build_checkpoint(hf, spec)
    import shutil
    shutil.rmtree(store, ignore_errors=True)
    conv_rss, conv_s, _ = peak_rss([py, "-m", "runtime.cli", "convert", "--model", hf, "--out", store])
    from runtime.store import Manifest
    m = Manifest.read(store)
    experts = m.num_layers * m.num_experts * m.blob_stride
    dense = os.path.getsize(os.path.join(store, "dense.safetensors"))
    host_budget = 256 * MiB
    device_experts = 64 * MiB
    max_tokens, prompt = 32, 8
    # KV cache, preallocated in blocks of 16 tokens: layers x 2 (k, v) x kv_heads x head_dim x tokens x 4 bytes,
    # for prompt + max_tokens rounded up to whole blocks; passed as --kv-cache-budget (inside the device budget).
    kv_tokens = -(-(prompt + max_tokens) // 16) * 16
    kv = spec.num_layers * 2 * spec.num_kv_heads * (spec.hidden_size // spec.num_heads) * kv_tokens * 4
    device_budget = device_experts + dense + kv
    idle_rss, _, _ = peak_rss([py, "-c", "import torch, numpy, safetensors, tokenizers, runtime.cli, runtime.model, "
                                          "runtime.engine, runtime.store, cache_policy"])
    gen_rss, gen_s, out = peak_rss([py, "-m", "runtime.cli", "generate", "--model", store, "--prompt-ids",
                                    ",".join(str(i) for i in range(1, prompt + 1)), "--max-tokens", str(max_tokens),
                                    "--device-budget", f"{device_budget}B", "--host-budget", f"{host_budget}B",
                                    "--kv-cache-budget", f"{kv}B", "--json"])
    summ = json.loads(out.strip().splitlines()[-1])
    # Stated overhead: an idle process with the same imports, plus a 32 MiB working margin for
    # activations, logits, thread stacks and allocator slack (fixed before this run's numbers).
    margin = 32 * MiB
    budgets = host_budget + device_budget   # the device budget holds the KV cache
    bound = budgets + idle_rss + margin
    ok = gen_rss <= bound
    lines = [
        f"expert files: {experts / MiB:.0f} MiB ({m.num_layers} layers x {m.num_experts} experts x {m.blob_stride / MiB:.1f} MiB)",
        f"dense weights: {dense / MiB:.1f} MiB; KV cache ({kv_tokens} token slots for {prompt}+{max_tokens} tokens, "
        f"--kv-cache-budget): {kv / 1024:.0f} KiB",
        f"host budget: {host_budget / MiB:.0f} MiB; device budget: {device_budget / MiB:.1f} MiB "
        f"(dense + KV + {device_experts / MiB:.0f} MiB of experts; CPU memory on this machine)",
        f"stated overhead: idle process with the same imports {idle_rss / MiB:.0f} MiB + working margin {margin / MiB:.0f} MiB",
        f"generate peak RSS: {gen_rss / MiB:.0f} MiB in {gen_s:.1f} s = budgets {budgets / MiB:.0f} MiB + idle "
        f"{idle_rss / MiB:.0f} MiB + {(gen_rss - budgets - idle_rss) / MiB:.0f} MiB working memory; bound "
        f"{bound / MiB:.0f} MiB -> {'within' if ok else 'ABOVE'} the bound; disk reads: "
        f"{summ['bytes']['disk_to_host'] / MiB:.0f} MiB, device hit rate {summ['hit_rate_device']:.3f}",
        f"convert peak RSS: {conv_rss / MiB:.0f} MiB for {experts / MiB:.0f} MiB of experts in {conv_s:.1f} s "
        f"(tensor by tensor with pread, no memory map)",
    ]
    print("\n".join(lines))
    with open(a.out, "w") as f:
        f.write("# Peak memory of generate with experts larger than the host budget\n\n")
        f.write(f"Command: `python bench/memory.py` ({platform.machine()}, {os.cpu_count()} cores, "
                f"{time.strftime('%Y-%m-%d')})\n\n")
        f.write("\n".join(f"- {x}" for x in lines) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
