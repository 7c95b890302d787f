"""Decode on a machine another busy process shares (issue 30): 1 thread against 2, with the free-core cap
(runtime/kernels/cores.py, the default) and without it (``TIERED_MOE_ADAPT_THREADS=0``), quiet and with one
competing busy process (a Python loop, as a neighbour's job would be), at batch 1 and 8.

Each run is a fresh ``tiered-moe generate --json`` child at default settings but ``--threads``, on a store of the
model bench/bigger_than_memory.py writes (``--store``; it must be converted already), interleaved over
``--rounds``; the busy process starts before the child and is killed after it. Reports decode tok/s (best
round, each round) and the ratio of 2 threads to 1 thread in the same condition.

Usage: python bench/shared_cores.py --store DIR [--rounds 2] [--max-tokens 32] [--out bench/results/shared_cores.md]
"""
import argparse
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

from exp_common import generate_rate, write_markdown  # noqa: E402 (bench/: results files)

# (label, --threads, free-core cap on)
SETTINGS = [("1 thread", 1, True), ("2 threads (default: capped at the free cores)", 2, True),
            ("2 threads, no cap (TIERED_MOE_ADAPT_THREADS=0)", 2, False)]


def decode_rate(store: str, threads: int, adapt: bool, batch: int, max_tokens: int, busy: bool) -> float:
    env = {**os.environ, "TIERED_MOE_ADAPT_THREADS": "1" if adapt else "0"}
    cmd = [sys.executable, "-m", "runtime.cli", "generate", "--model", store, "--threads", str(threads),
           "--max-tokens", str(max_tokens), "--json"]
    for b in range(batch):
        cmd += ["--prompt-ids", ",".join(str((61 * i + 7 * b) % 512) for i in range(1, 17))]
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    return generate_rate(p, store)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", required=True)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "shared_cores.md"))
    a = ap.parse_args()
    cases = [(batch, busy, s) for batch in (1, 8) for busy in (False, True) for s in SETTINGS]
    got = {c: [] for c in cases}
    for r in range(a.rounds):
        for c in cases:
            batch, busy, (label, threads, adapt) = c
            got[c].append(decode_rate(a.store, threads, adapt, batch, a.max_tokens, busy))
            print(f"round {r + 1}: batch {batch}, {'busy' if busy else 'quiet'}, {label}: {got[c][-1]:.1f} tok/s",
                  flush=True)
    rows = []
    for batch in (1, 8):
        for busy in (False, True):
            one = max(got[(batch, busy, SETTINGS[0])])
            for s in SETTINGS:
                v = got[(batch, busy, s)]
                rows.append(f"| {batch} | {'one busy process' if busy else 'quiet'} | {s[0]} | {max(v):.1f} "
                            f"({'/'.join(f'{x:.1f}' for x in v)}) | {max(v) / one:.2f}x |")
    write_markdown(a.out, [
        "# Decode on a shared machine: 1 thread against 2",
        "",
        f"Command: `python bench/shared_cores.py {' '.join(sys.argv[1:])}` ({os.cpu_count()} cores). Store: "
        f"`{a.store}` at default settings but `--threads`; 16-token prompts, {a.max_tokens} tokens generated, best "
        f"of {a.rounds} interleaved rounds. Busy: one `python -c 'while True: pass'` beside the run.",
        "",
        "| batch | machine | threads | decode tok/s best (each round) | vs 1 thread, same machine |",
        "|---|---|---|---|---|",
        *rows,
    ])


if __name__ == "__main__":
    main()
