"""Runs every experiment of issue 5 in one command and writes bench/results/experiments.md, an
index with each report's headline.

Usage: python bench/run_experiments.py [--quick] [--jobs 2] [--outdir bench/results] [--only NAME,...]
"""
import argparse
import importlib
import json
import os
import sys
import time

import exp_common as ec

EXPERIMENTS = [
    ("exp_regimes", "1. Regime sweep: batch x capacity x policy on real and synthetic traces"),
    ("exp_k3", "2. Kimi K3 on one H200, by simulation"),
    ("exp_locality", "3. How much locality makes tiering work at high batch (phase diagram)"),
    ("exp_cache_routing", "4. Cache-aware routing: hit rate vs output change"),
    ("exp_batching", "5. Expert-aware batching vs first-come batching"),
    ("exp_prediction", "6. Prediction quality of the prefetchers (held-out prompts)"),
    ("exp_speculation", "7. Speculative decoding priced in expert bytes: draft length by cost (projection)"),
]


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--outdir", default=ec.RESULTS)
    ap.add_argument("--workdir", default=None, help="where the live experiments build the demo model")
    ap.add_argument("--only", default=None, help="comma-separated experiment names")
    a = ap.parse_args(argv)
    chosen = [e for e in EXPERIMENTS if a.only is None or e[0] in a.only.split(",")]
    t0 = time.time()
    times = {}
    for name, title in chosen:
        mod = importlib.import_module(name)
        args = ["--outdir", a.outdir] + (["--quick"] if a.quick else [])
        if name in ("exp_regimes", "exp_k3", "exp_locality", "exp_speculation"):
            args += ["--jobs", str(a.jobs)]
        if name in ("exp_cache_routing", "exp_batching", "exp_prediction") and a.workdir:
            args += ["--workdir", a.workdir]
        print(f"== {title}", file=sys.stderr, flush=True)
        s = time.time()
        mod.main(args)
        times[name] = time.time() - s
    total = time.time() - t0
    lines = ["# Experiments (issue 5)", "", f"Command: `python bench/run_experiments.py{' --quick' if a.quick else ''}`",
             "", f"Machine: {ec.machine()}. Total: {total / 60:.1f} min.", ""]
    for name, title in chosen:
        lines += [f"- [{title}]({name}.md) ({times[name]:.0f} s) - plot: [{name}.png]({name}.png)"]
    lines.append("")
    with open(os.path.join(a.outdir, "experiments.md"), "w") as f:
        f.write("\n".join(lines))
    with open(os.path.join(a.outdir, "experiments.json"), "w") as f:
        json.dump({"seconds": times, "total_seconds": total, "quick": a.quick}, f, indent=1)
    print(f"all experiments: {total / 60:.1f} min", file=sys.stderr)
    return times


if __name__ == "__main__":
    main()
