"""Prefetchers: predict which experts the next layer will need, so they can move ahead of time.

The caller (replay or the live decode loop) calls, for each (step, layer) in order:
  observe(layer, experts, weights, t)      what this layer needed (experts: ascending ids)
  predict(target_layer, experts, budget)   expert ids predicted for ``target_layer``
The target is layer + 1, and for the last layer, layer 0 of the next step. Predictions are
only hints: placement decides what is loaded and what it may evict.

``transition`` learns P(expert j at layer l+1 | expert i at layer l) online, or is fitted on a
training trace (``fit``) and saved to / loaded from a file. ``lookahead`` is the interface the
live model feeds: it applies layer l+1's router to layer l's hidden state; it has no meaning in
replay, which has no hidden states. ``oracle`` knows the future (replay only): the bound.
"""
from __future__ import annotations

import os

import numpy as np


class Prefetcher:
    name = "base"

    def observe(self, layer: int, experts, weights, t: int) -> None:
        pass

    def set_hidden(self, hidden) -> None:
        """The live model's hidden state for the next prediction (only lookahead reads it)."""

    def predict(self, target_layer: int, experts, budget: int) -> list:  # pragma: no cover - interface
        raise NotImplementedError


def _top(scores: np.ndarray, budget: int) -> list:
    """Indices of the `budget` largest positive scores, best first (ties: lower id first)."""
    pos = np.flatnonzero(scores > 0)
    if len(pos) > budget:
        part = pos[np.argpartition(-scores[pos], budget - 1)[:budget]]
        pos = part
    order = np.lexsort((pos, -scores[pos]))
    return pos[order].tolist()


class FreqPrefetcher(Prefetcher):
    """Promotes the hottest experts of the next layer: an EMA of router weight (or token count)
    per (layer, expert), decayed per step by ``ema``."""

    name = "freq"

    def __init__(self, num_layers: int, num_experts: int, ema: float = 0.05) -> None:
        if not 0.0 < ema < 1.0:
            raise ValueError(f"freq prefetcher: ema must be in (0, 1), got {ema!r}")
        self.scores = np.zeros((num_layers, num_experts))
        self.log_g = -np.log1p(-ema)
        self.t0 = 0

    def observe(self, layer, experts, weights, t):
        x = (t - self.t0) * self.log_g
        if x > 600:
            self.scores *= np.exp(-x)
            self.t0, x = t, 0.0
        self.scores[layer, experts] += np.exp(x) * (1.0 if weights is None else np.asarray(weights))

    def predict(self, target_layer, experts, budget):
        return _top(self.scores[target_layer], budget)


