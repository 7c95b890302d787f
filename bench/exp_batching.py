"""Experiment 5: expert-aware batching. The scheduler option (--schedule expert-aware) that runs,
each step, the max_batch active requests whose recent routing overlaps most, against first-come
batching at the same batch size: unique experts per step, device hit rate, tokens/s, fairness.

Usage: python bench/exp_batching.py [--quick] [--outdir bench/results] [--workdir DIR]
"""
import sys
import time

import numpy as np
import torch

import exp_common as ec
from exp_live_common import demo_store, expert_budget


def run(store, prompts, *, schedule, batch, max_active, fraction, tokens, policy):
    from runtime.engine import Engine, SamplingParams
    from runtime.model import load_model
    budget, slots = expert_budget(store, fraction)
    model, st = load_model(store, expert_budget=budget, policy=policy, scope="layer")
    try:
        eng = Engine(model, st, max_batch=batch, prefill_chunk=64, schedule=schedule, max_active=max_active)
        ids = [eng.add_request(p, SamplingParams(max_tokens=tokens, ignore_eos=True)) for p in prompts]
        t0 = time.perf_counter()
        eng.run()
        wall = time.perf_counter() - t0
        s = eng.summary()
        full = [st_ for st_ in eng.steps if st_.batch == batch and st_.tokens == batch]   # full decode steps
        lat = [eng.done[i].first_token_time - eng.done[i].arrival for i in ids]
        return {"schedule": schedule, "max_active": eng.max_active, "batch": batch, "policy": policy, "slots": slots,
                "steps": len(eng.steps), "full_decode_steps": len(full),
                "unique_per_layer_full_steps": float(np.mean([np.mean(x.unique_experts) for x in full])) if full else None,
                "unique_per_layer_all_steps": s["mean_unique_experts_per_layer"],
                "hit_device": s["hit_rate_device"], "tokens_per_s": s["generated_tokens"] / wall,
                "ttft_mean_s": float(np.mean(lat)), "ttft_max_s": float(np.max(lat)),
                "outputs": [eng.done[i].output for i in ids]}
    finally:
        st.close()


def main(argv=None):
    ap = ec.parser(workdir=True, device_fraction=True)
    a = ap.parse_args(argv)
    started = time.time()
    n, tokens = (16, 6) if a.quick else (96, 24)
    batches = [4] if a.quick else [4, 8, 16]
    store, spec = demo_store(a.workdir)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, spec.vocab_size, (8,), generator=g).tolist() for _ in range(n)]
    variants = [("fcfs", None)] + [("expert-aware", m) for m in ((2,) if a.quick else (2, 4))]
    policies = ["lru"] if a.quick else ["lru", "lfu"]
    jobs = [(b, s, m, p) for p in policies for b in batches for s, m in variants]
    rows = []
    from tqdm import tqdm
    for b, s, m, p in tqdm(jobs, desc="expert-aware batching", unit="run", file=sys.stderr):
        rows.append(run(store, prompts, schedule=s, batch=b, max_active=m * b if m else None,
                        fraction=a.device_fraction, tokens=tokens, policy=p))
    same = all(r["outputs"] == rows[0]["outputs"] for r in rows)
    for r in rows:
        del r["outputs"]
    rep = ec.Report("exp_batching", a.outdir, "python bench/exp_batching.py" + (" --quick" if a.quick else ""),
                    "Experiment 5: expert-aware batching vs first-come batching", started)
    rep.data.update({"rows": rows, "outputs_identical": same})
    rep.add(f"Model: the demo's synthetic checkpoint ({spec.num_layers} layers x {spec.num_experts} experts, top-"
            f"{spec.top_k}; its router has topics, so sequences differ in which experts they use), device tier "
            f"{a.device_fraction:.0%} of each layer's experts (per-layer pools). {n} requests of 8 random prompt tokens + {tokens} greedy tokens, "
            f"all queued at once. fcfs: the first `batch` requests run to completion, then the next join. "
            f"expert-aware: `max_active` requests hold a KV slot and each step runs the `batch` of them whose last "
            f"token's experts overlap most (runtime/engine/engine.py `_choose`; the one that waited longest seeds "
            f"the group). Unique experts are per MoE layer per step, over full decode steps (batch = max batch). "
            f"Every variant produced the same tokens: {same}. TTFT: arrival to first token, in seconds of this "
            f"CPU run.", "")
    rep.table(["policy", "batch", "schedule", "max active", "unique experts/layer/step (full steps)", "device hit rate",
               "tokens/s (CPU)", "TTFT mean s", "TTFT max s", "steps"],
              [[r["policy"], r["batch"], r["schedule"], r["max_active"], r["unique_per_layer_full_steps"], r["hit_device"],
                r["tokens_per_s"], r["ttft_mean_s"], r["ttft_max_s"], r["steps"]] for r in rows])
    plt = ec.pyplot()
    fig, ax = plt.subplots(1, 2, figsize=(9, 3.6))
    for k, (s, m) in enumerate(variants):
        rs = [r for r in rows if r["schedule"] == s and r["policy"] == policies[0] and
              (m is None or r["max_active"] == m * r["batch"])]
        lab = s if m is None else f"{s}, active {m}x batch"
        ax[0].plot([r["batch"] for r in rs], [r["unique_per_layer_full_steps"] for r in rs], "-o", ms=3, label=lab)
        ax[1].plot([r["batch"] for r in rs], [r["hit_device"] for r in rs], "-o", ms=3, label=lab)
    ax[0].set_xlabel("batch")
    ax[0].set_ylabel(f"unique experts per layer per step (of {spec.num_experts})")
    ax[1].set_xlabel("batch")
    ax[1].set_ylabel(f"device hit rate ({policies[0]})")
    ax[0].legend(fontsize=7)
    return rep.finish(fig, "expert-aware batching")


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
