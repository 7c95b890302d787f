"""Eviction by predicted reuse (`reuse`) against lru / lfu / freq and the Belady bound, evaluated honestly.

(a) Fit on the first 80% of the prompts (DeepSeek: prompts 0-799), replay the rest: device hit
    rate, projected tokens/s (h200 profile, replay's `projected_tokens_per_s`) and host-to-device
    bytes per token, at 10% / 20% device capacity, scopes layer and global, batch 1 / 8 / 64.
    `reuse` is fitted on the training prompts (at the replayed batch); `reuse-online` starts
    empty and learns from what it serves, as on a live store. Gap closed = (policy - lru) /
    (belady - lru), for hit rate and tokens/s; "-" where lru == belady (nothing to close).
(b) Scan resistance of the candidate default (`reuse-online`) in a global pool at batch 8 / 64,
    10 / 20 / 50% capacity, on the same held-out prompts: it must reach max(lfu, freq) and
    0.7 x belady.

One process, a tqdm bar. Usage: python bench/eviction.py [--traces a.npz,b.npz] [--out bench/results/eviction]
"""
import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
SHARED = os.path.join(os.path.dirname(ROOT), "shared", "traces")
DEFAULT = ",".join(os.path.join(SHARED, f) for f in ("deepseek-v2-lite-train.npz", "flame-moe-290m.npz"))

POLICIES = ("lru", "lfu", "freq", "reuse", "reuse-online", "belady")
A_CAPS, A_SCOPES, BATCHES = ("0.1", "0.2"), ("layer", "global"), (1, 8, 64)
B_CAPS, B_BATCHES = ("0.1", "0.2", "0.5"), (8, 64)


def split(tr):
    """Training prompts and held-out prompts: DeepSeek 0-799 / 800-; otherwise the first 80%."""
    n = 800 if tr.num_sequences > 800 else max(1, int(round(0.8 * tr.num_sequences)))
    return tr.subset(range(n)), tr.subset(range(n, tr.num_sequences)), n


def run_one(test, fit, policy, scope, cap, batch):
    from cache_policy.replay import ReplayConfig, replay_batch
    name = "reuse" if policy == "reuse-online" else policy
    cfg = ReplayConfig(policy=name, scope=scope, device_capacity=cap, fit_trace=fit if policy == "reuse" else None)
    r = replay_batch(test, cfg, batch)
    return {"policy": policy, "scope": scope, "device_capacity": cap, "batch": batch,
            "hit_rate": r["hit_rate"]["device"], "tokens_per_s": r["projected_tokens_per_s"],
            "h2d_bytes_per_token": r["bytes_per_token"]["host_to_device"], "wall_seconds": r["wall_seconds"],
            "accesses": r["accesses"], "device_slots": r["device_slots"], "mean_batch": r["mean_batch"]}


def gap(x, lo, hi):
    return None if hi - lo <= 1e-9 * max(1.0, abs(hi)) else (x - lo) / (hi - lo)


def fmt_gap(g):
    return "-" if g is None else f"{g:+.0%}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--traces", default=DEFAULT)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "eviction"))
    ap.add_argument("--from-json", type=float, default=None, metavar="MINUTES",
                    help="rewrite the .md and .png from the .json of a run that took MINUTES (no replays)")
    a = ap.parse_args()
    if a.from_json is not None:
        with open(a.out + ".json") as f:
            rows = json.load(f)
        write_md(a.out + ".md", rows, a.from_json * 60)
        plot(a.out + ".png", rows)
        return
    from tqdm import tqdm
    from cache_policy.traces import load_trace
    jobs = []
    for path in a.traces.split(","):
        for s in A_SCOPES:
            for c in A_CAPS:
                for b in BATCHES:   # reuse-online (the default candidate) only where (b) asks: global
                    jobs += [(path, p, s, c, b) for p in POLICIES if p != "reuse-online" or s == "global"]
        for c in B_CAPS:
            if c in A_CAPS:
                continue   # global 8 / 64 at 10% and 20% are already in (a)
            for b in B_BATCHES:
                jobs += [(path, p, "global", c, b) for p in POLICIES if p != "reuse"]
    t0 = time.time()
    rows, loaded = [], {}
    for path, p, s, c, b in tqdm(jobs, desc="replays"):
        if path not in loaded:
            loaded[path] = split(load_trace(path))
        fit, test, n_fit = loaded[path]
        r = run_one(test, fit, p, s, c, b)
        r.update(trace=os.path.basename(path), fit_prompts=n_fit, test_prompts=test.num_sequences)
        rows.append(r)
        with open(a.out + ".json", "w") as f:   # as it goes: a stopped run keeps what it measured
            json.dump(rows, f, indent=0)
    wall = time.time() - t0
    with open(a.out + ".json", "w") as f:
        json.dump(rows, f, indent=0)
    write_md(a.out + ".md", rows, wall)
    plot(a.out + ".png", rows)
    print(f"wrote {a.out}.md, .json, .png in {wall / 60:.1f} min")


