"""The draft length of each live step, by the cost rule of cache_policy/speculation.py with live inputs.

Per step, ``choose_k(engine, reqs, k_max)`` builds the rule's ``SpecInputs`` for the step's decoding requests from
what the engine has measured (``SpecLive``, one per engine: ``engine.spec_live``) and what the store says now:

- expected tokens: each request's running acceptance by drafted position (``AcceptanceTracker``, fed by the
  engine after every verify step), capped by the tokens it has left;
- the going rate: ``GoingRate`` over the steps since the device tier filled (the rule does not speculate before);
- the draft's cost: ``DraftCost`` of the method's kind (mtp / ngram / model) with its fraction measured - the
  drafter's seconds per drafted token over the plain step (model) or over a mean layer of it (mtp); ngram is free;
- the verify step's time: the measured plain (k = 0) step at this batch size, plus the extra seconds the cost
  model (``engine.store.cost``: the profile's compute tables and link time) prices for the larger union of experts
  that k + 1 tokens per sequence route, under the store's residency. The measured plain step anchors the price
  (attention, the dense layers and the profile's error are in it); the cost model supplies only the difference
  between candidates, which is what the rule compares - plus, once verify steps have run, what they took beyond
  that (``SpecLive.residual``: the multi-token forward path, every row's logits, the accept loop - on a CPU a
  2-token forward costs several 1-token decode steps, which no expert table shows), learned per k from the steps
  the rule chose.

The union of experts of k + 1 tokens: per request, the distinct experts of its last k + 1 routed tokens
(``Request.routing``), united over the batch, per MoE layer. Why not a per-layer formula such as
E x (1 - (1 - top_k / E)^(k+1)): that assumes tokens route independently, and consecutive tokens share experts
(the locality this project's caches live on), so it overstates the union; a request's own recent tokens are the
nearest sample of how fast its union grows with tokens. Which of those experts will miss: not the recent tokens'
own residency (they were just used, so they are resident by construction and would price every step as all
hits), but the device tier's measured miss rate over the steps since it filled - zero for a layer whose device
pool holds every expert (``store.resident``), and no move at all for a layer computed from the host tier
(``store.compute_on_host``: its experts are priced at the host compute table).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from cache_policy.speculation import AcceptanceTracker, DraftCost, GoingRate, SpecInputs, make_rule

# The drafter method -> the DraftCost kind that prices it (speculation.DRAFT_KINDS).
DRAFT_KIND = {"ngram": "ngram", "mtp": "mtp", "draft": "model"}
# The draft's cost fraction before anything is measured: an MTP layer costs about one decoder layer; a draft model
# is chosen about a tenth of the target (vLLM's and llama.cpp's usual pairings); n-gram lookup is free.
PRIOR_FRACTION = {"ngram": 0.0, "mtp": 1.0, "model": 0.1}


@dataclass(frozen=True)
class Chosen:
    """The rule's last choice: at ``batch`` requests, k drafts, and the extra seconds the cost model priced for them
    over k = 0 (the residual is what the verify step took beyond the plain step, that price and the drafting)."""
    batch: int
    k: int
    priced_extra: float


@dataclass
class SpecLive:
    """The engine's live speculation figures: the rule, each request's running acceptance, the going rate, the
    plain step's measured seconds by batch size, the drafter's measured seconds and the device tier's hits."""
    method: str                      # "ngram" | "mtp" | "draft"
    rule_name: str = "cost"
    k_max: int = 4
    warmup_steps: int = 8
    prior: float = 0.7               # acceptance a new request starts at (AcceptanceTracker's prior)
    rate: GoingRate = field(init=False)
    trackers: dict = field(default_factory=dict)     # request id -> AcceptanceTracker
    plain: dict = field(default_factory=dict)        # batch -> [warm k = 0 decode steps, their seconds]
    drafted: list = field(default_factory=lambda: [0, 0.0])   # draft tokens proposed, seconds proposing them
    hits: list = field(default_factory=lambda: [0, 0])        # device hits, expert accesses, of warm steps
    seen: dict = field(default_factory=dict)         # request id -> its (spec_drafted, spec_accepted) last seen
    # the verify step's time the cost model does not price (the multi-token forward path, every row's logits, the
    # accept loop): by k, [verify steps, seconds measured - (plain step + priced extra + drafting)]
    residual: dict = field(default_factory=dict)
    last: "Chosen | None" = None                     # what the rule chose last, to learn the residual from
    priced_extra: list = field(default_factory=list)  # the last step's priced extra seconds by candidate k

    def __post_init__(self) -> None:
        if self.method not in DRAFT_KIND:
            raise ValueError(f"--speculative: unknown method {self.method!r}; choose one of {', '.join(DRAFT_KIND)}")
        self.rule = make_rule(self.rule_name, self.k_max)
        self.rate = GoingRate(self.warmup_steps)

    @classmethod
    def from_options(cls, spec) -> "SpecLive":
        """From the engine's SpecOptions (speculative.py): method, rule and k_max."""
        return cls(spec.method, spec.rule, spec.num_speculative_tokens)

    def tracker(self, rid: int) -> AcceptanceTracker:
        t = self.trackers.get(rid)
        if t is None:
            t = self.trackers[rid] = AcceptanceTracker(max(1, self.k_max), prior=self.prior)
        return t

    # -- what the engine reports -----------------------------------------------------------------
    def observe_verify(self, rid: int, drafted: int, accepted: int) -> None:
        """A verify step of request ``rid``: ``drafted`` drafts, the first ``accepted`` kept."""
        if drafted:
            self.tracker(rid).observe(drafted, accepted)

    def observe_draft(self, tokens: int, seconds: float) -> None:
        """The drafter proposed ``tokens`` tokens (all requests of a step) in ``seconds``."""
        self.drafted[0] += int(tokens)
        self.drafted[1] += float(seconds)

    def observe_step(self, batch: int, tokens: int, seconds: float, extra: int, warm: bool,
                     hits: "dict | None" = None) -> None:
        """A decode step of ``batch`` requests: tokens emitted, wall seconds (drafting included), tokens fed beyond
        one per request (drafts, kept tokens fed again after a state rollback; 0: a plain step), whether the device
        tier was full, and its store hits per tier (StepRecord.hits)."""
        self.rate.observe(batch, tokens, seconds, warm)
        if not warm:
            return
        if extra == 0:
            got = self.plain.setdefault(batch, [0, 0.0])
            got[0] += 1
            got[1] += seconds
        if hits:
            self.hits[0] += hits.get("device", 0)
            self.hits[1] += sum(hits.values())

    def observe_residual(self, k: int, seconds: float) -> None:
        got = self.residual.setdefault(k, [0, 0.0])
        got[0] += 1
        got[1] += seconds

    def residual_for(self, k: int) -> float:
        """The mean unpriced seconds of a verify step with k drafts: measured at k, else at the nearest k measured
        (the jump from one token to a multi-token forward is most of it), else 0 (nothing measured yet: the rule
        trusts the cost model until a verify step says otherwise)."""
        if k <= 0:
            return 0.0
        near = min((j for j, g in self.residual.items() if g[0]), key=lambda j: (abs(j - k), j), default=None)
        if near is None:
            return 0.0
        n, secs = self.residual[near]
        return secs / n

    def release(self, rid: int) -> None:
        self.trackers.pop(rid, None)
        self.seen.pop(rid, None)

    # -- what the rule reads ---------------------------------------------------------------------
    def plain_seconds(self, batch: int) -> "float | None":
        """Mean seconds of a warm plain decode step at ``batch`` (the nearest batch size measured, scaled by the
        batch ratio, when this one has none; None before any)."""
        got = self.plain.get(batch)
        if got and got[0]:
            return got[1] / got[0]
        near = min((b for b, g in self.plain.items() if g[0]), key=lambda b: abs(b - batch), default=None)
        if near is None:
            return None
        steps, secs = self.plain[near]
        return secs / steps * batch / near

    def miss_rate(self) -> float:
        return 1.0 - self.hits[0] / self.hits[1] if self.hits[1] else 0.0

    def draft_cost(self, base_s: float, num_layers: int) -> DraftCost:
        """The DraftCost of this method with its fraction measured (the prior until a draft was timed)."""
        kind = DRAFT_KIND[self.method]
        per = self.drafted[1] / self.drafted[0] if self.drafted[0] else None
        if kind == "ngram" or per is None or base_s <= 0:
            return DraftCost(kind, PRIOR_FRACTION[kind])
        unit = base_s if kind == "model" else base_s / num_layers
        return DraftCost(kind, per / unit)


