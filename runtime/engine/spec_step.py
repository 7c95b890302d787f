"""Speculative decoding inside the engine's step (speculative.py has the drafters and the acceptance rules).

``SpecStep.plan`` extends the scheduled step: each decoding request that may speculate gets k drafts (``choose_k``)
and feeds [output[-1], d1..dk] instead of [output[-1]] - beside the other requests' prefill chunks and plain decode
tokens, in the same forward. Every row of a verify chunk has its logits computed (the model's every_token path).
``SpecStep.postprocess`` then accepts per request (greedy: equal to the target's pick; sampling: the accept / reject
rule), appends the kept drafts and the target's token one by one with the stop / EOS / max_tokens checks of plain
decoding (nothing after a stop is emitted), and rolls the rest back:

- paged KV: ``seq.length`` goes back to the kept tokens; the rows past it are garbage the next feed overwrites (the
  blocks stay with the sequence). The prefix cache registers only blocks below that length: all kept tokens.
- per-sequence state (linear attention, sliding-window rings, DeepSeek-V4's compressors): the forward updates it in
  place, so before it the state is copied to a scratch slot; when a draft was rejected the sequence takes the scratch
  slot (the state before the step), ``seq.length`` goes back to where the step started and the kept tokens are fed
  again with the next token (``Request.refeed``): their rows are rewritten identically. Cost: one state copy per
  verify chunk, and a rejection feeds the kept tokens twice.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch

from ..model.layers.context import StepHooks
from . import mtp_drafter, spec_cost, spec_draft  # noqa: F401 - they register DRAFTERS["mtp"], DRAFTERS["draft"]
from .request import (SAMPLING_EPS, FinishReason, Request, SchedulerOutput, StepOutput, distribution, logprobs_of,
                      process_logits, restrict, sample)
from .speculative import Draft, SpecOptions, accept_sampled, choose_k, make_drafter, plain_reason


@dataclass
class Verify:
    """One request's verify chunk this step: ``pending`` tokens (output[-1] after the kept tokens fed again) then the
    draft; ``start`` its sequence's length before the step; ``scratch`` the state slot holding its state from then
    (models with per-sequence state)."""
    r: Request
    pending: int
    draft: Draft
    start: int
    scratch: "int | None" = None
    accepted: int = 0


@dataclass
class SpecPlan:
    verifies: dict = field(default_factory=dict)      # id(seq) -> Verify
    rows: dict = field(default_factory=dict)          # id(seq) -> [(first row, logits [rows, vocab])]
    hidden: dict = field(default_factory=dict)        # id(seq) -> normed hidden [rows, hidden] (wants_hidden)


class SpecStep:
    def __init__(self, engine, spec: SpecOptions, scratch: list) -> None:
        self.engine, self.spec, self.k_max = engine, spec, spec.num_speculative_tokens
        self.drafter = make_drafter(engine, spec)
        self.scratch = list(scratch)          # free scratch state slots (taken out of the sequences' slots at start)
        engine.scheduler.on_release = self.drafter.release

    @property
    def active(self) -> bool:
        """Speculation runs on one process with the head here: not under tensor / pipeline parallelism (every rank
        would have to draft and accept alike)."""
        e = self.engine
        return not (e.fail_fast or e.routing_sync is not None or e.scheduler.token_sync is not None
                    or getattr(e.model, "pipe", None) is not None)

    # -- before the forward ------------------------------------------------------------------------------------
    def plan(self, sched: SchedulerOutput) -> "tuple[SchedulerOutput, SpecPlan]":
        """The step with drafts appended to the chunks of the decoding requests that may speculate."""
        plan = SpecPlan()
        if not self.active:
            return sched, plan
        sch = self.engine.scheduler
        cands = [r for r in sched.requests if sch.decoding(r) and plain_reason(r.params, r) is None
                 and r.params.max_tokens - len(r.output) > 1]
        if not cands:
            return sched, plan
        ks = choose_k(self.engine, cands, self.k_max)
        # a draft past max_tokens could never be emitted; the step's token budget (experts that fit the device) caps
        # the drafts of the step
        ks = [max(0, min(int(k), self.k_max, r.params.max_tokens - len(r.output) - 1)) for r, k in zip(cands, ks)]
        room = None if sch.step_tokens is None else sch.step_tokens - sched.tokens
        chosen = [(r, k) for r, k in zip(cands, ks) if k > 0]
        drafts = self.drafter.propose([r for r, _ in chosen], [k for _, k in chosen]) if chosen else []
        chunks = list(sched.chunks)
        try:
            self._attach(sched, chunks, chosen, drafts, room, plan)
        except BaseException:
            self.abandon(plan)           # scratch slots taken so far go back
            raise
        return SchedulerOutput(sched.requests, chunks), plan

    def _attach(self, sched: SchedulerOutput, chunks: list, chosen: list, drafts: list, room, plan: SpecPlan) -> None:
        """Append each draft to its request's chunk (in ``chunks``) where blocks and a scratch slot allow."""
        for (r, k), d in zip(chosen, drafts):
            d = d if len(d.tokens) <= k else Draft(d.tokens[:k], None if d.probs is None else d.probs[:k])
            if room is not None:
                d = d if len(d.tokens) <= room else Draft(d.tokens[:room], None if d.probs is None else d.probs[:room])
            j = sched.requests.index(r)
            if not d.tokens or not self._room(r, len(chunks[j]) + len(d.tokens)):
                continue
            v = Verify(r, len(chunks[j]), d, r.seq.length)
            if r.seq.state is not None:          # the state before the step, kept in a scratch slot
                v.scratch = self.scratch.pop()
                self.engine.kv.copy_state(r.seq.state, v.scratch)
            plan.verifies[id(r.seq)] = v
            chunks[j] = list(chunks[j]) + [int(t) for t in d.tokens]
            if room is not None:
                room -= len(d.tokens)

    def _room(self, r: Request, n: int) -> bool:
        """Blocks for ``n`` tokens from r's length, and a scratch slot where it has state (no preemption for a draft:
        without room it decodes plainly)."""
        if r.seq.state is not None and not self.scratch:
            return False
        return self.engine.kv.ensure(r.seq, r.seq.length + n)

    def hooks(self, hooks: StepHooks, plan: SpecPlan) -> StepHooks:
        """The step's hooks, also hearing every row's logits of the verify chunks (and, for a drafter that reads
        them, every sequence's normed hidden states)."""
        if plan.verifies:
            inner = hooks.token_logits

            def token_logits(seq, row, logits, _inner=inner):
                if id(seq) in plan.verifies:
                    plan.rows.setdefault(id(seq), []).append((row, logits))
                elif _inner is not None:
                    _inner(seq, row, logits)
            hooks = replace(hooks, every_token=tuple(hooks.every_token) + tuple(v.r.seq for v in plan.verifies.values()),
                            token_logits=token_logits)
        if self.active and self.drafter.wants_hidden:
            hooks = replace(hooks, token_hidden=lambda seq, row, h: plan.hidden.__setitem__(id(seq), h))
        return hooks

    def after_step(self, reqs: list, rec) -> None:
        """The step's figures to the draft-length rule's live inputs (spec_cost.py)."""
        spec_cost.observe(self.engine, reqs, rec)

    def abandon(self, plan: SpecPlan) -> None:
        """The step failed: its scratch slots go back to the pool."""
        for v in plan.verifies.values():
            if v.scratch is not None:
                self.scratch.append(v.scratch)
        plan.verifies.clear()

    # -- after the forward -------------------------------------------------------------------------------------
    def postprocess(self, sched: SchedulerOutput, plan: SpecPlan, logits, now: float):
        """The plain requests through the scheduler's postprocess, the verify chunks here. Returns (outputs, ended
        requests, failed count, the step's speculation figures)."""
        sch = self.engine.scheduler
        idx = [j for j, r in enumerate(sched.requests) if id(r.seq) not in plan.verifies]
        plain = SchedulerOutput([sched.requests[j] for j in idx], [sched.chunks[j] for j in idx])
        was_decoding = {id(r): sch.decoding(r) for r in plain.requests}
        pl = None if logits is None else logits[torch.tensor(idx, dtype=torch.long, device=logits.device)]
        out, ended, failed = sch.postprocess(plain, pl, now) if plain.requests else ([], [], 0)
        self._tell_drafter(plain, was_decoding, plan)
        fig = StepFigures()
        for r, c in zip(plain.requests, plain.chunks):
            if was_decoding[id(r)] and len(c) > 1:      # kept tokens fed again: their routing is in the trace once
                fig.refed += len(c) - 1
                if r.routing:
                    r.routing[-1] = r.routing[-1][len(c) - 1:]
        verify_rows = []
        for v in plan.verifies.values():
            verify_rows.append(v.r.routing[-1] if v.r.routing else None)
            o, err = self._verify(v, plan)
            out.extend(o)
            fig.add(v)
            if err:
                failed += 1
            if v.r.finished:
                ended.append(v.r)
        fig.unique = _mean_unique([a for a in verify_rows if a is not None])
        return out, ended, failed, fig

    def _tell_drafter(self, plain: SchedulerOutput, was_decoding: dict, plan: SpecPlan) -> None:
        """The drafter hears of the plain requests' steps: a prompt chunk ran, or a decode token was kept (its row:
        the chunk's last)."""
        d = self.drafter
        if not self.active:
            return
        for r in plain.requests:
            if r.finished or r.error is not None:
                continue
            h = plan.hidden.get(id(r.seq))
            if was_decoding[id(r)]:
                d.verified(r, 0, None if h is None else h[-1:])
            elif r.recompute is None:
                d.prefilled(r, h)

    def _verify(self, v: Verify, plan: SpecPlan) -> "tuple[list, bool]":
        """Accept, emit and roll back one verify chunk. Returns (its outputs, whether it failed)."""
        r, sch, k = v.r, self.engine.scheduler, len(v.draft.tokens)
        pieces = sorted(plan.rows.get(id(r.seq), []), key=lambda t: t[0])
        rows = torch.cat([lg for _, lg in pieces])[v.pending - 1:v.pending + k]      # rows: [k + 1, vocab]
        try:
            accepted, tokens = self._accept(r, v.draft, rows)
        except Exception as e:  # noqa: BLE001 - fails this request alone
            self._restore(v)
            return [sch.fail(r, f"{type(e).__name__}: {e}")], True
        r.spec_drafted += k
        r.spec_accepted += accepted
        r.spec_lengths.append(accepted)
        v.accepted = accepted
        out = self._emit(r, tokens, rows)
        if r.routing:     # the trace keeps each kept token's routing once (rejected drafts and rows fed again: not)
            r.routing[-1] = r.routing[-1][v.pending - 1:v.pending + accepted]
        if r.finished:
            self._restore(v)
            sch.finish(r)
            return out, False
        self._rollback(v, accepted, k)
        h = plan.hidden.get(id(r.seq))
        self.drafter.verified(r, accepted, None if h is None else h[v.pending - 1:v.pending + accepted])
        if sch.prefix_caching and r.seq.length // sch.blocks.block_size > r.seq.hashed:
            sch.blocks.register(r.seq, r.prompt + r.output, r.cache_salt)    # blocks of kept tokens only
        return out, False

    def _accept(self, r: Request, draft: Draft, rows: torch.Tensor) -> "tuple[int, list]":
        """(drafts kept, the tokens to emit: the kept drafts then the target's token after them). Position i's
        logits go through the same processing as plain sampling's, with the output as it would be there."""
        p, eos = r.params, self.engine.scheduler.eos
        toks = [int(t) for t in draft.tokens]
        emitted: list = []
        for i in range(len(toks) + 1):
            x = restrict(process_logits(rows[i], p, r.prompt, r.output + emitted), p, len(r.output) + i, eos)
            if i == len(toks):
                return i, emitted + [sample(x, p, r.gen)]            # every draft kept: the bonus token
            if p.temperature < SAMPLING_EPS:
                tok = sample(x, p, r.gen)
                if tok != toks[i]:
                    return i, emitted + [tok]
            else:
                probs = distribution(x, p)
                if not bool(torch.isfinite(probs).all()) or not probs.sum() > 0:
                    return i, emitted + [sample(x, p, r.gen)]       # degenerate: what plain sampling does there
                q = None if draft.probs is None else draft.probs[i]
                tok = accept_sampled(probs, toks[i], q, r.gen)
                if tok is not None:
                    return i, emitted + [tok]
            emitted.append(toks[i])
        raise AssertionError("unreachable")

    def _emit(self, r: Request, tokens: list, rows: torch.Tensor) -> list:
        """Append tokens to r.output one by one with plain decoding's finish checks; one StepOutput each."""
        p, eos = r.params, self.engine.scheduler.eos
        out = []
        for i, tok in enumerate(tokens):
            r.output.append(tok)
            if tok in p.stop_token_ids or (not p.ignore_eos and tok in eos):
                r.finished, r.finish_reason = True, FinishReason.STOP
            elif len(r.output) >= p.max_tokens:
                r.finished, r.finish_reason = True, FinishReason.LENGTH
            lp = logprobs_of(rows[i], tok, p.logprobs) if p.logprobs is not None else None
            out.append(StepOutput(r.id, tok, r.finished, r.finish_reason, logprobs=lp))
            if r.finished:
                break                         # nothing after a stop is emitted
        return out

    def _rollback(self, v: Verify, accepted: int, k: int) -> None:
        seq = v.r.seq
        if v.scratch is not None and accepted < k:
            # the state has seen rejected drafts: the sequence takes the state from before the step and feeds the
            # kept tokens again (their KV rows are rewritten identically)
            seq.state, v.scratch = v.scratch, seq.state
            seq.length = v.start
            v.r.refeed = v.pending + accepted
        else:
            seq.length = v.start + v.pending + accepted
            v.r.refeed = 0
        self._restore(v)

    def _restore(self, v: Verify) -> None:
        """v's scratch slot back to the pool."""
        if v.scratch is not None:
            self.scratch.append(v.scratch)
            v.scratch = None


@dataclass
class StepFigures:
    """One step's speculation, for its StepRecord."""
    drafted: int = 0
    accepted: int = 0
    refed: int = 0
    lengths: list = field(default_factory=list)
    unique: "float | None" = None

    def add(self, v: Verify) -> None:
        self.drafted += len(v.draft.tokens)
        a = v.accepted
        self.accepted += a
        self.refed += v.pending - 1
        self.lengths.append(a)


def _mean_unique(blocks: list) -> "float | None":
    """Distinct experts per MoE layer (mean over layers) of the routing rows [tokens, L, k] of the verify chunks."""
    if not blocks:
        return None
    A = np.concatenate(blocks)                                                   # A: [tokens, L, k]
    L = A.shape[1]
    return float(np.mean([len(np.unique(A[:, m])) for m in range(L)]))
