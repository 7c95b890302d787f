"""Experiment 1: the regime sweep - batch 1 to 512 x device capacity 5-50% x every policy and
prefetcher, with the Belady bound, on the real DeepSeek-V2-Lite and FLAME traces and on synthetic
traces. Reports hit rate per tier, unique experts per layer per step, bytes per token, projected
tokens/s on the h200 profile, and per trace the batch size beyond which even half the experts on
the device do not keep a 90% hit rate.

Usage: python bench/exp_regimes.py [--quick] [--jobs 2] [--outdir bench/results]
"""
import functools
import sys
import time

import exp_common as ec
from cache_policy.replay import ReplayConfig, replay_batch
from cache_policy.synthetic import SyntheticSpec, generate

# (policy, prefetcher); "hybrid" in the prefetcher's place is --cpu-experts auto without prefetch.
# Prefetchers run with the cost rule (the default).
ONLINE = [("lru", "none"), ("lfu", "none"), ("freq", "none"), ("static", "none"),
          ("lru", "freq"), ("lru", "transition"), ("lru", "hybrid")]
BOUNDS = [("belady", "none"), ("lru", "oracle")]


def inputs(quick: bool):
    """(name, replayed trace, fit trace, note) - the fit trace (static's profile, transition's
    table) is never the replayed one where the data allow it."""
    ds = ec.shared_trace("deepseek-v2-lite-train.npz")
    fl = ec.shared_trace("flame-moe-290m.npz")
    n, ln = (60, 16) if quick else (520, 16)
    out = [("deepseek-v2-lite", ec.subset(ds, sequences=n, max_len=ln), ec.subset(ds, start=600, max_len=ln),
            f"DeepSeek-V2-Lite-Chat: prompts 0..{n - 1}, first {ln} tokens each, replayed; prompts 600..998 fit "
            f"static and transition"),
           ("flame-moe-290m", fl, fl, "FLAME-MoE-290M: all 32 x 64 tokens; static and transition are fitted on the "
                                     "same trace (too small to split), so theirs is an optimistic figure")]
    seqs, sl = (64, 12) if quick else (520, 16)
    specs = [("synthetic-local", dict(zipf_s=1.2, persistence=0.7, cross_layer=0.5)),
             ("synthetic-uniform", dict())]
    if quick:
        specs = specs[:1]
    for name, kw in specs:
        tr = generate(SyntheticSpec.with_geometry("small", num_sequences=seqs, seq_len=sl, seed=1, **kw))
        fit = generate(SyntheticSpec.with_geometry("small", num_sequences=seqs, seq_len=sl, seed=2, **kw))
        out.append((name, tr, fit, f"synthetic, geometry 'small' (8 layers x 64 experts, top-6), {seqs} sequences x "
                                   f"{sl} tokens, {kw or 'uniform routing'}, seed 1 (fit: seed 2)"))
    return out


_INPUTS = None


def _job(j):
    name, policy, prefetch, cap, batch = j
    tr, fit = _INPUTS[name]
    hybrid = prefetch == "hybrid"
    cfg = ReplayConfig(policy=policy, prefetch="none" if hybrid else prefetch, device_capacity=str(cap), fit_trace=fit,
                       profile="h200", cpu_experts="auto" if hybrid else "0")
    r = replay_batch(tr, cfg, batch)
    return {"trace": name, "policy": policy, "prefetch": prefetch, "capacity": cap, "batch": batch,
            "effective_batch": r["mean_batch"], "hit_device": r["hit_rate"]["device"], "hit_host": r["hit_rate"]["host"],
            "unique_per_layer_step": r["unique_experts_per_layer_step"],
            "h2d_bytes_per_token": r["bytes_per_token"]["host_to_device"],
            "projected_tokens_per_s": r["projected_tokens_per_s"],
            "all_resident_tokens_per_s": r["projected"]["tokens_per_s_all_resident"],
            "expert_bytes": r["expert_bytes"]}


def label(p, f):
    return p if f == "none" else f"{p}+{f}"