def live_of(engine) -> SpecLive:
    """The engine's SpecLive, made from its SpecOptions (``engine.speculative``) on first use."""
    live = getattr(engine, "spec_live", None)
    if live is None:
        live = engine.spec_live = SpecLive.from_options(engine.speculative)
    return live


def observe(engine, reqs: list, rec) -> None:
    """After each engine step: feed SpecLive what the step measured. ``reqs``: the step's requests (their running
    ``spec_drafted`` / ``spec_accepted`` counters give this step's drafts and kept drafts, one verify step each);
    ``rec``: its StepRecord (tokens fed, seconds, hits, spec_drafted / spec_accepted / spec_refed). A decode step -
    every request fed its last token plus its drafts (and any refed tokens) - is timed for the going rate and, with
    no drafts, as a plain step; a step that carried prompt chunks is not. The drafter's own ``timing``
    (DraftTiming, where it keeps one) gives the draft's measured cost."""
    if rec is None:
        return
    live = live_of(engine)
    seen = live.seen
    for r in reqs:
        d0, a0 = seen.get(r.id, (0, 0))
        d, a = r.spec_drafted - d0, r.spec_accepted - a0
        seen[r.id] = (r.spec_drafted, r.spec_accepted)
        if d > 0:
            live.observe_verify(r.id, min(d, live.k_max), min(a, d, live.k_max))
        if r.finished:
            live.release(r.id)
    timing = getattr(getattr(engine, "drafter", None), "timing", None)
    draft_s = timing.seconds - live.drafted[1] if timing is not None else 0.0      # this step's drafting
    if rec.tokens == rec.batch + rec.spec_drafted + rec.spec_refed and not rec.failed:
        warm = step_warm(engine.store, rec.hits)
        live.observe_step(rec.batch, rec.batch + rec.spec_accepted, rec.seconds, rec.spec_drafted + rec.spec_refed,
                          warm, rec.hits)
        ch, base = live.last, live.plain_seconds(rec.batch)
        if rec.spec_drafted and warm and ch is not None and ch.batch == rec.batch and ch.k and base is not None:
            live.observe_residual(ch.k, rec.seconds - draft_s - base - ch.priced_extra)
    live.last = None
    if timing is not None:
        live.drafted = [timing.tokens, timing.seconds]


