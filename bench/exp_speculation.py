"""Experiment: speculative decoding priced in expert bytes. Projected tokens/s with and without speculation for a
DeepSeek-V3-shaped and a Kimi-K3-shaped model on the h200 profile, a 10% device tier (the host holds every expert),
bf16 vs MXFP4 experts, batch 1 / 8 / 64, drafts accepted at 85% (DeepSeek-V3's report: 85-90% for its MTP layer);
which k the cost rule picks and where it turns speculation off (cache_policy/speculation.py, spec_replay.py).

Usage: python bench/exp_speculation.py [--quick] [--jobs 1] [--outdir bench/results]
"""
import json
import sys
import time

import exp_common as ec
from cache_policy import cost_model as cm
from cache_policy.replay import ReplayConfig
from cache_policy.spec_replay import SpecConfig, project
from cache_policy.speculation import Acceptance, DraftCost
from cache_policy.synthetic import SyntheticSpec, generate
from cache_policy.traces import trace_stats

ACCEPT = 0.85
DEVICE = "0.1"
POLICY = "lru"
# (label, k_max, rule, rejected-draft routing): the runs every regime gets. "next" prices a rejected draft with the
# trace token's routing (the next step finds its experts loaded: optimistic), "other" with an unrelated token's
# (pessimistic); the truth lies between, so both are shown.
VARIANTS = [("none", 0, "fixed", "next"), ("fixed k=1", 1, "fixed", "next"), ("fixed k=3", 3, "fixed", "next"),
            ("cost k<=4", 4, "cost", "next"), ("fixed k=3 other", 3, "fixed", "other"),
            ("cost k<=4 other", 4, "cost", "other")]
SWEEP = [0.3, 0.5, 0.7, 0.85, 0.95]
_CTX: dict = {}


def locality() -> dict:
    """Synthetic locality set from the real DeepSeek-V2-Lite trace (the only real DeepSeek-family routing we have):
    its persistence (share of a token's experts the next token reuses) and a mild popularity skew."""
    st = trace_stats(ec.subset(ec.shared_trace("deepseek-v2-lite-train.npz"), sequences=200))
    return {"zipf_s": 0.5, "persistence": round(max(0.0, min(1.0, st["persistence"])), 2), "cross_layer": 0.2,
            "real_persistence": st["persistence"], "real_top10pct_share": st["top10pct_share_mean"]}