def main(argv=None):
    ap = ec.parser(jobs=True)
    a = ap.parse_args(argv)
    started = time.time()
    caps = [0.1, 0.5] if a.quick else [0.05, 0.10, 0.25, 0.50]
    batches = [1, 16] if a.quick else [1, 4, 16, 64, 256, 512]
    configs = ([("lru", "none")] + [("belady", "none")]) if a.quick else ONLINE + BOUNDS
    ins = inputs(a.quick)
    rows = sweep(ins, configs, caps, batches, a.jobs)
    rep = ec.Report("exp_regimes", a.outdir, "python bench/exp_regimes.py" + (" --quick" if a.quick else ""),
                    "Experiment 1: regime sweep - batch size x device capacity x policy", started)
    rep.data.update({"rows": rows, "inputs": {n: note for n, _, _, note in ins}, "profile": "h200", "caps": caps,
                     "batches": batches})
    report_inputs(rep, ins)
    # Hit rate comparisons leave hybrid out: it computes misses on the host rather than hitting more.
    online = [label(p, f) for p, f in configs if (p, f) not in BOUNDS and f != "hybrid"]
    get = functools.partial(lookup, rows)
    report_stops(rep, ins, get, online, caps, batches)
    for n, *_ in ins:
        report_trace(rep, n, get, configs, caps, batches)
    fig = plot(ins, get, online, configs, caps, batches)
    return rep.finish(fig, "hit rate and unique experts vs batch")


def sweep(ins, configs, caps, batches, n_jobs: int) -> list:
    """Every (trace, config, capacity, batch) replayed, in ``n_jobs`` processes: rows in that order."""
    global _INPUTS
    _INPUTS = {n: (tr, fit) for n, tr, fit, _ in ins}
    jobs = [(n, p, f, c, b) for n, *_ in ins for p, f in configs for c in caps for b in batches]
    # Largest jobs (batch 1) first keeps both workers busy to the end.
    order = sorted(range(len(jobs)), key=lambda i: jobs[i][4])
    res = ec.pmap(_job, [jobs[i] for i in order], n_jobs, desc="regime sweep")
    rows = [None] * len(jobs)
    for i, r in zip(order, res):
        rows[i] = r
    return rows


def lookup(rows, tr, cfg, cap, b, key="hit_device"):
    """``key`` of the row of trace ``tr``, config label ``cfg``, capacity ``cap`` and batch ``b`` (None if none)."""
    for r in rows:
        if r["trace"] == tr and label(r["policy"], r["prefetch"]) == cfg and r["capacity"] == cap and r["batch"] == b:
            return r[key]
    return None


def report_inputs(rep, ins) -> None:
    rep.add("Inputs:", "")
    for n, tr, _, note in ins:
        rep.add(f"- **{n}**: {note}; {tr.num_tokens:,} tokens, {tr.num_sequences} sequences, {tr.num_layers} layers x "
                f"{tr.num_experts} experts, top-{tr.top_k}.")
    rep.add("", "Replay: continuous batching (a sequence joins when one finishes), global device pool of the given "
            "fraction of all experts, host tier holds every expert, projected tokens/s on the `h200` profile "
            "(cache_policy/profiles/h200.json, figures from ../shared/hardware/h200-anchors.json) with each trace's "
            "own expert size in bf16. `belady` (MIN) and `lru+oracle` (perfect next-layer prefetch) are bounds, not "
            "policies; Belady is the bound of demand-only policies, so a policy with prefetch can exceed it. Effective batch: a trace with fewer sequences than the batch size runs all of them at once.", "")


