"""Speculative decoding, the live side: what a drafter proposes (``Draft``), the drafters (``DRAFTERS``), the options
``generate`` / ``serve`` take (``SpecOptions``), and the acceptance rules that keep the target's outputs exact.

A decoding request with drafts d1..dk feeds [output[-1], d1..dk] in one step (the verify chunk); every row's logits
come back, row i being the target's distribution of the token after chunk[i]. Greedy: d_i is kept iff it equals
the target's pick at its position, and the target's pick at the first mismatch (or after the last draft: the bonus
token) is emitted too - so the output is token for token the plain one. Sampling: the accept / reject rule of
Leviathan et al. 2023 / Chen et al. 2023 (``accept_sampled``) - each emitted token is distributed exactly as plain
sampling's. The engine side (spec_step.py) runs the step, applies stop tokens / max_tokens to the emitted tokens one
by one and rolls back what was rejected.

The draft length per step comes from ``choose_k`` (spec_cost.py's cost rule where it exists; here the fixed rule).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from cache_policy.speculation import K_MAX_LIMIT, SPEC_RULES

from . import spec_cost
from .request import Request, SamplingParams, distribution

@dataclass(frozen=True)
class Draft:
    """What a drafter proposes for one request: up to k token ids following r.prompt + r.output."""
    tokens: list
    # [len(tokens), vocab] float32: the draft distribution q each token was sampled from; None: one-hot (the token
    # was picked, not sampled - n-gram lookup, a greedy draft model)
    probs: "torch.Tensor | None" = None


NO_DRAFT = Draft([])


class Drafter(Protocol):
    wants_hidden: bool                 # the target's final hidden states are handed to verified / prefilled

    def propose(self, reqs: list, ks: list) -> list:
        """One Draft per request of ``reqs`` (at most ks[i] tokens; fewer or none where it has nothing)."""

    def verified(self, r: Request, accepted: int, hidden: "torch.Tensor | None") -> None:
        """After each decode step of r (drafts or not): ``accepted`` of its drafts were kept; ``hidden`` [accepted + 1,
        hidden] the target's hidden states after the final norm of the rows kept (the last fed token and each
        accepted draft), None unless wants_hidden."""

    def prefilled(self, r: Request, hidden: "torch.Tensor | None") -> None:
        """A prompt chunk of r ran (``hidden``: its rows' normed hidden states [rows, hidden], or None)."""

    def release(self, r: Request) -> None:
        """r finished, was preempted or aborted: drop what is kept for it."""


@dataclass(frozen=True)
class SpecOptions:
    """The speculative-decoding options of ``generate`` / ``serve`` (vLLM's names where it has them)."""
    method: str                        # --speculative ngram|mtp|draft
    num_speculative_tokens: int        # --num-speculative-tokens K: drafts per step at most (k_max)
    rule: str = "cost"                 # --spec-rule cost|fixed (cache_policy.speculation.make_rule)
    draft_model: "str | None" = None   # --draft-model PATH (method draft)
    ngram_min: int = 1                 # --prompt-lookup-min
    ngram_max: int = 4                 # --prompt-lookup-max

    def __post_init__(self) -> None:
        if self.method not in DRAFTERS:
            raise ValueError(f"--speculative: unknown method {self.method!r}; choose one of {', '.join(DRAFTERS)}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= K_MAX_LIMIT:
            raise ValueError(f"--num-speculative-tokens must be an integer in [1, {K_MAX_LIMIT}], got {k!r}")
        if self.rule not in SPEC_RULES:
            raise ValueError(f"--spec-rule: unknown rule {self.rule!r}; choose one of {', '.join(SPEC_RULES)}")
        for name, v in (("--prompt-lookup-min", self.ngram_min), ("--prompt-lookup-max", self.ngram_max)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"--prompt-lookup-min ({self.ngram_min}) must not exceed --prompt-lookup-max "
                             f"({self.ngram_max})")
        if self.method == "draft":
            if not self.draft_model:
                raise ValueError("--speculative draft needs --draft-model PATH (a store with the same tokenizer)")
            if not os.path.isdir(self.draft_model):
                raise ValueError(f"--draft-model: {self.draft_model!r} is not a directory")
        elif self.draft_model is not None:
            raise ValueError(f"--draft-model is for --speculative draft, not {self.method!r}")


# -- the n-gram drafter -------------------------------------------------------------------------------------------
def ngram_lookup(tokens: list, k: int, n_min: int, n_max: int) -> list:
    """vLLM's prompt lookup: the longest suffix of ``tokens`` of n in [n_min, n_max] tokens that occurred earlier;
    the (up to) k tokens that followed its most recent earlier occurrence. [] when no suffix recurs."""
    L = len(tokens)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        suffix = tokens[L - n:]
        # most recent earlier occurrence: start positions L - n - 1 down to 0 (the suffix itself excluded)
        for s in range(L - n - 1, -1, -1):
            if tokens[s:s + n] == suffix:
                return list(tokens[s + n:s + n + k])
    return []


class NgramDrafter:
    """Drafts by prompt lookup over prompt + output (no model, one-hot q)."""
    wants_hidden = False

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max

    def propose(self, reqs: list, ks: list) -> list:
        return [Draft(ngram_lookup(r.prompt + r.output, k, self.n_min, self.n_max)) if k > 0 else NO_DRAFT
                for r, k in zip(reqs, ks)]

    def verified(self, r, accepted, hidden) -> None:
        pass

    def prefilled(self, r, hidden) -> None:
        pass

    def release(self, r) -> None:
        pass


def _ngram(engine, spec: SpecOptions) -> NgramDrafter:
    return NgramDrafter(spec.ngram_min, spec.ngram_max)


def _not_here(method: str, owner: str) -> Callable:
    def factory(engine, spec: SpecOptions):
        raise ValueError(f"--speculative {method}: the drafter is not built yet ({owner})")
    return factory


# method -> factory(engine, SpecOptions) -> Drafter. The drafters of their own modules register themselves when
# imported (spec_step.py imports them): mtp - the checkpoint's MTP layers (runtime/engine/mtp_drafter.py); draft - a
# smaller model with the same tokenizer (runtime/engine/spec_draft.py).
DRAFTERS: dict = {"ngram": _ngram, "mtp": _not_here("mtp", "MTP layers"), "draft": _not_here("draft", "draft model")}


def make_drafter(engine, spec: SpecOptions):
    return DRAFTERS[spec.method](engine, spec)


# -- the draft length ---------------------------------------------------------------------------------------------
def choose_k(engine, reqs: list, k_max: int) -> list:
    """Drafts per request this step: spec_cost.choose_k - the rule of ``engine.speculative.rule`` (cost: by the
    expected accepted tokens against the verify step's experts under the live residency; fixed: k_max)."""
    return spec_cost.choose_k(engine, reqs, k_max)


# -- which requests may speculate -----------------------------------------------------------------------------------
def plain_reason(p: SamplingParams, r: "Request | None" = None) -> "str | None":
    """Why a request is decoded plainly (k = 0), or None when speculation serves it exactly. A grammar (or a trigger
    that arms one) constrains each position by the matcher's state after the previous tokens, which the drafts
    would have to advance and roll back: not supported. Everything else - penalties, logit_bias, min_tokens, min_p,
    top_k / top_p, allowed_token_ids, logprobs, seeds - is applied per position exactly as plain decoding does."""
    if p.grammar is not None or p.trigger is not None or (r is not None and r.matcher is not None):
        return "structured output (its grammar's matcher is advanced one sampled token at a time)"
    return None


# -- acceptance ---------------------------------------------------------------------------------------------------
@dataclass
class Verdict:
    """The outcome of verifying one request's drafts: ``accepted`` drafts kept, then ``tokens`` = the kept drafts
    followed by the target's token at the first rejected position (or the bonus token after the last draft)."""
    accepted: int
    tokens: list = field(default_factory=list)


def accept_greedy(picks: list, draft: list) -> Verdict:
    """picks[i]: the target's greedy pick after draft[:i] (len(draft) + 1 of them, or fewer: computed lazily by the
    caller up to the first mismatch). A draft is kept iff it equals the pick at its position."""
    a = 0
    while a < len(draft) and a < len(picks) and picks[a] == draft[a]:
        a += 1
    return Verdict(a, list(draft[:a]) + [picks[a]])


def accept_sampled(p: torch.Tensor, d: int, q: "torch.Tensor | None", gen: "torch.Generator | None") -> "int | None":
    """One position of the accept / reject rule. p: [vocab] the target's probabilities, d the draft token, q: [vocab]
    the draft's (None: one-hot at d). Keeps d with probability min(1, p[d] / q[d]) (returns None); else returns a
    token sampled from norm(max(0, p - q)) - so the emitted token is distributed as p."""
    qd = 1.0 if q is None else float(q[d])
    pd = float(p[d])
    u = float(torch.rand((), generator=gen, dtype=torch.float64))
    if qd > 0 and u * qd < pd:             # u < p / q without dividing by a tiny q
        return None
    if q is None:
        res = p.clone()
        res[d] = 0
    else:
        res = (p - q.to(p.dtype)).clamp_min(0)
    s = float(res.sum())
    if not s > 0:                          # p == q (numerically): nothing left to correct with; p itself
        res, s = p, float(p.sum())
    return int(torch.multinomial(res / s, 1, generator=gen))


def target_probs(x: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution plain sampling draws from for processed logits x [vocab] (request.distribution: temperature,
    min_p, top_k, top_p), float64 [vocab]."""
    return distribution(x, p)


# -- what the engine reports --------------------------------------------------------------------------------------
def spec_summary(spec: SpecOptions, requests) -> dict:
    """Speculation over finished requests: drafts proposed / kept, the acceptance rate, the mean kept drafts per
    verify step (the mean accepted length; a verify step emits 1 + that), and the histogram of kept drafts per
    verify step (index i: steps that kept i, 0..k_max)."""
    reqs = list(requests)
    drafted = sum(r.spec_drafted for r in reqs)
    accepted = sum(r.spec_accepted for r in reqs)
    lengths = [a for r in reqs for a in r.spec_lengths]
    hist = [0] * (spec.num_speculative_tokens + 1)
    for a in lengths:
        hist[min(a, spec.num_speculative_tokens)] += 1
    return {"method": spec.method, "num_speculative_tokens": spec.num_speculative_tokens, "rule": spec.rule,
            "drafted_tokens": drafted, "accepted_tokens": accepted, "verify_steps": len(lengths),
            "acceptance_rate": accepted / drafted if drafted else None,
            "mean_accepted_length": accepted / len(lengths) if lengths else None,
            "accepted_length_histogram": hist}


def spec_line(s: "dict | None") -> str:
    """generate's summary line of ``spec_summary`` ('' when speculation is off)."""
    if not s:
        return ""
    if not s["drafted_tokens"]:
        return f"\n[speculative {s['method']}, K={s['num_speculative_tokens']}: nothing drafted]"
    return (f"\n[speculative {s['method']}, K={s['num_speculative_tokens']}, rule {s['rule']}: "
            f"{s['accepted_tokens']} of {s['drafted_tokens']} drafts accepted ({s['acceptance_rate']:.1%}), "
            f"{s['mean_accepted_length']:.2f} per verify step over {s['verify_steps']} steps; "
            f"accepted lengths 0..K: {s['accepted_length_histogram']}]")
