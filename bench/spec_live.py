"""Live speculative decoding on this CPU against the cost model's projection (issue 33: "on a fixture with known
acceptance, live tokens/s and projected tokens/s match the cost model's formula within 15%").

Checkpoint: the synthetic MoE of bench/prefix_cache.py's family (8 layers, 32 experts top-4, hidden 256; --quick:
2 layers, 8 experts, hidden 64), every expert resident, batch 1, sampled at temperature 1 (the synthetic model's
greedy text repeats one token, whose k + 1 copies route alike: sampled text routes like text). Fixtures:

- plain: no speculation - the plain decode step time T0 (its decode steps' seconds over their number);
- copy: the draft model is a second load of the target's own store (``--speculative draft``, its own expert store
  and KV cache): q = p, so every draft is accepted (acceptance 1 by construction, up to rounding);
- copy @ a: the same drafts, each position replaced, with probability 1 - a (seeded draws), by the token the draft
  model finds least likely, announced with a one-hot q - the target keeps it with probability p(token) ~ 0. The
  acceptance per position is a by construction; the engine's accept / reject rule still emits p's distribution;
- cost rule: the copy drafter with ``--spec-rule cost`` (k chosen live per step by runtime/engine/spec_cost.py);
- 1-layer draft: a real smaller draft model - the target's first layer alone, with its embeddings and head (its
  acceptance measured, not built) - with k fixed and with the cost rule.

Projection (the cost model's formula, cache_policy/speculation.py) for a fixed k and per-position acceptance a:

    E[tokens](k) = (1 - a^(k+1)) / (1 - a)                      (k + 1 when a = 1)
    step(k)      = T0 + [V(k) - F(1)] + D(k)
    projected tokens/s = E[tokens](k) / step(k)                 (speedup: x T0)

summed over the live run's own draft lengths - sum E[tokens](k) / sum step(k) - since a request's last steps draft
fewer (capped by the tokens left) and the cost rule picks k per step (k = 0: a plain step, T0). T0 is the plain
engine step (schedule, forward, sample: its decode seconds over its decode steps); F(1) the target's 1-token forward
alone (so T0 - F(1) is the engine's own share of a step, which a verify step pays too); D(k) the drafter's propose of
k tokens and V(k) the target's forward of the k + 1-token verify chunk (every row's logits) right after it, the two
alternating outside the engine as a live step runs them (each model finds the caches as the other left them), in
the steady state of acceptance a (the draft catches up 1 or 2 tokens, then k - 1 single-token forwards; both roll
back to the kept tokens; for the fixture of acceptance set by construction, with its replaced tokens in the chunk:
a token unlike the text routes unlike it, so its verify chunk's union of experts is larger). F(c) alone for every c
is reported too. The acceptance a in the projection is the one
measured in the live run (accepted / (accepted + rejections), position-independent by construction), shown beside
the constructed one. A second projection prices V(k) - F(1) by the cost model instead (``spec_cost.expert_seconds``
over the plain run's routing, the live rule's input before it has measured a verify step): how far the CPU
profile's expert table is from this machine's verify step.

Each live run first decodes an untimed warm-up request whose 128-token prompt routes to nearly every expert (the
first use of an expert copies it into the device tier's slab - CPU memory here - for the target and the draft
alike); the step-time measurements warm up the same way. The machine is shared (2 cores), so the bench runs in
rounds: every fixture live, then the step times, back to back; the report gives the median round and the range.

Usage: python bench/spec_live.py [--quick] [--k 3] [--accept 0.6] [--rounds 3] [--outdir bench/results] [--workdir DIR]
"""
import os
import statistics
from dataclasses import dataclass, replace
import sys
import tempfile
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import exp_common as ec  # noqa: E402
from cache_policy.speculation import Acceptance  # noqa: E402
from runtime.engine import Engine, SamplingParams  # noqa: E402
from runtime.engine.request import Request  # noqa: E402
from runtime.engine.spec_cost import expert_seconds, recent_counts  # noqa: E402
from runtime.engine.kv_manager import KVManager  # noqa: E402
from runtime.engine.spec_draft import DraftModelDrafter  # noqa: E402  (registers the "draft" drafter)
from runtime.engine.speculative import Draft, SpecOptions  # noqa: E402
from runtime.model import load_model  # noqa: E402
from runtime.model.layers.cache import Sequence  # noqa: E402
from runtime.model.layers.context import StepHooks  # noqa: E402