def step_warm(store, hits: dict) -> bool:
    """Whether a step ran at the warm rate (GoingRate's ``warm``): it read nothing from disk, and either every
    device pool is full or nothing it needed had to cross to the device (a tier that holds every expert never
    fills; its steps are warm once they stop loading; a layer computed from the host tier moves nothing)."""
    if hits.get("disk", 0):
        return False
    pl = store.placement
    full = all(len(p.resident) >= p.capacity for p in pl.unique_pools("device"))
    return full or not hits.get("host", 0) or all(store.compute_on_host(l) for l in range(store.m.num_layers))


def recent_counts(reqs: list, k_max: int, num_layers: int, num_experts: int) -> np.ndarray:
    """counts [k_max + 1, layers, experts]: row k holds, per MoE layer and expert, the tokens routed to it among the
    last k + 1 routed tokens of each request, summed over the batch (the expected union of a verify step with k
    drafts per sequence; see the module's docstring). One pass for every k: the newest token's counts, then each
    older token's added on (a request with fewer tokens keeps what it has)."""
    L, E = num_layers, num_experts
    out = np.zeros((k_max + 1, L * E), dtype=np.int64)
    offs = (np.arange(L, dtype=np.int64) * E)[None, :, None]
    for r in reqs:
        tail, n = [], 0
        for a in reversed(r.routing):                # routing: per step [tokens, layers, top_k]
            tail.append(a)
            n += len(a)
            if n >= k_max + 1:
                break
        if not tail:
            continue
        ids = np.concatenate(tail[::-1])[-(k_max + 1):][::-1]          # ids: [n <= k_max + 1, L, top_k], newest first
        n = len(ids)
        flat = (ids.astype(np.int64) + offs).reshape(n, -1)             # flat: [n, L * top_k] keys l * E + e
        per = np.zeros((n, L * E), dtype=np.int64)
        np.add.at(per, (np.repeat(np.arange(n), flat.shape[1]), flat.reshape(-1)), 1)
        cum = np.cumsum(per, axis=0)                                   # cum[j]: the newest j + 1 tokens
        out[:n] += cum
        out[n:] += cum[-1]
    return out.reshape(k_max + 1, L, E)


