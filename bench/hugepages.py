"""Decode with and without a runtime setting, A/B interleaved: ``--ab hugepages`` (the default) - the weights in
transparent huge pages or not (runtime/kernels/hugepages.py, TIERED_MOE_HUGEPAGES=0 / 1); ``--ab prefetch-hint`` - the
host kernels' software prefetch into L1 (NTA, built with TIERED_MOE_KERNEL_CFLAGS=-DPFH=_MM_HINT_NTA) or into L2 (T1,
the default build).

Each run is a fresh process (every expert resident, our defaults - 8-bit activations, dense weights as stored unless
--dense-quant - a warm-up and the best of two decodes) with the "off" or the "on" environment, alternating, so a
machine that slows down or speeds up during the run shifts both sides alike. The stores are bench/vs_llama_cpp.py's
(run it first, or give --workdir where they are).

    python bench/hugepages.py --shapes mid,mla,gptoss,qnext --formats int4 --reps 3
    python bench/hugepages.py --ab prefetch-hint --shapes mid,mla,gptoss,qnext,wide128 --formats int4,bf16 --reps 3
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from dataclasses import dataclass, field  # noqa: E402

from tqdm import tqdm  # noqa: E402


NEW = 64       # tokens per sequence after its first


@dataclass(frozen=True)
class AB:
    """One A/B: what it compares, and the environment of each side."""
    title: str
    off: str                  # the side's name in the table
    on: str
    off_env: dict = field(default_factory=dict)
    on_env: dict = field(default_factory=dict)


ABS = {
    "hugepages": AB("Decode with and without transparent huge pages for the weights", "off", "on",
                    {"TIERED_MOE_HUGEPAGES": "0"}, {"TIERED_MOE_HUGEPAGES": "1"}),
    # extra flags build a library of their own here, in its own cache key; shipped builds are then not used
    "prefetch-hint": AB("Decode with the kernels' software prefetch into L1 (NTA) or into L2 (T1, the default)",
                        "NTA", "T1", {"TIERED_MOE_KERNEL_CFLAGS": "-DPFH=_MM_HINT_NTA"},
                        {"TIERED_MOE_KERNEL_CFLAGS": "-DPFH=_MM_HINT_T1"}),
}


def worker(store: str, batch: int, threads: int, dense_quant: str = "none") -> dict:
    """In a fresh process: every expert resident (bench/vs_llama_cpp.py's _resident, our defaults), a warm-up decode,
    then the best of two: tokens per second of wall time and of this process's CPU time. On one thread the CPU-time
    rate is what the decode would run at undisturbed - a busy machine takes the core away, it does not make the
    work slower (only the caches and memory it shares do)."""
    import decode_speed
    from vs_llama_cpp import _resident
    from runtime.engine import Engine, SamplingParams
    model, st = _resident(store, threads, "q8", dense_quant, batch)
    best = {"wall": 0.0, "cpu": 0.0}
    try:
        for rep in range(3):
            eng = Engine(model, st, max_batch=batch, prefill_chunk=64, prefetch="none")
            for p in decode_speed.prompts(batch, model.cfg.vocab_size, 1000 * rep + batch).tolist():
                eng.add_request(p, SamplingParams(max_tokens=NEW + 1, ignore_eos=True))
            eng.step()                                   # the prompts and every sequence's first token
            n, t0, c0 = 0, time.perf_counter(), time.process_time()
            while eng.has_work():
                n += sum(o.token is not None for o in eng.step())
            wall, cpu = n / (time.perf_counter() - t0), n / (time.process_time() - c0)
            if rep:
                best = {"wall": max(best["wall"], wall), "cpu": max(best["cpu"], cpu)}
    finally:
        st.close()
    return best


def run_one(store: str, batch: int, threads: int, env: dict, dense_quant: str) -> dict:
    env = dict(os.environ, **env, PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", store, str(batch), str(threads),
                          dense_quant], env=env, capture_output=True, text=True, timeout=900)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"worker failed on {store}: {out.stderr[-2000:]}")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        print("RESULT " + json.dumps(worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])), flush=True)
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ab", default="hugepages", choices=sorted(ABS))
    ap.add_argument("--dense-quant", default="none", choices=["none", "int8", "int4"])
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "tiered-moe-bench-vs-llama"))
    ap.add_argument("--shapes", default="mid,mla,gptoss,qnext")
    ap.add_argument("--formats", default="int4", help="store suffixes: bf16, int4, mxfp4")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--threads", default="1")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=None, help="default bench/results/<ab>.md")
    a = ap.parse_args()
    ab = ABS[a.ab]
    a.out = a.out or os.path.join(HERE, "results", a.ab.replace("-", "_") + ".md")
    cells = [(s, f, int(b), int(t)) for s in a.shapes.split(",") for f in a.formats.split(",")
             for b in a.batches.split(",") for t in a.threads.split(",")]
    for s, f, _, _ in cells:
        if not os.path.isdir(os.path.join(a.workdir, f"{s}-store-{f}")):
            raise SystemExit(f"no store {s}-store-{f} in {a.workdir}: run bench/vs_llama_cpp.py --shapes {s} first")
    load0 = os.getloadavg()[0]
    res = {c: {"off": [], "on": []} for c in cells}
    with tqdm(total=len(cells) * a.reps * 2, desc=f"{a.ab} A/B", file=sys.stderr) as bar:
        for rep in range(a.reps):
            for c in cells:
                store = os.path.join(a.workdir, f"{c[0]}-store-{c[1]}")
                for on in ((False, True) if rep % 2 == 0 else (True, False)):
                    res[c]["on" if on else "off"].append(
                        run_one(store, c[2], c[3], ab.on_env if on else ab.off_env, a.dense_quant))
                    bar.update(1)
    load1 = os.getloadavg()[0]
    cmd = "python bench/hugepages.py " + " ".join(sys.argv[1:])
    lines = [f"# {ab.title}", "",
             f"Command: `{cmd}`", "",
             f"Fresh process per run, every expert resident, our defaults (8-bit activations, dense weights as "
             f"stored, --dense-quant {a.dense_quant}), {NEW} tokens per sequence, best of two decodes per run; "
             f"{ab.off} ({ab.off_env}) / {ab.on} ({ab.on_env}) alternate (A/B interleaved), "
             f"{a.reps} reps. Rates per second of the process's CPU time (at one thread: the rate undisturbed by "
             f"other jobs taking the core) and, in brackets, of wall time. "
             f"1-minute load average at start / end: {load0:.1f} / {load1:.1f}. "
             f"Transparent huge pages: `{open('/sys/kernel/mm/transparent_hugepage/enabled').read().strip()}`.", "",
             f"| shape | store | batch | threads | {ab.off} tok/s (each rep) | {ab.on} tok/s (each rep) | "
             f"median {ab.on} / {ab.off} | wall: median {ab.on} / {ab.off} |",
             "|---|---|---|---|---|---|---|---|"]
    ratios = []
    for c, r in res.items():
        med = sorted(x["cpu"] / y["cpu"] for x, y in zip(r["on"], r["off"]))[len(r["on"]) // 2]
        wmed = sorted(x["wall"] / y["wall"] for x, y in zip(r["on"], r["off"]))[len(r["on"]) // 2]
        ratios.append(med)
        fmt = lambda rs: ", ".join(f"{x['cpu']:.0f} ({x['wall']:.0f})" for x in rs)  # noqa: E731
        lines.append(f"| {c[0]} | {c[1]} | {c[2]} | {c[3]} | {fmt(r['off'])} | {fmt(r['on'])} | {med:.2f} | "
                     f"{wmed:.2f} |")
    lines += ["", f"Median of the cells' ratios: {sorted(ratios)[len(ratios) // 2]:.2f} "
              f"(range {min(ratios):.2f}-{max(ratios):.2f})."]
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.splitext(a.out)[0] + ".json", "w") as f:
        json.dump({"command": cmd, "load": [load0, load1], "ab": a.ab, "off": ab.off, "on": ab.on,
                   "cells": [{"shape": c[0], "store": c[1], "batch": c[2], "threads": c[3], **r} for c, r in res.items()]},
                  f, indent=1)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