TEMPERATURE = 1.0
WARM_TOKENS = 128       # a warm-up prompt's tokens: their routing touches (nearly) every expert of every layer
KV_TOKENS = 4096        # the KV cache of a model measured outside an engine
PASS_BAND = (0.85, 1.15)


def build(workdir: str, quick: bool) -> "tuple[str, str]":
    """(the target's store, a smaller draft's store): the draft has the target's first layers' generator stream
    - the same embeddings, LM head and router locality (runtime/model/synthetic.py draws them first) - in 1 layer
    of the target's 8 (--quick: 1 of 2), so it predicts the target's text well at a fraction of its cost."""
    from runtime.model.convert import convert
    from runtime.model.synthetic import SyntheticModelSpec, build_checkpoint
    spec = (SyntheticModelSpec(hidden_size=64, intermediate_size=64, num_layers=2, num_experts=8, top_k=2,
                               num_heads=2, num_kv_heads=1) if quick else
            SyntheticModelSpec(hidden_size=256, intermediate_size=256, num_layers=8, num_experts=32, top_k=4,
                               num_heads=4, num_kv_heads=2))
    out = []
    for name, sp in (("store", spec), ("small", replace(spec, num_layers=1))):
        hf, store = os.path.join(workdir, f"hf-{name}"), os.path.join(workdir, name)
        if not os.path.exists(os.path.join(store, "manifest.json")):
            build_checkpoint(hf, sp)
            convert(hf, store)
        out.append(store)
    return out[0], out[1]


@dataclass(frozen=True)
class Fixture:
    name: str
    rule: "str | None"             # None: no speculation; "fixed" | "cost"
    draft: str = "copy"            # "copy": the target's own store; "small": the 1-layer draft
    wrap: "float | None" = None    # the acceptance set by construction (ConstructedAcceptance), None: the draft's own
    built: "float | None" = None   # the acceptance by construction, None: unknown (measured only)

    @property
    def times_key(self) -> str:
        """Which step times (D, V) project it: the draft's, in the steady state of the acceptance set by construction
        (a draft of its own acceptance: the first such fixture's measured one, this round)."""
        return self.draft if self.built is None else f"{self.draft} @ {self.built:g}"


class ConstructedAcceptance:
    """A drafter whose drafts are kept with probability ``accept`` per position by construction: the inner drafter's
    (a copy of the target: always kept) with each position replaced, with probability 1 - accept, by the token the
    draft finds least likely, announced with a one-hot q (kept with probability p(token) ~ 0)."""
    wants_hidden = False

    def __init__(self, inner, accept: float, vocab: int, seed: int = 0) -> None:
        self.inner, self.accept, self.vocab = inner, accept, vocab
        self.rng = np.random.default_rng(seed)

    def propose(self, reqs: list, ks: list) -> list:
        out = []
        self.first_bad = []            # per request: its first replaced position (len(tokens): none)
        for d in self.inner.propose(reqs, ks):
            toks = list(d.tokens)
            probs = None if d.probs is None else d.probs.clone()          # probs: [k, vocab]
            self.first_bad.append(len(toks))
            for i in range(len(toks)):
                if self.rng.random() >= self.accept:
                    self.first_bad[-1] = min(self.first_bad[-1], i)
                    toks[i] = int(probs[i].argmin()) if probs is not None else (toks[i] + 1) % self.vocab
                    if probs is not None:
                        probs[i] = torch.nn.functional.one_hot(torch.tensor(toks[i]), self.vocab).float()
            out.append(Draft(toks, probs))
        return out

    def verified(self, r, accepted, hidden=None):
        self.inner.verified(r, accepted, hidden)

    def prefilled(self, r, hidden=None):
        self.inner.prefilled(r, hidden)

    def release(self, r):
        self.inner.release(r)

    @property
    def timing(self):
        return self.inner.timing