def trace_for(model: str, batch: int, quick: bool):
    if model == "deepseek-v2-lite (real)":
        n = max(2 * batch, 16)
        return ec.subset(ec.shared_trace("deepseek-v2-lite-train.npz"), sequences=n, max_len=(32 if quick else 64))
    loc = {k: v for k, v in _CTX["locality"].items() if not k.startswith("real_")}
    seqs = max(2 * batch, 8)
    seq_len = max(32 if quick else 64, (512 if quick else 2048) // seqs)
    return generate(SyntheticSpec.with_geometry(model, num_sequences=seqs, seq_len=seq_len, seed=11, **loc))


def _job(j):
    model, dtype, batch, accept, variants, quick = j
    tr = trace_for(model, batch, quick)
    geo = "deepseek-v3" if model.startswith("deepseek") else model
    cfg = ReplayConfig(policy=POLICY, device_capacity=DEVICE, profile="h200", geometry=geo, dtype=dtype)
    out = []
    for label, k_max, rule, rejected in variants:
        spec = SpecConfig(acceptance=Acceptance((accept,)), k_max=k_max, rule=rule, draft=DraftCost("mtp", 1.0),
                          rejected=rejected)
        r, ps = project(tr, cfg, batch, spec)
        out.append({"model": model, "dtype": dtype, "batch": batch, "acceptance": accept, "variant": label,
                    "trace": tr.source, "tokens": tr.num_tokens, "expert_bytes": ps.size["bytes"],
                    "device_slots": ps.dev_slots, **r})
    return out


def _rows(rows, **match):
    return [r for r in rows if all(r[k] == v for k, v in match.items())]


def _regime_table(rep, rows, models, dtypes, batches):
    table = []
    for m in models:
        for dt in dtypes:
            for b in batches:
                got = {r["variant"]: r for r in _rows(rows, model=m, dtype=dt, batch=b, acceptance=ACCEPT)}
                if not got:
                    continue
                base, cost, co = got["none"], got["cost k<=4"], got["cost k<=4 other"]
                table.append([m, dt, b, f"{got['none']['expert_bytes'] / 1e6:.1f}", base["tokens_per_s"],
                              got["fixed k=1"]["tokens_per_s"], got["fixed k=3"]["tokens_per_s"], cost["tokens_per_s"],
                              cost["tokens_per_s"] / base["tokens_per_s"], cost["mean_k"],
                              " ".join(str(x) for x in cost["k_histogram"]), cost["steps_without_speculation"],
                              got["fixed k=3 other"]["tokens_per_s"], co["tokens_per_s"],
                              co["tokens_per_s"] / base["tokens_per_s"], co["mean_k"],
                              base["experts_per_layer_per_step"], cost["experts_per_layer_per_step"],
                              cost["rule_price_error"]])
    rep.table(["model", "experts", "batch", "MB/expert", "tok/s none", "k=1", "k=3", "cost rule",
               "rule / none", "mean k", "k histogram (0..4)", "steps at k=0", "k=3 (other)", "cost rule (other)",
               "rule / none (other)", "mean k (other)", "experts/layer/step none", "experts/layer/step rule",
               "rule price error"], table)
    return table


def _batch1_note(rep, table, models):
    """The batch-1 verdict: the rule against no speculation, V3 / K3 shapes apart from the real-routing rows."""
    for col, fix, what in ((8, 6, "rejected drafts routed as the trace's token"),
                           (14, 12, "rejected drafts routed as an unrelated token")):
        for group, names in (("DeepSeek-V3 and K3 shapes", models[:2]), ("real DeepSeek-V2-Lite routing", models[2:])):
            b1 = [t for t in table if t[2] == 1 and t[0] in names]
            if not b1:
                continue
            ratios = [t[col] for t in b1]
            rep.data.setdefault("batch1_rule_over_none", {})[f"{group}, {what}"] = {f"{t[0]}/{t[1]}": t[col] for t in b1}
            rep.add(f"**Batch 1, 10% device tier, {group}, {what}**: cost rule / no speculation = "
                    f"{min(ratios):.4f}x - {max(ratios):.4f}x over {len(b1)} rows "
                    f"({'never below 1' if min(ratios) >= 1 else 'below 1: ' + ', '.join(f'{t[0]} {t[1]} {t[col]:.4f}x' for t in b1 if t[col] < 1)}); "
                    f"fixed k=3 / no speculation: {min(t[fix] / t[4] for t in b1):.3f}x - "
                    f"{max(t[fix] / t[4] for t in b1):.3f}x.", "")


def main(argv=None):
    ap = ec.parser(jobs=True)
    a = ap.parse_args(argv)
    started = time.time()
    _CTX["locality"] = locality()
    batches = [1, 8] if a.quick else [1, 8, 64]
    models = ["deepseek-v3", "kimi-k3", "deepseek-v2-lite (real)"]
    dtypes = ["bf16"] if a.quick else ["bf16", "mxfp4"]
    sweep = [0.5] if a.quick else [acc for acc in SWEEP if acc != ACCEPT]
    jobs = [(m, dt, b, ACCEPT, VARIANTS, a.quick) for m in models for dt in dtypes for b in batches]
    jobs += [(m, "bf16", 1, acc, VARIANTS, a.quick) for m in models[:2] for acc in sweep]
    rows = [r for out in ec.pmap(_job, sorted(jobs, key=lambda j: -j[2]), a.jobs, desc="speculation") for r in out]
    rep = ec.Report("exp_speculation", a.outdir, "python bench/exp_speculation.py" + (" --quick" if a.quick else "")
                    + f" --jobs {a.jobs}", "Speculative decoding priced in expert bytes (projection)", started)
    loc = _CTX["locality"]
    rep.data.update({"locality": loc, "rows": rows, "acceptance": ACCEPT, "device_capacity": DEVICE, "policy": POLICY})
    rep.add("Every number is a projection of this project's cost model (cache_policy/cost_model.py, h200 profile: "
            "measured host->device copies and expert compute; attention not priced, so tokens/s are upper bounds) "
            "over a replay through the tiers (cache_policy/placement.py). A verify step with k drafts routes the next "
            "k+1 tokens of each request in the trace. A rejected draft's routing is unknown: the main columns price it "
            "with the trace token's routing at that position (optimistic: the next step re-verifies from there and "
            "finds those experts loaded), the `(other)` columns with an unrelated token's (pessimistic); the truth "
            "lies between (cache_policy/spec_replay.py). The cost rule (`--spec-rule cost`, k <= 4) prices each "
            "candidate's union of experts under the residency at the start of the step, charges its extra loads what "
            "they displace, waits for a going rate measured at the step's batch size, and takes k > 0 only when it gains 5% of a token per "
            "request-step over k = 0 (cache_policy/speculation.py). Drafts: the model's MTP layer, each drafted token costing one "
            "mean MoE layer of the non-speculative step (`--draft-cost mtp:1`). Acceptance drawn per request and step "
            f"(seeded) at {ACCEPT:.0%} per draft. Device tier: {float(DEVICE):.0%} of the experts, policy {POLICY}, "
            "the host holds every expert, no hybrid CPU compute, no prefetch.", "")
    rep.add(f"Routing: DeepSeek-V3 (58 MoE layers x 256 experts, top-8) and K3 (93 x 896, top-16) have no real trace "
            f"here, so their rows are synthetic traces of their geometry (cache_policy/synthetic.py) with locality set "
            f"from the real DeepSeek-V2-Lite trace: persistence {loc['persistence']} (real: {loc['real_persistence']:.3f} "
            f"of a token's experts reused by the next token), zipf 0.5, cross-layer 0.2. The `deepseek-v2-lite (real)` "
            f"rows replay the real DeepSeek-V2-Lite routing (/work/shared/traces/deepseek-v2-lite-train.npz, 26 x 64, "
            f"top-6) with DeepSeek-V3-sized experts (7168 x 2048): real routing, V3's bytes per expert. MXFP4 experts: "
            f"4.25 bits per parameter (cost_model.DTYPE_BITS), compute as bf16 scaled by parameters.", "")
    rep.add(f"## Regimes at {ACCEPT:.0%} acceptance", "")
    table = _regime_table(rep, rows, models, dtypes, batches)
    _batch1_note(rep, table, models)
    rep.add("## Where the rule turns speculation off: acceptance sweep, batch 1, bf16", "")
    sweep = []
    for m in models[:2]:
        for acc in SWEEP:
            got = {r["variant"]: r for r in _rows(rows, model=m, dtype="bf16", batch=1, acceptance=acc)}
            if got:
                c, co = got["cost k<=4"], got["cost k<=4 other"]
                sweep.append([m, acc, got["none"]["tokens_per_s"], got["fixed k=3"]["tokens_per_s"],
                              c["tokens_per_s"], c["tokens_per_s"] / got["none"]["tokens_per_s"], c["mean_k"],
                              c["steps_without_speculation"], got["fixed k=3 other"]["tokens_per_s"],
                              co["tokens_per_s"] / got["none"]["tokens_per_s"], co["mean_k"]])
    rep.table(["model", "acceptance", "tok/s none", "tok/s k=3", "tok/s cost rule", "rule / none", "mean k",
               "steps at k=0", "k=3 (other)", "rule / none (other)", "mean k (other)"], sweep)
    return rep.finish(_plot(rows, models, dtypes, batches, sweep), "Projected tokens/s with and without speculation")


def _plot(rows, models, dtypes, batches, sweep):
    plt = ec.pyplot()
    fig, axes = plt.subplots(1, len(models) + 1, figsize=(5 * (len(models) + 1), 4))
    for i, m in enumerate(models):
        ax = axes[i]
        for dt, ls in zip(dtypes, ("-", "--")):
            for label, col in (("none", "k"), ("fixed k=3", "tab:orange"), ("cost k<=4", "tab:blue")):
                ys = [(_rows(rows, model=m, dtype=dt, batch=b, acceptance=ACCEPT, variant=label) or [None])[0] for b in batches]
                if all(ys):
                    ax.plot(batches, [y["tokens_per_s"] for y in ys], ls, marker="o", ms=3, color=col, label=f"{label}, {dt}")
        ax.set_xscale("log", base=2)
        ax.set(yscale="log", xlabel="batch", ylabel="projected tokens/s")
        ax.set_title(f"{m}: {ACCEPT:.0%} acceptance, 10% device tier", fontsize=9)
        ax.legend(fontsize=6)
    ax = axes[-1]
    for m, col in zip(models[:2], ("tab:green", "tab:purple")):
        pts = [s for s in sweep if s[0] == m]
        ax.plot([s[1] for s in pts], [s[5] for s in pts], "-o", ms=3, color=col, label=f"{m}: cost rule / none")
        ax.plot([s[1] for s in pts], [s[3] / s[2] for s in pts], ":", marker="x", ms=3, color=col,
                label=f"{m}: fixed k=3 / none")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xlabel("acceptance per draft")
    ax.set_ylabel("tokens/s relative to no speculation")
    ax.set_title("batch 1, bf16: where speculation stops paying", fontsize=9)
    ax.legend(fontsize=6)
    return fig


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
