"""One memory on a CPU-only machine (issue 29): `generate --host-budget X` alone, against the same model with every
expert in memory, side by side in one run.

Builds a synthetic Mixtral-format checkpoint (hidden 1024, 8 layers, 64 experts, top-4), converts it to int4
experts, then runs `tiered-moe generate` in fresh children, interleaved over ``--rounds``: with no budget (every
expert in memory: the default), and with ``--host-budget`` at 100%, 50%, 25% and 12.5% of the expert bytes (every expert
computed from host memory, the rest read from disk with O_DIRECT when needed), against ``--device-budget auto`` (a
device stand-in tier in the same RAM, the CPU default before issue 29). Reports decode tok/s (best of the
rounds), its ratio to the unbudgeted run, the share of expert uses served from disk, MB read per generated token
and each child's peak RSS (ru_maxrss).

Usage: python bench/one_memory.py [--workdir DIR] [--rounds 2] [--out bench/results/one_memory.md]
"""
import argparse
import json
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from memory import peak_rss  # noqa: E402
from exp_common import write_markdown  # noqa: E402

MiB = 2 ** 20


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "tiered-moe-bench-one-memory"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "one_memory.md"))
    a = ap.parse_args()
    sys.path.insert(0, ROOT)
    from runtime.model.synthetic import SyntheticModelSpec, build_checkpoint
    from runtime.store import Manifest
    spec = SyntheticModelSpec(hidden_size=1024, intermediate_size=512, num_layers=8, num_experts=64, top_k=4,
                              vocab_size=512, num_heads=8, num_kv_heads=2)
    hf, store = os.path.join(a.workdir, "hf"), os.path.join(a.workdir, "store")
    py = sys.executable
    if not os.path.exists(os.path.join(hf, "config.json")):
        build_checkpoint(hf, spec)
    if not os.path.exists(os.path.join(store, "manifest.json")):
        shutil.rmtree(store, ignore_errors=True)
        peak_rss([py, "-m", "runtime.cli", "convert", "--model", hf, "--out", store, "--quantize", "int4"])
    m = Manifest.read(store)
    experts = m.num_layers * m.num_experts * m.blob_stride
    runs = {"--device-budget auto: every expert in memory, a device stand-in copy (the CPU default before)":
            ["--device-budget", "auto"], "default (no flag): one memory, --host-budget auto (every expert fits)": []}
    for share in (1.0, 0.5, 0.25, 0.125):
        runs[f"--host-budget {share:.0%} of the experts ({int(share * experts) // MiB} MiB)"] = ["--host-budget",
                                                                                              str(int(share * experts))]
    base = [py, "-m", "runtime.cli", "generate", "--model", store, "--max-tokens", str(a.max_tokens), "--json",
            "--prompt-ids", ",".join(str((61 * i) % 512) for i in range(1, 17))]   # tokens of every topic
    res = {k: [] for k in runs}
    for _ in range(a.rounds):                      # interleaved: a slow moment of the machine hits every row
        for name, extra in runs.items():
            rss, _, out = peak_rss(base + extra)
            summ = json.loads(out.strip().splitlines()[-1])
            res[name].append((summ, rss))
    rows, ref = [], None
    for name, got in res.items():
        summ, rss = max(got, key=lambda r: r[0]["decode_tokens_per_s"])
        tps = summ["decode_tokens_per_s"]
        ref = ref or tps
        need = sum(summ["hits"].values()) or 1
        rows.append(f"| {name} | {tps:.1f} | {tps / ref:.2f}x | {summ['hits']['disk'] / need:.3f} | "
                    f"{summ['bytes']['disk_to_host'] / max(1, summ['generated_tokens']) / 1e6:.2f} | "
                    f"{max(r for _, r in got) / MiB:.0f} |")
    cmd = "python bench/one_memory.py " + " ".join(sys.argv[1:])
    write_markdown(a.out, [
        "# One memory on a CPU-only machine: `--host-budget` alone",
        "",
        f"Command: `{cmd}` (this machine: {os.cpu_count()} cores). Model: synthetic Mixtral-format, hidden 1024, "
        f"8 layers x 64 experts, top-4, int4 experts ({m.blob_stride / MiB:.2f} MiB each, {experts / MiB:.0f} MiB in "
        f"all). One prompt of 16 tokens spread over the synthetic model's topics, {a.max_tokens} generated, batch 1, best of {a.rounds} interleaved rounds.",
        "",
        "| run | decode tok/s | vs the first row | expert uses from disk | MB read / token | peak RSS MiB |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
        "With only `--host-budget` (and with no flag, on a machine without a GPU), every expert computes from its",
        "host-memory slot and none is copied into a second (device stand-in) slab; `--device-budget` keeps that",
        "stand-in tier, which holds the experts twice.",
    ])


if __name__ == "__main__":
    main()