def prompts(n: int, vocab: int, length: int = 8, seed: int = 5) -> list:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(n)]


def live(store: str, spec, accept: "float | None", reqs: list, new: int, seed: int) -> dict:
    """One live run at batch 1 (the requests one after the other): decode tokens/s, the measured acceptance, the
    drafts' lengths, and (plain) the routing of every request and its median decode step."""
    model, st = load_model(store)
    try:
        eng = Engine(model, st, max_batch=1, speculative=spec)
        if accept is not None:        # the drafts of acceptance set by construction (the engine's drafter, wrapped)
            wrapped = ConstructedAcceptance(eng.spec.drafter, accept, model.cfg.vocab_size, seed)
            eng.spec.drafter = wrapped
            eng.scheduler.on_release = wrapped.release
        # warm-up, not timed: a long random prompt routes to (nearly) every expert, so no timed step pays the first
        # copy of an expert into the device tier's slab (CPU memory here) - the target's and the draft's
        eng.add_request(prompts(1, model.cfg.vocab_size, WARM_TOKENS, seed=99)[0],
                        SamplingParams(max_tokens=8, temperature=TEMPERATURE, seed=99))
        eng.run()
        eng.steps.clear()
        eng.done.clear()
        for i, p in enumerate(reqs):
            eng.add_request(p, SamplingParams(max_tokens=new, temperature=TEMPERATURE, seed=seed + i,
                                              ignore_eos=True))
            eng.run()
        s = eng.summary()
        decode = [x for x in eng.steps if x.tokens == x.batch + x.spec_drafted + x.spec_refed]
        out = {"tokens_per_s": s["decode_tokens_per_s"], "decode_steps": len(decode),
               "ks": [x.spec_drafted for x in decode]}      # drafts verified by each decode step (0: plain)
        if spec is not None:
            ver = [x for x in decode if x.spec_drafted]          # verify steps (batch 1: one request each)
            kept = sum(x.spec_accepted for x in ver)
            # per-position acceptance: kept drafts over the drafts judged (those up to and including a rejection)
            rejections = sum(1 for x in ver if x.spec_accepted < x.spec_drafted)
            out.update(acceptance=kept / max(1, kept + rejections), kept=kept, rejections=rejections,
                       verify_steps=len(ver),
                       mean_accepted=kept / max(1, len(ver)),
                       mean_k=float(np.mean([x.spec_drafted for x in ver])) if ver else 0.0,
                       k_share=len(ver) / max(1, len(decode)))
        else:
            routing = [np.concatenate(r.routing[1:]) for r in eng.done.values()]   # the decode tokens' routing
            out["priced_extra_s"] = {k: priced_extra(st, routing, k, model.cfg.num_moe_layers) for k in range(1, 9)}
        return out
    finally:
        st.close()


def priced_extra(st, routing: list, k: int, L: int) -> float:
    """The cost model's V(k) - F(1) (spec_cost.expert_seconds, every expert resident): the mean over the plain
    run's windows of k + 1 consecutive decode tokens of their union's price less their last token's."""
    out, E = [], st.m.num_experts
    for R in routing:                                            # R: [tokens, layers, top_k]
        for j in range(0, len(R) - k):
            w = type("W", (), {"routing": [R[j:j + k + 1]]})()
            c = recent_counts([w], k, L, E)                      # c: [k + 1, layers, experts]
            out.append(expert_seconds(st, c[k], 0.0) - expert_seconds(st, c[0], 0.0))
    return float(np.mean(out)) if out else 0.0


def trimmed_mean(xs: list, cut: float = 0.1) -> float:
    xs = sorted(xs)
    n = int(len(xs) * cut)
    return float(np.mean(xs[n:len(xs) - n] if len(xs) > 2 * n else xs))