def index(rows):
    return {(r["trace"], r["policy"], r["scope"], r["device_capacity"], r["batch"]): r for r in rows}


def write_md(path, rows, wall):
    ix = index(rows)
    traces = sorted({r["trace"] for r in rows})
    out = ["# Eviction by predicted reuse\n\n",
           f"Command: `python bench/eviction.py` ({wall / 60:.1f} min, one process on a shared 2-core machine, "
           f"{time.strftime('%Y-%m-%d')}). Raw rows: `eviction.json`; plot: `eviction.png`.\n\n",
           "Held-out evaluation: each trace is split by prompt; `reuse` is fitted on the training prompts "
           "(at the replayed batch) and every policy replays only the held-out prompts. `reuse-online` starts "
           "empty and learns while it serves (what a live store runs). Device hit rate = device hits / needed "
           "(step, layer, expert); tok/s = projected tokens/s (h200 profile, overlapped); B/tok = host-to-device "
           "bytes per token (GB). Gap = (policy - lru) / (belady - lru); `-` where lru equals belady (nothing to "
           "close: e.g. layer scope 10% at batch 1, where capacity = top-k). The held-out FLAME part has 6 prompts, "
           "so its batch 8 and 64 both run 6 sequences.\n\n"]
    for tr in traces:
        any_r = next(r for r in rows if r["trace"] == tr)
        out.append(f"## {tr}: fit on {any_r['fit_prompts']} prompts, replay {any_r['test_prompts']}\n\n")
        out.append("### (a) hit rate / tok/s / B/tok, and gap closed by reuse\n\n")
        head = ["scope", "cap", "batch"] + [p for p in POLICIES] + ["gap hit (reuse / online)", "gap tok/s (reuse / online)"]
        out.append("| " + " | ".join(head) + " |\n|" + "---|" * len(head) + "\n")
        for s in A_SCOPES:
            for c in A_CAPS:
                for b in BATCHES:
                    sel = {p: ix.get((tr, p, s, c, b)) for p in POLICIES}
                    if any(sel[p] is None for p in ("lru", "reuse", "belady")):
                        continue
                    cells = [s, f"{float(c):.0%}", str(b)]
                    for p in POLICIES:
                        r = sel[p]
                        cells.append("-" if r is None else
                                     f"{r['hit_rate']:.3f} / {r['tokens_per_s']:.1f} / {r['h2d_bytes_per_token'] / 1e9:.2f}")
                    lo, hi = sel["lru"], sel["belady"]
                    pols = [p for p in ("reuse", "reuse-online") if sel[p] is not None]
                    gh = [gap(sel[p]["hit_rate"], lo["hit_rate"], hi["hit_rate"]) for p in pols]
                    gt = [gap(sel[p]["tokens_per_s"], lo["tokens_per_s"], hi["tokens_per_s"]) for p in pols]
                    cells += [" / ".join(map(fmt_gap, gh)), " / ".join(map(fmt_gap, gt))]
                    out.append("| " + " | ".join(cells) + " |\n")
        out.append("\n### (b) scan resistance, global scope: reuse-online vs max(lfu, freq) and 0.7 x belady\n\n")
        head = ["cap", "batch", "lru", "lfu", "freq", "reuse-online", "belady", "0.7 x belady", "meets"]
        out.append("| " + " | ".join(head) + " |\n|" + "---|" * len(head) + "\n")
        for c in B_CAPS:
            for b in B_BATCHES:
                sel = {p: ix.get((tr, p, "global", c, b)) for p in ("lru", "lfu", "freq", "reuse-online", "belady")}
                if any(v is None for v in sel.values()):
                    continue
                h = {p: r["hit_rate"] for p, r in sel.items()}
                bar = max(h["lfu"], h["freq"], 0.7 * h["belady"])
                ok = h["reuse-online"] >= bar - 1e-12
                out.append("| " + " | ".join([f"{float(c):.0%}", str(b)] + [f"{h[p]:.3f}" for p in sel]
                                             + [f"{0.7 * h['belady']:.3f}", "yes" if ok else "no"]) + " |\n")
        out.append("\n")
    with open(path, "w") as f:
        f.write("".join(out))


def plot(path, rows):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    ix = index(rows)
    traces = sorted({r["trace"] for r in rows})
    fig, axes = plt.subplots(len(traces), 2, figsize=(12, 4 * len(traces)), squeeze=False)
    for i, tr in enumerate(traces):
        for j, s in enumerate(A_SCOPES):
            ax = axes[i][j]
            labels = [f"{float(c):.0%} b{b}" for c in A_CAPS for b in BATCHES]
            x = range(len(labels))
            for p in POLICIES:
                ys = [ix[(tr, p, s, c, b)]["hit_rate"] if (tr, p, s, c, b) in ix else float("nan")
                      for c in A_CAPS for b in BATCHES]
                ax.plot(list(x), ys, marker="o", label=p)
            ax.set_xticks(list(x))
            ax.set_xticklabels(labels, fontsize=8)
            ax.set_title(f"{tr} - {s} scope (held-out prompts)")
            ax.set_ylabel("device hit rate")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
