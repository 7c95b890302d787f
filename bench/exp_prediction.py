"""Experiment 6: prediction quality of every prefetcher. Fitted on the first 80% of the
DeepSeek-V2-Lite training prompts, scored on the last 20% - never on what it was fitted on.
Online prefetchers learn as they go, but every prediction is made before the token it predicts is
observed. The gate lookahead needs the live model's hidden states, so it is scored live (with
freq and transition beside it) on the demo's synthetic model.

Score: for every token and layer l, the prefetcher predicts `budget` experts of layer l+1 from the
experts layer l used; precision = |predicted & used| / |predicted|, recall = |predicted & used| /
|used| (at budget = top-k the two are equal).

Usage: python bench/exp_prediction.py [--quick] [--outdir bench/results]
"""
import sys
import time

import numpy as np

import exp_common as ec
from cache_policy.prefetch import FreqPrefetcher, TransitionPrefetcher


class Popularity:
    """Static baseline: the experts most used per layer in the training prompts."""

    def __init__(self, train):
        L, E = train.num_layers, train.num_experts
        self.counts = np.zeros((L, E))
        for l in range(L):
            self.counts[l] = np.bincount(train.ids[:, l].reshape(-1).astype(np.int64), minlength=E)
        self.order = np.argsort(-self.counts, axis=1, kind="stable")

    def observe(self, *a):
        pass

    def predict(self, target, experts, budget):
        return self.order[target, :budget].tolist()


def score(pf, test, budget: int, warm=None) -> dict:
    """Token by token, layer by layer, in order: predict layer l+1 (and layer 0 of the next token
    from the last layer), then observe what it really used."""
    L = test.num_layers
    hit = pred_n = need = 0
    t = 0
    for tr in ([warm] if warm is not None else []) + [test]:
        scoring = tr is test
        for s in range(tr.num_sequences):
            a, b = int(tr.seq_offsets[s]), int(tr.seq_offsets[s + 1])
            for tok in range(a, b):
                for l in range(L):
                    used = tr.ids[tok, l]
                    pf.observe(l, used, None, t)
                    if l + 1 < L:
                        p = pf.predict(l + 1, used, budget)
                        nxt = tr.ids[tok, l + 1]
                        if scoring:
                            hit += len(set(p) & set(nxt.tolist()))
                            pred_n += len(p)
                            need += len(nxt)
                t += 1
    return {"precision": hit / pred_n, "recall": hit / need}


def live(quick: bool, workdir: str):
    """Prefetch precision / recall of the live engine on the demo model (lookahead = the next
    layer's router on this layer's output)."""
    import torch
    from exp_live_common import demo_store, expert_budget
    from runtime.engine import Engine, SamplingParams
    from runtime.model import load_model
    store, spec = demo_store(workdir)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, spec.vocab_size, (8,), generator=g).tolist() for _ in range(4 if quick else 32)]
    out = []
    for name in ("freq", "transition", "lookahead"):
        budget, _ = expert_budget(store, 0.25)
        model, st = load_model(store, expert_budget=budget)
        try:
            eng = Engine(model, st, max_batch=1, prefetch=name)
            for p in prompts:
                eng.add_request(p, SamplingParams(max_tokens=8 if quick else 24, ignore_eos=True))
            eng.run()
            s = eng.summary()
            out.append({"prefetcher": name, "precision": s["prefetch"]["precision"], "recall": s["prefetch"]["recall"],
                        "hit_device": s["hit_rate_device"]})
        finally:
            st.close()
    return out, spec


def main(argv=None):
    ap = ec.parser(workdir=True)
    a = ap.parse_args(argv)
    started = time.time()
    ds = ec.shared_trace("deepseek-v2-lite-train.npz")
    S = ds.num_sequences
    cut = int(0.8 * S)
    max_len = 16 if a.quick else 48
    train = ec.subset(ds, sequences=40 if a.quick else cut, max_len=max_len)
    test = ec.subset(ds, start=cut, sequences=10 if a.quick else S - cut, max_len=max_len)
    k = ds.top_k
    L, E = ds.num_layers, ds.num_experts
    budgets = [k] if a.quick else [k, 2 * k]

    def fitted_transition(online):
        p = TransitionPrefetcher(L, E).fit(train)
        p.online = online
        return p

    variants = [
        ("popularity (fitted)", lambda: Popularity(train), None),
        ("freq (online)", lambda: FreqPrefetcher(L, E), None),
        ("freq (warmed on train)", lambda: FreqPrefetcher(L, E), train),
        ("transition (online)", lambda: TransitionPrefetcher(L, E), None),
        ("transition (fitted)", lambda: fitted_transition(False), None),
        ("transition (fitted + online)", lambda: fitted_transition(True), None),
    ]
    rows = []
    from tqdm import tqdm
    for name, make, warm in tqdm(variants, desc="prediction quality", unit="prefetcher", file=sys.stderr):
        for b in budgets:
            rows.append({"prefetcher": name, "budget": b, **score(make(), test, b, warm)})
    live_rows, spec = live(a.quick, a.workdir)
    rep = ec.Report("exp_prediction", a.outdir, "python bench/exp_prediction.py" + (" --quick" if a.quick else ""),
                    "Experiment 6: prediction quality of the prefetchers", started)
    rep.data.update({"rows": rows, "live": live_rows, "train_sequences": train.num_sequences,
                     "test_sequences": test.num_sequences})
    rep.add(f"Trace: DeepSeek-V2-Lite-Chat (../shared/traces/deepseek-v2-lite-train.npz), {L} layers x {E} experts, "
            f"top-{k}. Fit: prompts 0..{train.num_sequences - 1} ({train.num_tokens:,} tokens); score: prompts "
            f"{cut}..{cut + test.num_sequences - 1} ({test.num_tokens:,} tokens); each prompt's first {max_len} tokens. "
            f"Budget: experts predicted per layer. Chance level at budget b: b / {E} precision.", "")
    rep.table(["prefetcher", "budget", "precision", "recall", "chance precision"],
              [[r["prefetcher"], r["budget"], r["precision"], r["recall"], r["budget"] / E] for r in rows])
    rep.add("Live, on the demo's synthetic model (8 layers x 32 experts, top-2; batch 1, device tier 25%, LRU): "
            "precision = prefetched experts used by the next layer / prefetched; recall = needed experts that were "
            "predicted / needed (runtime/engine/engine.py). Transition and freq learn online here.", "")
    rep.table(["prefetcher", "precision", "recall", "device hit rate"],
              [[r["prefetcher"], r["precision"], r["recall"], r["hit_device"]] for r in live_rows])
    plt = ec.pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.6))
    names = [v[0] for v in variants]
    for i, b in enumerate(budgets):
        ax.barh([j + 0.4 * i for j in range(len(names))], [next(r["precision"] for r in rows if r["prefetcher"] == n
                                                                and r["budget"] == b) for n in names],
                height=0.4, label=f"precision, budget {b}")
    ax.axvline(k / E, color="gray", ls=":", label="chance (budget k)")
    ax.set_yticks([j + 0.2 for j in range(len(names))], names, fontsize=7)
    ax.set_xlabel("precision (held-out DeepSeek-V2-Lite prompts)")
    ax.legend(fontsize=7)
    return rep.finish(fig, "prefetcher precision")


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