def forward_times(store: str, cs: list, reps: int, ctx: int) -> dict:
    """F(c): median seconds of the target's forward of a c-token chunk at batch 1 on a warm sequence of ``ctx``
    tokens, every row's logits made for c > 1 (as a verify chunk's are), the sequence rolled back after each."""
    model, st = load_model(store)
    try:
        eng = Engine(model, st, max_batch=1)
        kv, V = eng.kv, model.cfg.vocab_size
        g = torch.Generator().manual_seed(1)
        seq = Sequence()
        first = torch.randint(0, V, (max(ctx, WARM_TOKENS),), generator=g).tolist()    # warms every expert too
        kv.prepare([seq], [first + [0] * (max(cs) + 1)])
        model.forward([seq], [first])
        st.end_step()
        got = {c: [] for c in cs}
        for rep in range(reps + 2):
            for c in cs:
                chunk = torch.randint(0, V, (c,), generator=g).tolist()
                hooks = StepHooks(every_token=(seq,), token_logits=lambda s, row, lg: None) if c > 1 else StepHooks()
                t0 = time.perf_counter()
                model.forward([seq], [chunk], hooks)
                st.end_step()
                if rep >= 2:                                     # two warm-up rounds
                    got[c].append(time.perf_counter() - t0)
                seq.length -= c
        kv.release(seq)
        return {c: statistics.median(v) for c, v in got.items()}
    finally:
        st.close()