class TransitionPrefetcher(Prefetcher):
    """P(j at the next layer | i at this layer), summed over this layer's experts.

    counts[l][i, j]: times expert i at layer l was followed by expert j at layer (l+1) % L (for
    the last layer: layer 0 of the next token). Falls back to popularity for rows never seen.
    """

    name = "transition"

    def __init__(self, num_layers: int, num_experts: int, online: bool = True) -> None:
        self.L, self.E = num_layers, num_experts
        self.counts = np.zeros((num_layers, num_experts, num_experts))  # counts: [L, E, E]
        self.popularity = np.zeros((num_layers, num_experts))
        self.online = online
        self._prev: "tuple[int, np.ndarray] | None" = None

    def observe(self, layer, experts, weights, t):
        experts = np.asarray(experts)
        if self.online:
            self.popularity[layer, experts] += 1
            if self._prev is not None and (self._prev[0] + 1) % self.L == layer:
                pl, pe = self._prev
                self.counts[pl][pe[:, None], experts[None, :]] += 1   # ids are unique within a group
        self._prev = (layer, experts)

    def predict(self, target_layer, experts, budget):
        src = (target_layer - 1) % self.L
        rows = self.counts[src][np.asarray(experts)]          # rows: [n, E]
        tot = rows.sum(1, keepdims=True)
        scores = (rows / np.maximum(tot, 1.0)).sum(0)
        pred = _top(scores, budget)
        if len(pred) < budget:
            pop = self.popularity[target_layer].copy()
            pop[pred] = 0
            pred += _top(pop, budget - len(pred))
        return pred

    def fit(self, trace) -> "TransitionPrefetcher":
        """Count per-token transitions in a training trace (vectorised)."""
        if trace.num_layers != self.L or trace.num_experts != self.E:
            raise ValueError(f"transition fit: trace {trace.source} has {trace.num_layers} layers x "
                             f"{trace.num_experts} experts, the prefetcher {self.L} x {self.E}")
        ids = trace.ids.astype(np.int64)   # ids: [T, L, k]
        E = self.E
        for l in range(self.L):
            if l + 1 < self.L:
                a, b = ids[:, l, :], ids[:, l + 1, :]
            else:  # last layer -> layer 0 of the next token of the same sequence
                nxt = np.ones(len(ids), dtype=bool)
                nxt[trace.seq_offsets[1:] - 1] = False
                a, b = ids[nxt][:, l, :], ids[np.flatnonzero(nxt) + 1][:, 0, :]
            pair = (a[:, :, None] * E + b[:, None, :]).reshape(-1)
            self.counts[l] += np.bincount(pair, minlength=E * E).reshape(E, E)
            self.popularity[l] += np.bincount(ids[:, l, :].reshape(-1), minlength=E)
        return self

    def save(self, path: str) -> None:
        np.savez_compressed(path, counts=self.counts, popularity=self.popularity,
                            num_layers=self.L, num_experts=self.E)

    @staticmethod
    def load(path: str, online: bool = True) -> "TransitionPrefetcher":
        if not os.path.exists(path):
            raise ValueError(f"transition model file {path!r} does not exist")
        try:
            z = np.load(path, allow_pickle=False)
            L, E = int(z["num_layers"]), int(z["num_experts"])
            counts, pop = z["counts"], z["popularity"]
        except Exception as e:  # noqa: BLE001 - any unreadable file gets the same clear message
            raise ValueError(f"{path}: not a transition model saved by tiered-moe ({e})") from None
        if counts.shape != (L, E, E) or pop.shape != (L, E):
            raise ValueError(f"{path}: counts shape {counts.shape} / popularity {pop.shape} do not match {L} layers x {E} experts")
        p = TransitionPrefetcher(L, E, online=online)
        p.counts, p.popularity = counts.astype(np.float64), pop.astype(np.float64)
        return p


class GateLookaheadPrefetcher(Prefetcher):
    """Applies layer l+1's router to layer l's hidden state: the live model supplies
    ``gate_fn(target_layer, hidden) -> expert ids [tokens, k]`` (its ``route_preview``, the router
    code its forward runs) and the caller ``set_hidden``. Experts ranked by how many tokens chose them."""

    name = "lookahead"

    def __init__(self, gate_fn, num_experts: int = 0) -> None:
        if gate_fn is None:
            raise ValueError("prefetch 'lookahead' needs hidden states from a running model "
                             "(tiered-moe generate / regimes --model); replay has none: use freq, transition or oracle")
        self.gate_fn, self.E = gate_fn, num_experts
        self.hidden = None

    def set_hidden(self, hidden) -> None:
        self.hidden = hidden

    def predict(self, target_layer, experts, budget):
        if self.hidden is None:
            return []
        ids = self.gate_fn(target_layer, self.hidden)
        if hasattr(ids, "cpu"):               # a torch tensor, on the model's device
            ids = ids.cpu().numpy()
        ids = np.asarray(ids).reshape(-1)                                       # ids: [tokens * k]
        return _top(np.bincount(ids, minlength=self.E).astype(np.float64), budget)