def report_stops(rep, ins, get, online, caps, batches) -> None:
    """Where tiering stops paying: per trace, the smallest batch at which half the experts on the device no longer
    keep a 90% hit rate."""
    rep.add("## Where tiering stops paying", "",
            "Device hit rate with half the experts on the device (best online policy, and the Belady bound); "
            "**b\\*** = the smallest batch at which no online policy keeps 90% with 50% of the experts on the "
            "device - beyond it the device tier must hold more than half the experts.", "")
    head = ["trace"] + [f"b={b}" for b in batches] + ["Belady at b=1 / max b", "b*"]
    stop_rows, stops = [], {}
    half = max(caps)
    for n, *_ in ins:
        best = [max(get(n, c, half, b) for c in online) for b in batches]
        bstar = next((b for b, h in zip(batches, best) if h < 0.9), None)
        stops[n] = bstar
        bel = [get(n, "belady", half, b) for b in (batches[0], batches[-1])]
        stop_rows.append([n] + [f"{h:.3f}" for h in best] +
                         [" / ".join(f"{x:.3f}" for x in bel if x is not None) or "-",
                          f"{bstar}" if bstar is not None else f"> {batches[-1]}"])
    rep.table(head, stop_rows)
    rep.data["tiering_stops_paying_batch"] = stops


def report_trace(rep, n, get, configs, caps, batches) -> None:
    """One trace's tables: hit rate / projected tokens/s per capacity, and LRU's bytes and unique experts."""
    rep.add(f"## {n}", "")
    for cap in caps:
        rep.add(f"Device hit rate / projected tokens/s (h200), device tier = {cap:.0%} of experts:", "")
        rep.table(["policy"] + [f"b={b}" for b in batches],
                  [[label(p, f)] + [f"{get(n, label(p, f), cap, b):.3f} / "
                                    f"{get(n, label(p, f), cap, b, 'projected_tokens_per_s'):.1f}" for b in batches]
                   for p, f in configs])
    c0 = caps[len(caps) // 2]
    rep.add(f"LRU at {c0:.0%}: unique experts per layer per step, host->device bytes per token, projected "
            f"tokens/s (h200) vs all experts resident:", "")
    rep.table(["batch", "effective batch", "unique experts/layer/step", "h2d bytes/token", "projected tok/s",
               "all resident tok/s", "ratio"],
              [[b, get(n, "lru", c0, b, "effective_batch"), get(n, "lru", c0, b, "unique_per_layer_step"),
                f"{get(n, 'lru', c0, b, 'h2d_bytes_per_token'):,.0f}", get(n, "lru", c0, b, "projected_tokens_per_s"),
                get(n, "lru", c0, b, "all_resident_tokens_per_s"),
                get(n, "lru", c0, b, "projected_tokens_per_s") / get(n, "lru", c0, b, "all_resident_tokens_per_s")]
               for b in batches])


def plot(ins, get, online, configs, caps, batches):
    """Hit rate (best online policy per capacity, and Belady) and unique experts per layer per step vs batch."""
    plt = ec.pyplot()
    fig, axes = plt.subplots(2, len(ins), figsize=(4.2 * len(ins), 7.5), squeeze=False)
    for j, (n, tr, *_ ) in enumerate(ins):
        ax = axes[0][j]
        for k, cap in enumerate(caps):
            col = plt.cm.viridis(k / max(1, len(caps) - 1))
            ax.plot(batches, [max(get(n, c, cap, b) for c in online) for b in batches], "-o", color=col, ms=3,
                    label=f"best online, {cap:.0%}")
            if ("belady", "none") in configs:
                ax.plot(batches, [get(n, "belady", cap, b) for b in batches], "--", color=col, lw=1)
        ax.axhline(0.9, color="red", lw=0.8, ls=":")
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, 1.02)
        ax.set_title(f"{n}\n(dashed: Belady bound)", fontsize=9)
        ax.set_xlabel("batch")
        ax.set_ylabel("device hit rate")
        if j == 0:
            ax.legend(fontsize=7)
        ax = axes[1][j]
        ax.plot(batches, [get(n, "lru", caps[0], b, "unique_per_layer_step") for b in batches], "-o", ms=3)
        ax.axhline(tr.num_experts, color="gray", ls=":", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch")
        ax.set_ylabel(f"unique experts per layer per step (of {tr.num_experts})")
    fig.suptitle("Regime sweep: hit rate vs batch size (red: 90%)", fontsize=10)
    return fig


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