def pair_times(store: str, draft: str, ks: list, accept: float, reps: int, new: int, wrap: bool = False) -> dict:
    """{k: (D(k), V(k))}: the drafter's (the model at ``draft``) seconds per propose of k tokens, and the target's
    forward of the verify chunk [last token, d1..dk] right after it (every row's logits), alternating as a live step
    runs them (each model finds the caches as the other left them) but with no engine around them: no scheduling,
    no accept / reject, no sampling. Steady state of acceptance ``accept``: after each pair the first a drafts are
    kept (each position with probability accept until the first that is not) and a target token follows; both
    sequences roll back to the kept tokens, as in the live run. ``wrap``: the drafts of acceptance set by
    construction (ConstructedAcceptance), as the live fixture has them - its replaced tokens are in the verify chunk
    (a token unlike the text routes unlike it: a larger union of experts), and the first of them is where the
    target rejects. Trimmed means over ``reps`` pairs after 3 warm ones, for each k."""
    model, st = load_model(store)
    drafter = DraftModelDrafter.load(draft, _vocab(store), kv_tokens=KV_TOKENS)
    try:
        model.init_kv(num_blocks=KV_TOKENS // 16)        # (init_kv's default reserves 16 sequences of 4096 tokens)
        kv, V = KVManager.for_model(model), model.cfg.vocab_size
        warm = Request(id=0, prompt=prompts(1, V, WARM_TOKENS, seed=99)[0], params=SamplingParams(temperature=1.0))
        drafter.propose([warm], [1])                 # warm-up: every expert copied into each model's device slab
        drafter.release(warm)
        kv.prepare([warm.seq], [warm.prompt])
        model.forward([warm.seq], [warm.prompt])
        kv.release(warm.seq)
        src = ConstructedAcceptance(drafter, accept, V) if wrap else drafter
        return {k: _pairs(model, st, kv, src, k, accept, reps, new) for k in ks}
    finally:
        drafter.close()
        st.close()


def _pairs(model, st, kv, drafter, k: int, accept: float, reps: int, new: int) -> "tuple[float, float]":
    V = model.cfg.vocab_size
    rng = np.random.default_rng(3)
    ps = prompts(1, V)[0]
    r, dt, vt, rid = None, [], [], 0
    for rep in range(reps + 3):
        if r is None or len(r.output) + k + 1 >= new:
            if r is not None:
                drafter.release(r)
                kv.release(r.seq)
            rid += 1
            r = Request(id=rid, prompt=list(ps), params=SamplingParams(max_tokens=new, temperature=TEMPERATURE,
                                                                       seed=rid))
            r.output = [int(rng.integers(V))]
            kv.prepare([r.seq], [r.prompt])
            model.forward([r.seq], [r.prompt])       # the target has fed all but output[-1], as the engine has
            st.end_step()
        t0 = time.perf_counter()
        d = drafter.propose([r], [k])[0]
        t1 = time.perf_counter()
        chunk = [r.output[-1]] + list(d.tokens)
        kv.prepare([r.seq], [chunk])
        model.forward([r.seq], [chunk], StepHooks(every_token=(r.seq,), token_logits=lambda s, row, lg: None))
        st.end_step()
        if rep >= 3:
            dt.append(t1 - t0)
            vt.append(time.perf_counter() - t1)
        if isinstance(drafter, ConstructedAcceptance):
            a = drafter.first_bad[0]                 # the target rejects the first replaced token
        else:
            a = 0
            while a < len(d.tokens) and rng.random() < accept:
                a += 1
        nxt = int(rng.integers(V)) if a == len(d.tokens) else (d.tokens[a] + 1) % V
        r.seq.length -= len(d.tokens) - a                               # the target keeps output[-1] and a drafts
        r.output += list(d.tokens[:a]) + [nxt]
        drafter.verified(r, a, None)
    drafter.release(r)
    kv.release(r.seq)
    return trimmed_mean(dt), trimmed_mean(vt)


def _vocab(store: str) -> int:
    import json
    with open(os.path.join(store, "config.json")) as f:
        return int(json.load(f)["vocab_size"])


def project(ks: list, acceptance: float, T0: float, F1: float, D: dict, V: dict, extra: "dict | None" = None) -> dict:
    """The formula over the live run's own sequence of draft lengths (k = 0: a plain step; the last steps of a
    request draft fewer, capped by the tokens left): sum of E[tokens](k) over sum of step(k) = T0 + [V(k) - F(1)]
    + D(k), V(k) the verify chunk's forward of k + 1 tokens; ``extra``: V(k) - F(1) priced by the cost model instead."""
    acc = Acceptance((min(1.0, max(0.0, acceptance)),))
    tokens = sum(acc.expected_tokens(k) for k in ks)
    secs = sum(T0 + ((extra[k] if extra is not None else V[k] - F1) + D[k] if k else 0.0) for k in ks)
    return {"tokens": tokens, "seconds": secs, "tokens_per_s": tokens / secs if secs else 0.0}


def one_round(stores: dict, fixtures: list, K: int, reqs: list, new: int, reps: int, seed: int) -> dict:
    """One round: every fixture live, then the step times the projection reads (T0 from this round's plain run,
    F, D, V, the cost model's extra), then each fixture's projection - measured back to back, so the machine's load
    (shared) drifts as little as possible between a live run and the times it is projected from."""
    store, runs = stores["copy"], {}
    for f in fixtures:
        spec = None if f.rule is None else SpecOptions("draft", K, rule=f.rule, draft_model=stores[f.draft])
        runs[f.name] = live(store, spec, f.wrap, reqs, new, seed)
    F = forward_times(store, list(range(1, K + 2)), reps, 8 + new // 2)
    D, V = {}, {}
    for f in fixtures:
        if f.rule is None:
            continue
        r = runs[f.name]
        a = r["kept"] / max(1, r["kept"] + r["rejections"])
        key = f.times_key
        if key not in D:
            pairs = pair_times(store, stores[f.draft], list(range(1, K + 1)), a if f.built is None else f.built,
                               reps, new, wrap=f.wrap is not None)
            D[key] = {0: 0.0, **{k: p[0] for k, p in pairs.items()}}
            V[key] = {0: F[1], **{k: p[1] for k, p in pairs.items()}}
    T0 = 1.0 / runs["plain"]["tokens_per_s"]
    priced = {k: runs["plain"]["priced_extra_s"][k] for k in range(1, K + 1)}
    out = {"T0_s": T0, "F_s": F, "D_s": D, "V_s": V, "priced_extra_s": priced, "fixtures": {}}
    for f in fixtures:
        r = runs[f.name]
        row = {"live_tokens_per_s": r["tokens_per_s"]}
        if f.rule is not None:
            a = r["kept"] / max(1, r["kept"] + r["rejections"])
            key = f.times_key
            pj = project(r["ks"], a, T0, F[1], D[key], V[key])
            pp = project(r["ks"], a, T0, F[1], D[key], V[key], extra=priced)
            row.update(acceptance=a, kept=r["kept"], rejections=r["rejections"], ks=r["ks"], times=key,
                       projected=pj, projected_priced=pp, ratio=r["tokens_per_s"] / pj["tokens_per_s"],
                       ratio_priced=r["tokens_per_s"] / pp["tokens_per_s"])
        out["fixtures"][f.name] = row
    return out


def main(argv=None) -> None:
    ap = ec.parser()
    ap.add_argument("--k", type=int, default=3, help="--num-speculative-tokens of the fixed-k fixtures")
    ap.add_argument("--accept", type=float, default=0.6, help="the acceptance set by construction")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of every fixture and its step times")
    ap.add_argument("--new", type=int, default=None, help="tokens per request (default 48; --quick 12)")
    ap.add_argument("--requests", type=int, default=None, help="requests per run (default 2; --quick 1)")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions of each step time (default 12)")
    ap.add_argument("--workdir", default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)      # a shared 2-core machine: one thread per forward is the steadier timing
    cmd = "python bench/spec_live.py" + (" --quick" if a.quick else "") + f" --k {a.k} --accept {a.accept} " \
        f"--rounds {a.rounds}"
    rep = ec.Report("spec_live", a.outdir, cmd, "Live speculative decoding against the cost model's projection "
                    "(CPU, batch 1)")
    store, small = build(a.workdir or tempfile.mkdtemp(prefix="tiered-moe-spec-"), a.quick)
    stores = {"copy": store, "small": small}
    new, nreq, reps = (12, 1, 4) if a.quick else (48, 2, 12)
    new, nreq, reps = a.new or new, a.requests or nreq, a.reps or reps
    reqs = prompts(nreq, _vocab(store))
    K = a.k
    fixtures = [Fixture("plain", None), Fixture("copy", "fixed", built=1.0),
                Fixture(f"copy @ {a.accept:g}", "fixed", wrap=a.accept, built=a.accept),
                Fixture("copy, cost rule", "cost", built=1.0), Fixture("1-layer draft", "fixed", draft="small"),
                Fixture("1-layer draft, cost rule", "cost", draft="small")]
    rounds = [one_round(stores, fixtures, K, reqs, new, reps, 100 * i) for i in range(a.rounds)]
    med = statistics.median
    rows, rep.data["fixtures"] = [], {}
    T0 = med(r["T0_s"] for r in rounds)
    for f in fixtures:
        name, rule, built = f.name, f.rule, f.built
        got = [r["fixtures"][name] for r in rounds]
        live_tps = med(g["live_tokens_per_s"] for g in got)
        d = rep.data["fixtures"][name] = {"live_tokens_per_s": [g["live_tokens_per_s"] for g in got]}
        if rule is None:
            rows.append([name, 0, "-", "-", 1 / T0, live_tps, 1.0, "-", "-", "-"])
            continue
        kept, rej = sum(g["kept"] for g in got), sum(g["rejections"] for g in got)
        ks = [k for g in got for k in g["ks"]]
        mean_k = float(np.mean([k for k in ks if k])) if any(ks) else 0.0
        ratios = [g["ratio"] for g in got]
        d.update(rule=rule, k_max=K, acceptance_constructed=built, acceptance_measured=kept / max(1, kept + rej),
                 mean_k=mean_k, share_of_steps_drafting=sum(1 for k in ks if k) / max(1, len(ks)),
                 projected_tokens_per_s=[g["projected"]["tokens_per_s"] for g in got], ratios=ratios,
                 ratios_priced=[g["ratio_priced"] for g in got], ratio=med(ratios),
                 within_band=PASS_BAND[0] <= med(ratios) <= PASS_BAND[1])
        rows.append([name, f"{mean_k:.2f}", "-" if built is None else built, d["acceptance_measured"],
                     med(g["projected"]["tokens_per_s"] for g in got), live_tps, live_tps * T0, med(ratios),
                     f"{min(ratios):.2f}-{max(ratios):.2f}", med(d["ratios_priced"])])
    F = {c: med(r["F_s"][c] for r in rounds) for c in rounds[0]["F_s"]}
    priced = {k: med(r["priced_extra_s"][k] for r in rounds) for k in range(1, K + 1)}
    keys = sorted({key for r in rounds for key in r["D_s"]})
    D = {key: {k: med(r["D_s"][key][k] for r in rounds if key in r["D_s"]) for k in range(K + 1)} for key in keys}
    V = {key: {k: med(r["V_s"][key][k] for r in rounds if key in r["V_s"]) for k in range(K + 1)} for key in keys}
    rep.data.update({"rounds": rounds, "T0_s": T0, "F_s": F, "D_s": D, "V_s": V, "priced_extra_s": priced,
                     "band": PASS_BAND,
                     "new_tokens": new, "requests": nreq, "temperature": TEMPERATURE, "k": K})
    _write(rep, rows, K, F, D, V, priced)


def _write(rep, rows: list, K: int, F: dict, D: dict, V: dict, priced: dict) -> None:
    d = rep.data
    rep.add(f"Batch 1, {d['requests']} request(s) of {d['new_tokens']} tokens per run, sampled at temperature "
            f"{d['temperature']:g}, k_max {K}; {len(d['rounds'])} rounds, each running every fixture live and then "
            "measuring the step times its projection reads (the machine is shared: times drift between rounds, "
            "less within one). Figures: the median round. One torch thread. Every expert resident (no GPU here: "
            "the device tier is CPU memory).", "")
    rep.table(["fixture", "mean k (drafting steps)", "acceptance (built)", "acceptance (measured)",
               "projected tok/s", "live tok/s", "live speedup", "live / projected", "range over rounds",
               "live / projected (priced)"], rows)
    rep.add("Projected: the formula of cache_policy/speculation.py over the live run's own draft lengths (k = 0: a "
            "plain step; fewer drafts at a request's end): sum E[tokens](k) / sum (T0 + V(k) - F(1) + D(k)), with "
            "E[tokens](k) = (1 - a^(k+1)) / (1 - a) at the acceptance a measured in that run, and step(k) = T0 + "
            "V(k) - F(1) + D(k): T0 the round's plain decode step (the engine's whole step), F(1) the target's "
            "1-token forward alone, D(k) the drafter's propose of k tokens and V(k) the target's forward of the "
            "k + 1-token verify chunk right after it - the two alternating as in a live step, without the engine "
            "(bench/spec_live.py's docstring). 'priced': V(k) - F(1) from the cost model's CPU profile instead (what "
            "the live cost rule starts from, before it has measured a verify step).", "")
    cs = sorted(F)
    rep.table(["step times (ms, median round)"] + [f"c = {c}" for c in cs],
              [["F(c): the target's c-token forward alone"] + [F[c] * 1e3 for c in cs],
               ["F(c) - F(1) priced by the cost model"] + [0.0] + [priced.get(c - 1, 0.0) * 1e3 for c in cs[1:]]]
              + [[f"D(c - 1): propose, draft {key}"] + [D[key].get(c - 1, 0.0) * 1e3 for c in cs] for key in D]
              + [[f"V(c - 1): verify forward after it, draft {key}"] + [V[key].get(c - 1, 0.0) * 1e3 for c in cs]
                 for key in V])
    ok = [f for f, v in d["fixtures"].items() if "ratio" in v]
    inside = [f for f in ok if d["fixtures"][f]["within_band"]]
    rep.add(f"T0 = {d['T0_s'] * 1e3:.2f} ms. Within {PASS_BAND[0]:.2f}-{PASS_BAND[1]:.2f}: {len(inside)} of "
            f"{len(ok)} speculative fixtures" + (f" (outside: {', '.join(f for f in ok if f not in inside)})"
                                                 if len(inside) < len(ok) else "") + ".", "")
    rep.write()


if __name__ == "__main__":
    main()