class OraclePrefetcher(Prefetcher):
    """Knows the next group (replay only): the upper bound for any prefetcher."""

    name = "oracle"

    def __init__(self) -> None:
        self.future = None  # set by replay: callable(target_layer) -> list of expert ids

    def predict(self, target_layer, experts, budget):
        nxt = self.future(target_layer) if self.future else []
        return list(nxt)[:budget]


class PrefetchGate:
    """Cost-aware prefetch: move a predicted expert only when it is expected to pay.

    A prefetch for layer l runs in the link time layer l-1 leaves idle (``free_s``, from the cost
    model); beyond that window it stalls the step for the excess (``spill``, at most one link
    time). If the expert is needed it saves ``saving`` seconds (the demand transfer, or the host
    computing it, whichever the miss would have cost); if not, the spill was wasted. In a full
    pool the move also displaces a resident, which may be needed again (probability ``evict_p``:
    one more transfer). So the i-th candidate is moved when
        p_i x saving > spill_i + evict_p x link + margin x link,
    the expected saving beats the link time it takes from demand loads, by a margin (default 5%
    of a link time): p is an average over all steps, and the steps whose link is idle are not
    average ones - replays of the shared traces lost 0.002% of tokens/s to prefetches that
    cleared the bar by 1-2% (realized precision 0.95 where rank 0 calibrated at 0.99). The displacement is
    charged even when the candidate is needed: replays showed that an always-right (oracle)
    prefetch with a near-full spill still moved more bytes per token than no prefetch, because it
    evicts earlier and in another order than demand loads would. Callers pass the pool's running
    device hit rate as ``evict_p``.

    ``p_i`` is calibrated, not the predictor's raw score: the empirical rate at which the
    predictor's rank-i candidate was needed, shrunk toward 0 by two pseudo-misses (a predictor
    earns trust: with no record p = 0, so nothing moves on the first guesses), learned online
    from every prediction and the routing that followed (``observe``). Scores of different predictors
    (transition probabilities, popularity, gate logits) are not probabilities; their rank's
    track record is, for any predictor. Candidates already resident cost nothing and are skipped.
    """

    def __init__(self, budget: int, link_s: float, saving_s: "float | None" = None, margin: float = 0.05) -> None:
        if budget < 1:
            raise ValueError(f"prefetch budget must be at least 1, got {budget}")
        if not link_s > 0:
            raise ValueError(f"link time per expert must be positive, got {link_s!r}")
        self.link_s = float(link_s)
        self.saving_s = float(link_s if saving_s is None else saving_s)
        if not margin >= 0:
            raise ValueError(f"prefetch margin must be >= 0, got {margin!r}")
        self.margin_s = margin * self.link_s
        # Plain lists: the replay loop calls observe and select once per group, millions of times.
        self.needed = [0] * budget
        self.seen = [0] * budget
        self._p = [0.0] * budget
        self.considered = self.moved = 0

    def probabilities(self) -> list:
        return list(self._p)

    def observe(self, predicted, needed) -> None:
        """``predicted``: the ranked prediction made for a layer; ``needed``: what it then needed."""
        nd, sn, p = self.needed, self.seen, self._p
        for i, e in enumerate(predicted[:len(sn)]):
            sn[i] += 1
            if e in needed:
                nd[i] += 1
            p[i] = nd[i] / (sn[i] + 2.0)

    def select(self, predicted, free_s: float, resident=(), evict_p: float = 0.0) -> list:
        """The candidates worth moving, in rank order."""
        p = self._p
        out = []
        used = 0.0
        link, save, margin = self.link_s, self.saving_s, self.margin_s
        for i, e in enumerate(predicted[:len(p)]):
            if e in resident:
                continue
            self.considered += 1
            spill = min(link, max(0.0, used + link - free_s))
            if p[i] * save > spill + evict_p * link + margin:
                out.append(e)
                used += link
        self.moved += len(out)
        return out


PREFETCHERS = ("none", "freq", "transition", "lookahead", "oracle")
# What the live engine runs: oracle needs the future; lookahead runs the next layer's gate on the
# live hidden state (replay has no hidden state, so it is live-only).
LIVE_PREFETCHERS = ("none", "freq", "transition", "lookahead")