def full_layers(store, num_layers: int) -> list:
    """Per MoE layer, whether its device pool holds every expert now (nothing of it can miss)."""
    E = store.m.num_experts
    return [len(store.resident(l)) >= E for l in range(num_layers)]


def expert_seconds(store, counts: np.ndarray, miss_rate: float, full: "list | None" = None) -> float:
    """The cost model's seconds of the MoE layers' experts for ``counts`` [layers, experts] (tokens per expert):
    each layer's device compute and its expected moves (``miss_rate`` of its experts, none where the device pool
    holds the whole layer: ``full``, from ``full_layers``, asked of the store when not given) through
    ``cost.layer_seconds``; a layer computed on the host at the host table, moving nothing."""
    cost = store.cost
    dev, host = (np.asarray(t) for t in cost.tables(max(1, int(counts.max(initial=0)))))
    if miss_rate > 0 and full is None:
        full = full_layers(store, len(counts))
    # per layer at once (a step prices k_max + 1 candidates): experts used, device and host compute seconds
    used = (counts > 0).sum(1).tolist()
    on_dev, on_host = dev[counts].sum(1).tolist(), host[counts].sum(1).tolist()
    total = 0.0
    for l, n in enumerate(used):
        if not n:
            continue
        if store.compute_on_host(l):
            total += cost.layer_seconds(0.0, 0, on_host[l])
            continue
        moved = 0.0 if miss_rate <= 0 or full[l] else miss_rate * n
        total += cost.layer_seconds(on_dev[l], moved, 0.0)
    return total


def spec_inputs(engine, reqs: list, k_max: int) -> "SpecInputs | None":
    """The rule's inputs for this step's decoding requests (None: nothing to judge by yet - no plain step measured,
    or the rule needs a going rate and it is not ready)."""
    live = live_of(engine)
    batch = len(reqs)
    base = live.plain_seconds(batch)
    if base is None or (live.rule.needs_rate and not live.rate.ready):
        return None
    L = engine.model.cfg.num_moe_layers
    K = min(k_max, live.k_max)
    miss = live.miss_rate()
    counts = recent_counts(reqs, K, L, engine.store.m.num_experts)
    full = full_layers(engine.store, L) if miss > 0 else None        # once per step: a residency scan per layer
    priced = [expert_seconds(engine.store, counts[k], miss, full) for k in range(K + 1)]
    extra = [max(0.0, p - priced[0]) for p in priced]
    verify = [max(0.0, base + x + live.residual_for(k)) for k, x in enumerate(extra)]
    left = [max(0, min(K, r.params.max_tokens - len(r.output) - 1)) for r in reqs]
    acc = [live.tracker(r.id).estimate() for r in reqs]
    inp = SpecInputs.build(verify, live.draft_cost(base, L), L, acc, left, live.rate.rate_for(batch))
    live.priced_extra = extra
    return inp


def choose_k(engine, reqs: list, k_max: int) -> list:
    """Drafts per request this step (0: no speculation): the rule's k for the batch, capped per request by the
    tokens it has left. ``engine``: has ``spec_live`` (SpecLive; made from ``speculative`` if absent), ``store``
    (its ``cost``, ``resident``, ``compute_on_host``, ``m.num_experts``) and ``model.cfg.num_moe_layers``; ``reqs``:
    the step's decoding requests (their ``routing``, ``params.max_tokens``, ``output``, ``id``)."""
    if not reqs or k_max <= 0:
        return [0] * len(reqs)
    live = live_of(engine)
    if live.rule.name == "fixed":      # k = k_max whatever it costs: nothing to measure first
        return [max(0, min(k_max, live.k_max, r.params.max_tokens - len(r.output) - 1)) for r in reqs]
    inp = spec_inputs(engine, reqs, k_max)
    if inp is None:
        return [0] * len(reqs)
    k = live.rule.choose(inp).k
    live.last = Chosen(len(reqs), k, live.priced_extra[k])
    return [max(0, min(k, r.params.max_tokens - len(r.output) - 1)) for r in reqs]
