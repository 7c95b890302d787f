"""``tiered-moe replay --speculative``: tokens/s of speculative decoding projected from a routing trace.

Each step, every active request verifies k drafts: its next k+1 tokens of the trace go through the model together
(continuous batching as in replay: a finished request's slot takes the next request at the following step). The
rule (cache_policy/speculation.py) picks k per step from the residency at the start of the step: each candidate's
union of experts is priced by the cost model under the current device / host residency, exactly as replay prices a
step. The chosen step then runs through placement (``TieredPlacement.access``, the one truth for residency, shared
with the live store) and is priced from what placement did. How many drafts each request gets accepted is drawn
from the acceptance model (seeded); the request advances by the accepted drafts plus the target's own token.

Which routing a verify step's tokens have: the input at position p+i is the i-th draft. An accepted draft is the
token the trace has there, so it routes what the trace's token routes - exactly. A rejected draft (and every draft
after it) is some other token, whose routing no trace holds; it is priced with the trace token's routing at that
position as the stand-in. The router reads a hidden state built mostly from the shared context, and the stand-in
keeps what the price depends on: k+1 distinct positions each routing top-k experts, with the trace's locality
between neighbours. A wrong token that routes unlike its neighbours would make the union larger than priced.

Which routing a rejected draft gets is an option (``rejected``): "next" (above: optimistic, since the next step
re-verifies from the rejected position and finds those experts loaded) or "other" (the routing of the trace's token
half a trace away: an unrelated token, whose experts are reused only by chance - pessimistic). The truth lies between.

The rule prices candidates with the trace's routing of the tokens it would verify (replay has it; the live engine
will estimate it), from the residency at the start of the step, with two corrections the step-start residency does
not show: a candidate whose experts outgrow a device pool is priced as all missing (the step would evict its own
later hits), and each expert it moves beyond the k = 0 step is charged what displacing a resident costs later (the
device hit rate x one copy, the estimate the prefetch gate uses). The rule waits for the going rate (GoingRate: 8
steps after the device tier filled) before it speculates, and reads it for the step's batch size. The step's real
price can still differ from the rule's - the report gives the mean gap (``rule_price_error``). Attention is not
priced (the h200 profile's non_expert_us_per_layer is 0): verify steps' extra attention is left out, as replay
leaves decode attention out.
Not supported with --speculative: prefetch (verify steps are priced without it) and belady (its next-use oracle
needs the schedule in advance; speculation decides it as it goes).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from .replay import PlacementSetup, ReplayConfig, build_placement
from .speculation import K_MAX_LIMIT, Acceptance, DraftCost, GoingRate, SpecInputs, make_rule, price_steps
from .traces import Trace


# The routing a rejected draft (and every draft after it) is priced with: "next", the trace's token at that position
# (optimistic: the next step re-verifies from there and finds those experts loaded); "other", the trace's token half
# a trace away (pessimistic: an unrelated token's experts, reused only by chance). The truth lies between.
REJECTED_ROUTING = ("next", "other")


@dataclass
class SpecConfig:
    acceptance: Acceptance = field(default_factory=lambda: Acceptance((0.85,)))
    k_max: int = 4                     # --num-speculative-tokens: the most drafts per request and step
    rule: str = "cost"                 # speculation.SPEC_RULES
    draft: DraftCost = field(default_factory=DraftCost)
    seed: int = 0                      # acceptance draws
    rejected: str = "next"             # REJECTED_ROUTING: the stand-in routing of rejected drafts

    def __post_init__(self) -> None:
        make_rule(self.rule, self.k_max)     # name and range checks, with the option names
        if self.rejected not in REJECTED_ROUTING:
            raise ValueError(f"--rejected-routing: unknown {self.rejected!r}; choose one of {', '.join(REJECTED_ROUTING)}")
        if not isinstance(self.acceptance, Acceptance):
            raise ValueError(f"--acceptance: expected an Acceptance, got {self.acceptance!r}")
        if not isinstance(self.draft, DraftCost):
            raise ValueError(f"--draft-cost: expected a DraftCost, got {self.draft!r}")
        if not isinstance(self.seed, (int, np.integer)) or isinstance(self.seed, bool) or self.seed < 0:
            raise ValueError(f"--spec-seed must be an integer >= 0, got {self.seed!r}")


def check_replay_config(cfg: ReplayConfig) -> None:
    if cfg.prefetch != "none":
        raise ValueError(f"--speculative: replay prices verify steps without prefetch; use --prefetch none "
                         f"(got {cfg.prefetch!r})")
    if cfg.policy == "belady":
        raise ValueError("--speculative: policy 'belady' needs the schedule in advance, which speculation decides "
                         "step by step; choose another --policy")


class _Run:
    """One pass over the trace with one rule (k_cap = 0: no speculation)."""

    def __init__(self, trace: Trace, cfg: ReplayConfig, batch: int, ps: PlacementSetup, k_cap: int) -> None:
        self.trace, self.batch, self.ps, self.k_cap = trace, batch, ps, k_cap
        L, E = self.L, self.E = trace.num_layers, trace.num_experts
        self.fk = trace.ids.astype(np.int64) + (np.arange(L, dtype=np.int64) * E)[None, :, None]   # fk: [T, L, k]
        self.wants = ps.factory().wants
        dev, host = ps.cost.tables(batch * (k_cap + 1))
        self.devtab, self.hosttab = np.asarray(dev), np.asarray(host)
        self.bounds = np.arange(L + 1) * E
        self.work: list = []           # per executed step: (C, h2d, disk, H) arrays [L]
        self.priced: list = []         # per executed step: the rule's price of the chosen k (None without one)
        self.seen = [0, 0]             # device hits, needed experts so far (the displacement estimate)

    def union(self, toks: np.ndarray) -> tuple:
        """Flat keys (ascending) the tokens route, tokens per key, router weight per key (replay's group aux)."""
        keys, inv, counts = np.unique(self.fk[toks].reshape(-1), return_inverse=True, return_counts=True)
        w = None
        if self.wants == "weights":
            w = (counts.astype(np.float32) if self.trace.weights is None else
                 np.bincount(inv, weights=self.trace.weights[toks].reshape(-1), minlength=len(keys)).astype(np.float32))
        return keys, counts, w

    def _masks(self) -> tuple:
        place, n = self.ps.place, self.L * self.E
        dev = np.zeros(n, dtype=bool)
        for p in place.unique_pools("device"):
            if p.resident:
                dev[np.fromiter(p.resident, dtype=np.int64, count=len(p.resident))] = True
        host = None
        if place.host is not None:
            host = np.zeros(n, dtype=bool)
            for p in place.unique_pools("host"):
                if p.resident:
                    host[np.fromiter(p.resident, dtype=np.int64, count=len(p.resident))] = True
        return dev, host

    def peek(self, u: tuple, dev: np.ndarray, host: "np.ndarray | None") -> tuple:
        """The layer work of a union under the residency masks, without touching placement: the decisions
        ``TieredPlacement.access`` would take from that residency (hybrid split included)."""
        keys, counts, _ = u
        place, cost = self.ps.place, self.ps.cost
        layer = keys // self.E
        hit = dev[keys]
        on_host = np.ones(len(keys), dtype=bool) if host is None else host[keys]
        hosted = layer < place.cpu_layers
        hit &= ~hosted
        # A step whose experts exceed a device pool evicts its own later hits (LRU over a cycle longer than the
        # cache hits nothing): price such a pool's experts as all missing rather than trust the step-start residency.
        if place.scope == "global":
            if int((~hosted).sum()) > place.device[0].capacity:
                hit[:] = False
        else:
            over = np.bincount(layer[~hosted], minlength=self.L) > np.array([p.capacity for p in place.device])
            hit &= ~over[layer]
        if place.hybrid is not None:
            cuts = np.searchsorted(keys, self.bounds)
            for l in range(place.cpu_layers, self.L):
                a, b = cuts[l], cuts[l + 1]
                miss = ~hit[a:b] & on_host[a:b]
                if not miss.any():
                    continue
                forced = int((~hit[a:b] & ~on_host[a:b]).sum())
                pos = np.flatnonzero(miss)
                sel = cost.split(counts[a:b][hit[a:b]].tolist(), counts[a:b][pos].tolist(), forced * cost.t_link)
                hosted[a + pos[sel]] = True
        return self._work(layer, counts, hit, ~on_host, hosted)

    def _decide(self, rule, spec: SpecConfig, unions: list, max_drafts: list, rate: "float | None") -> tuple:
        """The rule's k for this step from each candidate's price under the residency now (plus what its extra loads
        displace). Returns k, the price of the chosen verify step, and its draft seconds."""
        dev, host = self._masks()
        work = [self.peek(u, dev, host) for u in unions]
        verify = price_steps(self.ps.cost.profile, self.ps.cost.params, self._nbytes(), self.L,
                             *(np.concatenate([w[i] for w in work]) for i in range(4)))
        inp = SpecInputs.build((verify + self._displacement(work)).tolist(), spec.draft, self.L,
                               [spec.acceptance] * len(max_drafts), max_drafts, rate)
        k = rule.choose(inp).k
        return k, float(verify[k]), inp.draft_seconds[k]

    def _tier_full(self) -> bool:
        return all(len(p.resident) >= p.capacity for p in self.ps.place.unique_pools("device"))

    def _displacement(self, work: list) -> np.ndarray:
        """What each candidate's extra loads cost later: every expert it moves beyond the k = 0 step displaces a
        resident, which is needed again with the probability the device tier has been hitting (once full) - the
        estimate the prefetch gate prices a displaced resident with (cache_policy/prefetch.py). Seconds per
        candidate: extra moves x that probability x one copy."""
        if not self._tier_full() or not self.seen[1]:
            return np.zeros(len(work))
        q = self.seen[0] / self.seen[1]
        moved = np.array([float(w[1].sum()) for w in work])
        return np.maximum(moved - moved[0], 0.0) * q * self.ps.cost.t_link

    def _work(self, layer, counts, hit, disk, hosted) -> tuple:
        L = self.L
        devside = ~hosted
        C = np.bincount(layer, weights=self.devtab[counts] * devside, minlength=L)
        h2d = np.bincount(layer, weights=(devside & ~hit).astype(np.float64), minlength=L)
        dk = np.bincount(layer, weights=disk.astype(np.float64), minlength=L)
        H = np.bincount(layer, weights=self.hosttab[counts] * hosted, minlength=L)
        return C, h2d, dk, H

    def execute(self, u: tuple, t: int) -> tuple:
        """The step through placement (which updates residency); its layer work from what placement did, as
        replay's projection reads it: device compute of the experts not computed on the host, experts crossing
        host->device = needed - device hits - host-computed, disk reads = host misses."""
        keys, counts, w = u
        place, L = self.ps.place, self.L
        cuts = np.searchsorted(keys, self.bounds).tolist()
        kl, cl = keys.tolist(), counts.tolist()
        wl = w.tolist() if w is not None else None
        dct = np.bincount(keys // self.E, weights=self.devtab[counts], minlength=L)
        C, h2d, dk, H = dct.copy(), np.zeros(L), np.zeros(L), np.zeros(L)
        for l in range(L):
            a, b = cuts[l], cuts[l + 1]
            if a == b:
                continue
            r = place.access(l, kl[a:b], t, wl[a:b] if wl is not None else None, cl[a:b], 0.0)
            h2d[l], dk[l] = b - a - r.device_hits - r.host_computed, r.disk_loads
            self.seen[0] += r.device_hits
            self.seen[1] += b - a
            if r.host_computed:
                hk = set(place.last_host)
                hc = [c for kk, c in zip(kl[a:b], cl[a:b]) if kk in hk]
                C[l] -= float(self.devtab[hc].sum())
                H[l] = float(self.hosttab[hc].sum())
        place.end_step()
        return np.maximum(C, 0.0), h2d, dk, H

    def run(self, rule, spec: SpecConfig) -> dict:
        t0 = time.perf_counter()
        tr, B, K, L = self.trace, self.batch, self.k_cap, self.L
        so = tr.seq_offsets
        rng = np.random.default_rng(spec.seed)
        pos = so[:-1].copy()
        active: list = []
        nxt, t = 0, 0
        ks, emitted, drafted, accepted, experts, draft_s = [], 0, 0, 0, 0, 0.0
        going = GoingRate()            # what the live engine measures: tokens/s since the device tier filled
        self.rejected = 0              # verify steps of a request that ended in a rejection
        acc = spec.acceptance
        while nxt < tr.num_sequences or active:
            while len(active) < B and nxt < tr.num_sequences:
                active.append(nxt)
                nxt += 1
            seqs = np.asarray(active)
            p, left = pos[seqs], so[seqs + 1] - pos[seqs]
            offs = np.arange(K + 1)
            toks = p[:, None] + offs[None, :]
            valid = offs[None, :] < left[:, None]
            unions = [self.union(toks[:, :k + 1][valid[:, :k + 1]]) for k in range(K + 1)]
            k, priced, d_s = 0, None, 0.0
            if K > 0 and (going.ready or not rule.needs_rate):
                k, priced, d_s = self._decide(rule, spec, unions, np.minimum(left - 1, K).tolist(),
                                              going.rate_for(len(seqs)))
            draft_s += d_s
            warm = self._tier_full()
            kd = np.minimum(left - 1, k)
            got = np.array([acc.sample(int(n), rng.random(int(n))) for n in kd], dtype=np.int64)
            u = unions[k]
            if spec.rejected == "other" and (got < kd).any():
                # positions past each request's accepted drafts route like an unrelated token
                wrong = (offs[None, :k + 1] > got[:, None]) & valid[:, :k + 1]
                tk = toks[:, :k + 1].copy()
                tk[wrong] = (tk[wrong] + tr.num_tokens // 2) % tr.num_tokens
                u = self.union(tk[valid[:, :k + 1]])
            self.work.append(self.execute(u, t))
            step_s = float(price_steps(self.ps.cost.profile, self.ps.cost.params, self._nbytes(), L, *self.work[-1])[0])
            going.observe(len(seqs), int((got + 1).sum()), step_s + d_s, warm)
            self.priced.append(priced)
            experts += len(u[0])
            pos[seqs] += got + 1
            ks.append(k)
            emitted += int((got + 1).sum())
            drafted += int(kd.sum())
            self.rejected += int((got < kd).sum())
            accepted += int(got.sum())
            active = [s for s in active if pos[s] < so[s + 1]]
            t += 1
        return self._summary(ks, emitted, drafted, accepted, experts, draft_s, time.perf_counter() - t0)

    def _nbytes(self) -> int:
        return self.ps.size["bytes"]

    def _summary(self, ks, emitted, drafted, accepted, experts, draft_s, wall) -> dict:
        L, n = self.L, len(ks)
        arr = [np.concatenate([w[i] for w in self.work]) for i in range(4)]
        steps_s = price_steps(self.ps.cost.profile, self.ps.cost.params, self._nbytes(), L, *arr)
        verify_s = float(steps_s.sum())
        total = verify_s + draft_s
        if emitted != self.trace.num_tokens:
            raise RuntimeError(f"speculative replay emitted {emitted} tokens for a trace of {self.trace.num_tokens}")
        gaps = [abs(p - s) / s for p, s in zip(self.priced, steps_s.tolist()) if p is not None and s > 0]
        h2d = float(arr[1].sum())
        return {"steps": n, "seconds": total, "verify_seconds": verify_s, "draft_seconds": draft_s,
                "tokens_per_s": emitted / total, "mean_k": float(np.mean(ks)),
                "k_histogram": np.bincount(ks, minlength=self.k_cap + 1).tolist(),
                "steps_without_speculation": float(np.mean(np.asarray(ks) == 0)),
                "drafted": drafted, "accepted": accepted,
                # accepted / drafts judged (the first rejection ends a request's step: drafts after it are never
                # judged), an estimate of the per-draft acceptance rate
                "acceptance_realized": accepted / (accepted + self.rejected) if drafted else None,
                "experts_per_layer_per_step": experts / (n * L),
                "h2d_bytes_per_token": h2d * self._nbytes() / emitted,
                "rule_price_error": float(np.mean(gaps)) if gaps else None, "wall_seconds": wall}


def project(trace: Trace, cfg: ReplayConfig, batch: int, spec: SpecConfig) -> "tuple[dict, PlacementSetup]":
    """One pass over the trace with the spec's rule (k_max = 0: no speculation, exactly replay's schedule), through
    fresh tiers. Returns the run's summary and its tiers."""
    check_replay_config(cfg)
    if not isinstance(batch, (int, np.integer)) or isinstance(batch, bool) or batch < 1:
        raise ValueError(f"--batch sizes must be positive integers, got {batch!r}")
    if spec.k_max > K_MAX_LIMIT:
        raise ValueError(f"--num-speculative-tokens must be at most {K_MAX_LIMIT}")
    ps = build_placement(trace, cfg, int(batch))
    return _Run(trace, cfg, int(batch), ps, spec.k_max).run(make_rule(spec.rule, spec.k_max), spec), ps


def speculative_replay(trace: Trace, cfg: ReplayConfig, batch: int, spec: SpecConfig) -> dict:
    """Project tokens/s with and without speculation (k = 0 every step: exactly replay's schedule) at one batch."""
    base, _ = project(trace, cfg, batch, SpecConfig(k_max=0, rule="fixed"))
    sp, ps = project(trace, cfg, batch, spec)
    L, E = trace.num_layers, trace.num_experts
    return {"trace": trace.source, "model": trace.model, "batch": int(batch), "policy": cfg.policy,
            "scope": cfg.scope, "cpu_experts": str(cfg.cpu), "device_capacity": cfg.device_capacity,
            "device_slots": ps.dev_slots, "device_fraction": ps.dev_slots * (L if cfg.scope == "layer" else 1) / (L * E),
            "profile": cfg.cost_profile.name, "expert_bytes": ps.size["bytes"], "expert_size_source": ps.size["source"],
            "speculative": {"rule": spec.rule, "num_speculative_tokens": spec.k_max,
                            "acceptance": list(spec.acceptance.rates), "draft_cost": str(spec.draft), "seed": spec.seed,
                            "rejected_routing": spec.rejected},
            "tokens": trace.num_tokens, "baseline": base, "spec": sp,
            "tokens_per_s_baseline": base["tokens_per_s"], "tokens_per_s_speculative": sp["tokens_per_s"],
            "speedup": sp["tokens_per_s"] / base["tokens_per_s"]}


def format_spec_table(results: list) -> str:
    head = ["batch", "policy", "dev %", "rule", "k max", "draft", "tok/s no spec", "tok/s spec", "speedup",
            "mean k", "k=0 steps", "accepted", "experts/layer/step", "h2d MB/tok"]
    rows = [head]
    for r in results:
        s, sp = r["spec"], r["speculative"]
        acc = "-" if s["acceptance_realized"] is None else f"{s['acceptance_realized']:.2f}"
        rows.append([str(r["batch"]), r["policy"], f"{100 * r['device_fraction']:.0f}", sp["rule"],
                     str(sp["num_speculative_tokens"]), sp["draft_cost"], f"{r['tokens_per_s_baseline']:.2f}",
                     f"{r['tokens_per_s_speculative']:.2f}", f"{r['speedup']:.3f}", f"{s['mean_k']:.2f}",
                     f"{s['steps_without_speculation']:.2f}", acc, f"{s['experts_per_layer_per_step']:.1f}",
                     f"{s['h2d_bytes_per_token'] / 1e6:.1f}"])
    w = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w[i]) if i >= 6 else c.ljust(w[i]) for i, c in enumerate(row)) for row in rows]
    lines.insert(1, "  ".join("-" * x for x in w))
    return "\n".join(lines)