def make_prefetcher(name: str, *, num_layers: int, num_experts: int, fit_trace=None,
                    model_path: "str | None" = None, gate_fn=None, ema: float = 0.05) -> "Prefetcher | None":
    if name not in PREFETCHERS:
        raise ValueError(f"unknown prefetcher {name!r}; choose one of {', '.join(PREFETCHERS)}")
    if name == "none":
        return None
    if name == "freq":
        return FreqPrefetcher(num_layers, num_experts, ema=ema)
    if name == "transition":
        if model_path:
            p = TransitionPrefetcher.load(model_path)
            if (p.L, p.E) != (num_layers, num_experts):
                raise ValueError(f"{model_path}: transition model is {p.L} layers x {p.E} experts, "
                                 f"the trace {num_layers} x {num_experts}")
            return p
        p = TransitionPrefetcher(num_layers, num_experts)
        return p.fit(fit_trace) if fit_trace is not None else p
    if name == "lookahead":
        return GateLookaheadPrefetcher(gate_fn, num_experts)
    return OraclePrefetcher()


class PrefetchController:
    """The one prefetch loop of replay and the live engine: after each MoE layer, predict the next
    layer's experts (any prefetcher, ``lookahead`` on the live model's own router), keep the ones
    the cost rule (``PrefetchGate``) says pay, and learn from what the next layer really needed.
    It decides; the caller (placement in replay, the store live) moves.

    ``observe(layer, experts, weights, t)``: what a layer needed; ``predict(target, experts, hidden)``:
    a ranked list for ``target``; ``select(ranked, idle_link_s, resident, evict_p)``: what to move
    now; ``learn(ranked, needed)``: the outcome, for the precision / recall counts (``predicted``,
    ``correct``, ``needed``) and, with ``calibrate``, the gate's calibration."""

    def __init__(self, name: str, *, num_layers: int, num_experts: int, budget: int, rule: str = "cost",
                 link_s: "float | None" = None, saving_s: "float | None" = None, fit_trace=None,
                 model_path: "str | None" = None, preview=None, ema: float = 0.05) -> None:
        self.name, self.budget = name, budget
        self.pf = make_prefetcher(name, num_layers=num_layers, num_experts=num_experts, fit_trace=fit_trace,
                                  model_path=model_path, gate_fn=preview, ema=ema)
        self.gate = PrefetchGate(budget, link_s, saving_s) if (self.pf is not None and rule == "cost") else None
        self.predicted = self.correct = self.needed = 0

    @property
    def active(self) -> bool:
        return self.pf is not None

    def observe(self, layer: int, experts, weights, t: int) -> None:
        self.pf.observe(layer, experts, weights, t)

    def predict(self, target: int, experts, hidden=None) -> list:
        self.pf.set_hidden(hidden)
        ranked = self.pf.predict(target, experts, max(self.budget, 1))
        self.pf.set_hidden(None)              # the step's activations are not kept past the prediction
        self.predicted += len(ranked)
        return ranked

    def select(self, ranked: list, idle_link_s: float, resident, evict_p: float) -> list:
        if self.gate is None:
            return ranked
        return self.gate.select(ranked, idle_link_s, resident, evict_p)

    def learn(self, ranked: list, needed, calibrate: bool = True) -> None:
        need = needed if isinstance(needed, (set, frozenset)) else set(needed)
        self.correct += sum(1 for x in ranked if x in need)
        self.needed += len(need)
        if calibrate:
            self.calibrate(ranked, need)

    def calibrate(self, ranked: list, needed: set) -> None:
        """The gate learns how often each rank was needed (after its decision)."""
        if self.gate is not None:
            self.gate.observe(ranked, needed)

    def precision_recall(self) -> dict:
        return {"precision": self.correct / self.predicted if self.predicted else None,
                "recall": self.correct / self.needed if self.needed else None}
