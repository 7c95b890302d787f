"""Speculative decoding's cost side: expected accepted tokens, the draft's cost, and the draft-length rule.

A verify step with k drafted tokens per sequence runs k+1 tokens of each sequence through the model: the last
accepted token and the k drafts. Acceptance model (the standard one, Leviathan et al. 2023): drafted token i is
accepted with probability a_i given that drafts 1..i-1 were, and the first rejection ends the step; the target's
own token at the first rejected position (or after the last draft: the bonus token) is always emitted. So a step
emits 1 + sum_{i=1..k} prod_{j<=i} a_j tokens per sequence on average - with one rate a, (1 - a^(k+1)) / (1 - a).

In an offloading runtime the verify step is not free: its k+1 tokens per sequence route to the union of their
experts, and every expert of that union not on the device is moved (or computed on the host). The rule (``CostRule``)
picks, per step, the k in 0..k_max that maximises the expected tokens the step gains over what its time is worth at
the rate decode runs at,

    surplus(k) = E[tokens](k) - rate x (verify_seconds(k) + draft_seconds(k)),

which maximises long-run tokens/s (``SpecInputs.surplus`` says why not the step's own tokens/s, kept as ``RatioRule``
for comparison). ``verify_seconds(k)`` is the step time of this project's cost model (cache_policy/cost_model.py) for
that union under the current residency (``price_steps``); ``rate`` the measured going rate (``GoingRate``); k = 0 -
no speculation - unless a k beats it by a margin. Everything here is pure: the caller (replay,
cache_policy/spec_replay.py; later the live engine) prices the candidates and measures the rate.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from . import cost_model as cm

K_MAX_LIMIT = 16          # drafts per step the rule considers at most (vLLM's num_speculative_tokens rarely exceeds 8)


def _check_rate(v, flag: str, text) -> float:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or not 0.0 <= v <= 1.0:
        raise ValueError(f"{flag}: acceptance rates must be numbers in [0, 1], got {text!r}")
    return float(v)


def expected_tokens_constant(a: float, k: int) -> float:
    """Tokens a verify step with k drafts emits per sequence when each draft is accepted with probability a
    (independently, until the first rejection), the bonus token included: (1 - a^(k+1)) / (1 - a)."""
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


@dataclass(frozen=True)
class Acceptance:
    """Acceptance probability by drafted position: ``rates[i-1]`` = P(draft i accepted | drafts 1..i-1 accepted);
    positions past the list take its last rate. One rate is the usual constant-acceptance model."""
    rates: tuple

    def __post_init__(self) -> None:
        if not isinstance(self.rates, tuple) or not self.rates:
            raise ValueError(f"acceptance: give a non-empty tuple of rates, got {self.rates!r}")
        for r in self.rates:
            _check_rate(r, "acceptance", self.rates)

    @classmethod
    def parse(cls, text, flag: str = "--acceptance") -> "Acceptance":
        """'0.85' (one rate for every position) or '0.9,0.8,0.7' (by position)."""
        try:
            vals = tuple(float(x) for x in str(text).split(",") if x.strip())
        except ValueError:
            raise ValueError(f"{flag}: {text!r} is not a rate or a comma-separated list of rates in [0, 1] "
                             f"(e.g. 0.85 or 0.9,0.8,0.7)") from None
        if not vals:
            raise ValueError(f"{flag}: give a rate in [0, 1] (e.g. 0.85), got {text!r}")
        for v in vals:
            _check_rate(v, flag, text)
        return cls(vals)

    def rate(self, i: int) -> float:
        """Acceptance probability of drafted position i (1-based)."""
        return self.rates[min(i, len(self.rates)) - 1]

    def survival(self, k: int) -> list:
        """P(drafts 1..i all accepted) for i = 0..k (1 for i = 0)."""
        out, p = [1.0], 1.0
        for i in range(1, k + 1):
            p *= self.rate(i)
            out.append(p)
        return out

    def expected_tokens(self, k: int) -> float:
        """Tokens a verify step with k drafts emits per sequence on average (accepted drafts + the target's token)."""
        return float(sum(self.survival(k)))

    def sample(self, k: int, uniforms: Sequence[float]) -> int:
        """Accepted drafts of one verify step with k drafts, given k uniforms in [0, 1): draft i is accepted when
        uniforms[i-1] < rate(i), and the first rejection stops the count."""
        for i in range(1, k + 1):
            if uniforms[i - 1] >= self.rate(i):
                return i - 1
        return k


class AcceptanceTracker:
    """Running acceptance of one request by drafted position (what the live engine keeps per request): counts of
    drafts verified and accepted at each position, shrunk toward a prior rate by ``prior_weight`` pseudo-drafts so
    that a new request starts at the prior and a few steps do not swing it to 0 or 1."""

    def __init__(self, k_max: int, prior: float = 0.7, prior_weight: float = 4.0) -> None:
        if not isinstance(k_max, int) or not 1 <= k_max <= K_MAX_LIMIT:
            raise ValueError(f"k_max must be an integer in [1, {K_MAX_LIMIT}], got {k_max!r}")
        self.prior = _check_rate(prior, "prior", prior)
        if prior_weight < 0:
            raise ValueError(f"prior_weight must be >= 0, got {prior_weight}")
        self.w = float(prior_weight)
        self.tried = [0] * k_max
        self.accepted = [0] * k_max

    def observe(self, drafted: int, accepted: int) -> None:
        """One verify step: ``drafted`` drafts, the first ``accepted`` of them accepted. Positions after the first
        rejection were never judged (their outcome is unknown), so they do not count."""
        if not 0 <= accepted <= drafted <= len(self.tried):
            raise ValueError(f"need 0 <= accepted ({accepted}) <= drafted ({drafted}) <= k_max ({len(self.tried)})")
        for i in range(min(drafted, accepted + 1)):
            self.tried[i] += 1
            self.accepted[i] += i < accepted

    def estimate(self) -> Acceptance:
        return Acceptance(tuple((a + self.w * self.prior) / (n + self.w) if n + self.w > 0 else self.prior
                                for a, n in zip(self.accepted, self.tried)))


class GoingRate:
    """The tokens/s decode runs at, for the rule's surplus, by batch size (the number of requests a step carries):
    tokens over seconds of the steps since the device tier filled. ``ready`` once ``warmup_steps`` of them are in:
    before that there is no rate to judge a draft by - cold steps price every expert as a miss and understate it,
    which makes drafts look cheap - so the caller does not speculate. ``rate_for(batch)`` is None until that batch
    size has ``warmup_steps`` steps (a draining batch passes through sizes once each): the rule then judges by the
    step's own k = 0 rate."""

    def __init__(self, warmup_steps: int = 8) -> None:
        if not isinstance(warmup_steps, int) or warmup_steps < 1:
            raise ValueError(f"warmup_steps must be a positive integer, got {warmup_steps!r}")
        self.warmup = warmup_steps
        self.steps = 0
        self.by_batch: dict = {}       # batch size -> [steps, tokens, seconds]

    def observe(self, batch: int, tokens: float, seconds: float, warm: bool) -> None:
        """One step of ``batch`` requests: tokens emitted, seconds taken, and whether the device tier was full
        (warm) when it ran."""
        if warm:
            self.steps += 1
            got = self.by_batch.setdefault(batch, [0, 0.0, 0.0])
            got[0] += 1
            got[1] += tokens
            got[2] += seconds

    @property
    def ready(self) -> bool:
        return self.steps >= self.warmup

    def rate_for(self, batch: int) -> "float | None":
        got = self.by_batch.get(batch)
        return got[1] / got[2] if got and got[0] >= self.warmup and got[2] > 0 else None


DRAFT_KINDS = ("mtp", "ngram", "model")


@dataclass(frozen=True)
class DraftCost:
    """What drafting k tokens per sequence costs, relative to the non-speculative step (``base_step_s``):
    - ``mtp``: the checkpoint's multi-token-prediction layer, run once per drafted token with the batch's tokens;
      it is one MoE decoder layer whose experts are tiered like the others, so it costs ``fraction`` x the mean
      layer of the k = 0 step (fraction 1: exactly a mean layer);
    - ``ngram``: prompt lookup, free (a string search on the host);
    - ``model``: a smaller draft model, ``fraction`` x the whole k = 0 step per drafted token."""
    kind: str = "mtp"
    fraction: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in DRAFT_KINDS:
            raise ValueError(f"--draft-cost: unknown draft {self.kind!r}; choose one of {', '.join(DRAFT_KINDS)}")
        if not math.isfinite(self.fraction) or self.fraction < 0:
            raise ValueError(f"--draft-cost: the cost fraction must be a finite number >= 0, got {self.fraction!r}")

    @classmethod
    def parse(cls, text, flag: str = "--draft-cost") -> "DraftCost":
        """'mtp' | 'mtp:0.5' | 'ngram' | 'model:0.1'."""
        kind, _, frac = str(text).strip().partition(":")
        if kind not in DRAFT_KINDS:
            raise ValueError(f"{flag}: unknown draft {kind!r} in {text!r}; choose one of {', '.join(DRAFT_KINDS)} "
                             f"(mtp[:FRACTION of a layer], ngram, model:FRACTION of a step)")
        if kind == "model" and not frac:
            raise ValueError(f"{flag}: 'model' needs its cost as a fraction of a step, e.g. model:0.1")
        try:
            f = float(frac) if frac else (0.0 if kind == "ngram" else 1.0)
        except ValueError:
            raise ValueError(f"{flag}: {frac!r} in {text!r} is not a number (the draft's cost fraction)") from None
        if not math.isfinite(f) or f < 0:
            raise ValueError(f"{flag}: the cost fraction must be a finite number >= 0, got {frac!r}")
        return cls(kind, f)

    def seconds(self, k: int, base_step_s: float, num_layers: int) -> float:
        if k <= 0 or self.kind == "ngram":
            return 0.0
        per = base_step_s / num_layers if self.kind == "mtp" else base_step_s
        return k * self.fraction * per

    def __str__(self) -> str:
        return self.kind if self.kind == "ngram" else f"{self.kind}:{self.fraction:g}"


@dataclass(frozen=True)
class SpecInputs:
    """What the rule decides from, by candidate k = 0..k_max (index k): the verify step's time with k+1 tokens per
    sequence, the drafting time of k tokens per sequence, and the tokens the step emits summed over the batch."""
    verify_seconds: tuple
    draft_seconds: tuple
    expected_tokens: tuple
    going_rate: "float | None" = None   # tokens/s the decode has been running at (None: this step's at k = 0)

    def __post_init__(self) -> None:
        n = len(self.verify_seconds)
        if n < 1 or len(self.draft_seconds) != n or len(self.expected_tokens) != n:
            raise ValueError(f"SpecInputs: verify_seconds, draft_seconds and expected_tokens need the same length >= 1 "
                             f"(got {n}, {len(self.draft_seconds)}, {len(self.expected_tokens)})")
        for name in ("verify_seconds", "draft_seconds", "expected_tokens"):
            if any(not math.isfinite(x) or x < 0 for x in getattr(self, name)):
                raise ValueError(f"SpecInputs: {name} must be finite and >= 0, got {getattr(self, name)}")
        if any(v + d <= 0 for v, d in zip(self.verify_seconds, self.draft_seconds)):
            raise ValueError("SpecInputs: a step must take some time (verify + draft seconds > 0)")
        if self.going_rate is not None and not (math.isfinite(self.going_rate) and self.going_rate > 0):
            raise ValueError(f"SpecInputs: going_rate must be a positive tokens/s, got {self.going_rate!r}")

    @classmethod
    def build(cls, verify_seconds: Sequence[float], draft: DraftCost, num_layers: int,
              acceptances: Sequence[Acceptance], max_drafts: Sequence[int],
              going_rate: "float | None" = None) -> "SpecInputs":
        """Inputs for a batch: sequence s has acceptance ``acceptances[s]`` and can take at most ``max_drafts[s]``
        drafts (the tokens it has left to generate, less one); candidate k drafts min(k, max_drafts[s]) for it."""
        K = len(verify_seconds) - 1
        exp = tuple(float(sum(a.expected_tokens(min(k, m)) for a, m in zip(acceptances, max_drafts)))
                    for k in range(K + 1))
        most = max(max_drafts, default=0)
        drafts = tuple(draft.seconds(min(k, most), float(verify_seconds[0]), num_layers) for k in range(K + 1))
        return cls(tuple(float(x) for x in verify_seconds), drafts, exp, going_rate)

    def tokens_per_s(self, k: int) -> float:
        return self.expected_tokens[k] / (self.verify_seconds[k] + self.draft_seconds[k])

    def seconds(self, k: int) -> float:
        return self.verify_seconds[k] + self.draft_seconds[k]

    def surplus(self, k: int) -> float:
        """Tokens the step emits beyond what its time is worth at the going rate: E[tokens](k) - rate x seconds(k).
        Maximising it each step maximises the long-run tokens/s when the rate is the long-run rate (a renewal-reward
        argument, Dinkelbach's method): a step's extra tokens are worth the time they save at the rate decode runs,
        not at this step's own rate - an expensive step judged by its own rate would buy drafts dearer than they
        are worth."""
        rate = self.going_rate if self.going_rate is not None else self.tokens_per_s(0)
        return self.expected_tokens[k] - rate * self.seconds(k)


@dataclass(frozen=True)
class SpecChoice:
    k: int                          # drafts per sequence this step (0: no speculation)
    tokens_per_s: float             # the rule's expected tokens/s at k
    expected_tokens: float          # tokens the step emits (batch sum), expected
    step_seconds: float             # verify + draft seconds at k
    baseline_tokens_per_s: float    # at k = 0


def _choice(inp: SpecInputs, k: int) -> SpecChoice:
    return SpecChoice(k, inp.tokens_per_s(k), inp.expected_tokens[k], inp.verify_seconds[k] + inp.draft_seconds[k],
                      inp.tokens_per_s(0))


class CostRule:
    """Per step, the k in 0..k_max with the largest surplus E[tokens](k) - rate x seconds(k) at the going rate
    (``SpecInputs.surplus``); ties go to the smaller k (fewer experts moved for the same gain). k = 0 is a
    candidate, so under its own model the rule never does worse than no speculation. ``margin``: a k > 0 must beat
    k = 0 by that share of the k = 0 step's tokens - a step's price is an estimate (the drafts' routing, what their
    loads displace), and a gain smaller than its error is noise that costs as often as it pays."""
    name = "cost"
    needs_rate = True          # the caller measures the going rate first (GoingRate) and does not speculate before
    MARGIN = 0.05

    def __init__(self, k_max: int, margin: float = MARGIN) -> None:
        if not math.isfinite(margin) or margin < 0:
            raise ValueError(f"margin must be a finite number >= 0, got {margin!r}")
        self.k_max, self.margin = k_max, margin

    def choose(self, inp: SpecInputs) -> SpecChoice:
        K = min(self.k_max, len(inp.verify_seconds) - 1)
        base = inp.surplus(0)
        best, top = 0, base + self.margin * inp.expected_tokens[0]
        for k in range(1, K + 1):
            s = inp.surplus(k)
            if s > top + 1e-12 * abs(top) + 1e-15:
                best, top = k, s
        return _choice(inp, best)


class RatioRule:
    """Per step, the k with the most expected tokens per second of that step alone (the comparison: it buys drafts
    on expensive steps at that step's own rate; see ``SpecInputs.surplus``)."""
    name = "ratio"
    needs_rate = False

    def __init__(self, k_max: int) -> None:
        self.k_max = k_max

    def choose(self, inp: SpecInputs) -> SpecChoice:
        K = min(self.k_max, len(inp.verify_seconds) - 1)
        best = 0
        for k in range(1, K + 1):
            if inp.tokens_per_s(k) > inp.tokens_per_s(best) * (1 + 1e-12):
                best = k
        return _choice(inp, best)


class FixedRule:
    """k = k_max every step, whatever it costs (what vLLM's num_speculative_tokens does): the comparison."""
    name = "fixed"
    needs_rate = False

    def __init__(self, k_max: int) -> None:
        self.k_max = k_max

    def choose(self, inp: SpecInputs) -> SpecChoice:
        return _choice(inp, min(self.k_max, len(inp.verify_seconds) - 1))


SPEC_RULES = {r.name: r for r in (CostRule, RatioRule, FixedRule)}


def make_rule(name: str, k_max: int, flag: str = "--spec-rule"):
    if name not in SPEC_RULES:
        raise ValueError(f"{flag}: unknown rule {name!r}; choose one of {', '.join(SPEC_RULES)}")
    if not isinstance(k_max, (int, np.integer)) or isinstance(k_max, bool) or not 0 <= k_max <= K_MAX_LIMIT:
        raise ValueError(f"--num-speculative-tokens must be an integer in [0, {K_MAX_LIMIT}], got {k_max!r}")
    return SPEC_RULES[name](int(k_max))


def price_steps(profile: cm.HardwareProfile, params: int, nbytes: int, num_layers: int, compute_s: np.ndarray,
                h2d: np.ndarray, disk: np.ndarray, host_s: np.ndarray) -> np.ndarray:
    """Seconds of each step (arrays [steps * L], per layer: device compute, experts crossing host->device - those
    read from disk included -, experts read from disk, host compute) under the cost model's overlap formula
    (``cost_model.project_step_times``), with nothing prefetched: a verify step is priced like any other step."""
    zero = np.zeros_like(compute_s)
    return cm.project_step_times(profile=profile, params=params, nbytes=nbytes, num_layers=num_layers,
                                 compute_s=compute_s, demand_h2d=h2d, demand_disk=disk, pref_h2d=zero,
                                 pref_disk=zero, host_s=host_s)["overlap"]
