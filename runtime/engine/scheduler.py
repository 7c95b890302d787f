"""Continuous batching (nano-vllm's ``scheduler.py``): which requests run this step and which tokens
each feeds, admission by free KV blocks and state slots, preemption by recompute when they run out,
and after the forward, sampling and finishing. It sees the cache only through its ``KVManager``
and never runs the model."""
from __future__ import annotations

import numpy as np

from cache_policy.keys import SCHEDULES

from ..model.layers.cache import Sequence
from .kv_manager import KVManager
from .request import (FinishReason, Request, SchedulerOutput, StepOutput, logprobs_of, process_logits, restrict,
                      sample)


class Scheduler:
    def __init__(self, blocks, *, max_batch: int, max_active: int, prefill_chunk: int,
                 step_tokens: "int | None", schedule: str, num_moe_layers: int, num_experts: int,
                 eos_token_ids=(), prefix_caching: bool = False) -> None:
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {schedule!r}; choose {' or '.join(SCHEDULES)}")
        # The cache's KVManager, or a callable that returns the current one (the engine's: a model
        # whose cache is re-made keeps one truth of what is free).
        self._blocks = blocks
        self.max_batch, self.max_active, self.prefill_chunk = max_batch, max_active, prefill_chunk
        # A layer's experts must fit the device tier when the host does not hold every expert: a
        # step then feeds at most this many tokens (None: no limit).
        self.step_tokens = step_tokens
        self.schedule_kind = schedule
        self.L, self.E = num_moe_layers, num_experts
        self.eos = set(eos_token_ids)
        self.waiting: list = []
        self.running: list = []
        self.preemptions = 0
        # Tensor-parallel ranks (runtime/parallel/group.py): callable(picks) -> rank 0's picks, so every rank
        # applies the tokens one rank sampled. None: a single process.
        self.token_sync = None
        # Prefix caching (KVManager.match / register): a request starts from the cached blocks of its
        # prompt's longest cached prefix. Models with per-sequence state (linear attention, sliding-window rings,
        # DeepSeek-V4's compressor windows) also need the state there: a prompt's prefill is cut at block
        # boundaries where that state is worth keeping (``_boundaries``) and snapshotted there (KVManager.snapshot).
        self.prefix_caching = prefix_caching
        # ... every this many tokens (a whole number of blocks), besides the prompt's last full block and the end
        # of what the cache held when it was admitted (where another request with the same prefix will look); no
        # finer than the prefill chunk, which a boundary would otherwise cut (a prompt's rows per expert)
        self.snapshot_every = max(256, prefill_chunk)
        # callable(request): a request left the running set (finished, failed, preempted, aborted) - speculative
        # decoding's drafter drops what it keeps for it. None: nobody listens.
        self.on_release = None

    @property
    def blocks(self) -> KVManager:
        return self._blocks() if callable(self._blocks) else self._blocks

    def add(self, r: Request) -> None:
        self.waiting.append(r)

    def remove(self, rid: int) -> "Request | None":
        """Take a request out of the queues (abort), freeing its blocks."""
        for q in (self.waiting, self.running):
            for r in list(q):
                if r.id == rid:
                    q.remove(r)
                    self.blocks.release(r.seq)
                    self._released(r)
                    return r
        return None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @staticmethod
    def decoding(r: Request) -> bool:
        return r.recompute is None and r.fed >= len(r.prompt)

    # -- schedule ------------------------------------------------------------------------------
    def schedule(self, step_no: int) -> SchedulerOutput:
        self._admit()
        if not self.running:
            return SchedulerOutput([], [])
        batch = self._choose(step_no) if len(self.running) > self.max_batch else list(self.running)
        chunks, fed = [], []
        budget = None if self.step_tokens is None else \
            self.step_tokens - sum(1 + r.refeed for r in batch if self.decoding(r))
        for r in batch:
            if r not in self.running:
                continue              # preempted below for an earlier request of this step
            chunk = self._next_chunk(r, budget)
            if chunk is None:
                continue              # no room left in this step's token budget: next step
            # KV blocks for this chunk; when none are free, preempt the newest running request
            # (vLLM's recompute: its blocks are freed, it is fed again later) - possibly this one.
            while not self.blocks.ensure(r.seq, r.seq.length + len(chunk)):
                victim = max(self.running, key=lambda x: (x.arrival, x.id))
                self._preempt(victim)
                if victim in fed:          # already given a chunk this step: take it back
                    j = fed.index(victim)
                    del fed[j], chunks[j]
                if victim is r:
                    break
            if r not in self.running:
                continue
            if budget is not None and not self.decoding(r):
                budget -= len(chunk)
            chunks.append(chunk)
            fed.append(r)
        return SchedulerOutput(fed, chunks)

    def _admit(self) -> None:
        """Admission by free KV blocks: a waiting request joins when its whole (re)prefill fits now."""
        free, seqs = self.blocks.free_blocks, self.blocks.free_sequences   # seqs None: no per-sequence state
        while self.waiting and len(self.running) < self.max_active:
            r = self.waiting[0]
            if self.prefix_caching and self._prefix_in_flight(r):
                break                     # its prefix is being computed by a running request: wait for its blocks
            need = self.blocks.blocks_for(len(r.recompute or r.prompt) + 1)
            if (need > free or seqs == 0) and self.running:
                break
            free -= need                  # promised to this request, allocated chunk by chunk
            if seqs is not None:
                seqs -= 1
            self.running.append(self.waiting.pop(0))
            # prompt_logprobs need every prompt position's logits: such a request computes its whole prompt (vLLM's)
            hit = self.blocks.match(r.seq, r.recompute if r.recompute is not None else r.prompt, r.cache_salt) \
                if self.prefix_caching and r.params.prompt_logprobs is None else 0
            if hit:
                r.fed = hit               # the cached prefix is in the cache already: feed the rest
            if r.cached_tokens is None:
                r.cached_tokens = hit     # what usage reports: the first admission's (vLLM's num_cached_tokens)

    def _prefix_in_flight(self, r: Request) -> bool:
        """Whether a running request still feeding its prompt starts with the same first block as ``r``:
        admitted now, ``r`` would compute that prefix again; a few steps later it finds it cached (a burst of
        chat requests with one system prompt computes it once)."""
        bs = self.blocks.block_size
        src = r.recompute if r.recompute is not None else r.prompt
        if (self.blocks.state_slots and not self.blocks.snapshots) or len(src) <= bs:
            return False
        head = src[:bs]
        # another salt's prefix is not waited for: the wait would tell that someone is sending it
        return any(not self.decoding(x) and x.cache_salt == r.cache_salt
                   and (x.recompute if x.recompute is not None else x.prompt)[:bs] == head
                   and x.fed < len(x.recompute if x.recompute is not None else x.prompt) for x in self.running)

    def _next_chunk(self, r: Request, budget: "int | None") -> "list | None":
        if self.decoding(r):
            # output[-1], after the kept tokens a rolled-back state must see again (speculative decoding)
            return r.output[-1 - r.refeed:]
        src = r.recompute if r.recompute is not None else r.prompt
        n = self.prefill_chunk if budget is None else min(self.prefill_chunk, budget)
        if n > 0 and self._snapshots():
            n = min(n, min((b for b in self._boundaries(r, src) if b > r.fed), default=len(src)) - r.fed)
        return src[r.fed:r.fed + n] if n > 0 else None

    def _snapshots(self) -> bool:
        return self.prefix_caching and bool(self.blocks.snapshots)

    def _boundaries(self, r: Request, src: list) -> list:
        """Where a prompt's state is snapshotted (its prefill chunks end there): every ``snapshot_every`` tokens,
        the end of what the cache held at its admission (a burst sharing a system prompt: the next request finds
        the state where the shared blocks end) and its last full block (a repeated prompt, n choices, the next
        turn of a chat) - block boundaries short of the prompt's last token."""
        bs = self.blocks.block_size
        every = -(-self.snapshot_every // bs) * bs
        last = (len(src) - 1) // bs * bs
        return [b for b in (r.seq.cached_to, last) if 0 < b] + list(range(every, last, every))

    def _preempt(self, r: Request) -> None:
        """Free a running request's KV blocks; it waits at the head of the queue and is fed again
        (prompt + what it generated so far, without sampling) when blocks are free."""
        self.running.remove(r)
        self.blocks.release(r.seq)
        r.seq = Sequence()
        r.fed = 0
        r.recompute = (r.prompt + r.output[:-1]) if r.output else None
        r.refeed = 0
        r.preemptions += 1
        self._released(r)
        self.preemptions += 1
        self.waiting.insert(0, r)

    def _choose(self, step_no: int) -> list:
        """Expert-aware batching: max_batch of the active requests, grouped by the overlap of the
        experts their last token used. The request that has waited longest since it last ran
        seeds the group (and any request left out for ``4 * max_active / max_batch`` steps is
        taken first), so nobody starves; then, one at a time, the request whose last experts are
        most covered by the group's union joins."""
        offs = np.arange(self.L)[:, None] * self.E
        starve = 4 * self.max_active // self.max_batch
        order = sorted(self.running, key=lambda r: r.last_step)
        chosen = [r for r in order if step_no - r.last_step > starve][: self.max_batch] or order[:1]
        union: set = set()
        sets = {r.id: set((r.routing[-1][-1] + offs).reshape(-1).tolist()) if r.routing else set()
                for r in self.running}
        for r in chosen:
            union |= sets[r.id]
        rest = [r for r in order if r not in chosen]
        while len(chosen) < self.max_batch and rest:
            # Requests still in prefill have no experts yet: they score 0 and join by age.
            best = max(rest, key=lambda r: (len(sets[r.id] & union) / len(sets[r.id]) if sets[r.id] else 0.0))
            chosen.append(best)
            rest.remove(best)
            union |= sets[best.id]
        return chosen

    # -- after the forward -----------------------------------------------------------------------
    def fail(self, r: Request, message: str) -> StepOutput:
        """End one request with an error; its slots are freed, the engine goes on."""
        if r in self.running:
            self.running.remove(r)
        self.blocks.release(r.seq)
        self._released(r)
        # a grammar that fails while generating (a limit of its own hit) is the request's error, not the engine's
        reason = FinishReason.REJECTED if getattr(r.matcher, "failed", False) else FinishReason.ERROR
        r.finished, r.finish_reason, r.error = True, reason, message
        return StepOutput(r.id, None, True, reason, message)

    def postprocess(self, sched: SchedulerOutput, logits, now: float) -> "tuple[list, list, int]":
        """Advance each request by its chunk, sample where its prompt is done, finish on a stop token
        or max_tokens. Returns (outputs, ended requests, requests failed while sampling)."""
        out, ended, failed = [], [], 0
        sampled = [self._advance(r, len(c)) for r, c in zip(sched.requests, sched.chunks)]
        # logits None: a pipeline stage without the head - the last stage's picks arrive through token_sync
        picks = [self._pick(r, lg) if s else None for r, lg, s in zip(sched.requests, logits, sampled)] \
            if logits is not None else [None] * len(sampled)
        if self.token_sync is not None:
            picks = self.token_sync(picks)
        if self.prefix_caching:
            bs = self.blocks.block_size
            for r in sched.requests:      # full blocks fed this step join the prefix cache
                if r.seq.length // bs > r.seq.hashed:
                    self.blocks.register(r.seq, r.prompt + r.output, r.cache_salt)
                if self._snapshots() and not self.decoding(r) and r.seq.length % bs == 0:
                    src = r.recompute if r.recompute is not None else r.prompt
                    if r.seq.length in self._boundaries(r, src):
                        self.blocks.snapshot(r.seq, src, r.cache_salt)      # the state after this step's chunk
        for r, s, pick in zip(sched.requests, sampled, picks):
            if not s:
                out.append(StepOutput(r.id, None))
                continue
            tok, err, lp, plp = pick
            if err is not None:        # this request alone
                out.append(self.fail(r, err))
                ended.append(r)
                failed += 1
                continue
            if r.first_token_time is None:
                r.first_token_time = now
            r.output.append(tok)
            if plp is not None:
                r.prompt_logprobs = plp             # the sampling rank's (a pipeline's first stage computed none)
            p = r.params
            grammar_done = False
            if r.matcher is not None and not (tok in self.eos and not p.ignore_eos) and tok not in p.stop_token_ids:
                try:
                    r.matcher.take(tok)             # the token every rank applies (after token_sync)
                    grammar_done = r.matcher.done()
                except Exception as e:  # noqa: BLE001 - this request alone
                    r.output.pop()
                    out.append(self.fail(r, f"{type(e).__name__}: {e}"))
                    ended.append(r)
                    failed += 1
                    continue
            if r.armed is not None and tok == p.trigger[0]:
                r.matcher, r.armed = r.armed, None  # what follows the trigger token is the grammar's
            # ignore_eos ignores the model's EOS, not the stop token ids a request names (vLLM's meaning)
            if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos) or grammar_done:
                r.finished, r.finish_reason = True, FinishReason.STOP
            elif len(r.output) >= p.max_tokens:
                r.finished, r.finish_reason = True, FinishReason.LENGTH
            out.append(StepOutput(r.id, tok, r.finished, r.finish_reason, logprobs=lp,
                                  cached_tokens=r.cached_tokens if len(r.output) == 1 else None, prompt_logprobs=plp))
            if r.finished:
                self.finish(r)
                ended.append(r)
        return out, ended, failed

    def finish(self, r: Request) -> None:
        """A finished request leaves the running set; its blocks and state slot are freed."""
        self.running.remove(r)
        self.blocks.release(r.seq)
        self._released(r)

    def _released(self, r: Request) -> None:
        if self.on_release is not None:
            self.on_release(r)

    def _pick(self, r: Request, logits) -> tuple:
        """(token, None, logprobs or None, prompt logprobs or None) or (None, why sampling failed, None, None). The
        prompt's log-probabilities travel with the first token (what ``token_sync`` hands every rank)."""
        try:
            p = r.params
            x = restrict(process_logits(logits, p, r.prompt, r.output), p, len(r.output), self.eos)
            if r.matcher is not None:
                x = r.matcher.mask(x)                    # only what the grammar allows next
            tok = sample(x, p, r.gen)
            plp = list(r.prompt_logprobs) if r.prompt_logprobs is not None and not r.output else None
            return tok, None, (logprobs_of(logits, tok, p.logprobs) if p.logprobs is not None else None), plp
        except Exception as e:  # noqa: BLE001 - fails this request alone
            return None, f"{type(e).__name__}: {e}", None, None

    @staticmethod
    def _advance(r: Request, n: int) -> bool:
        """Count ``n`` fed tokens; True when this step's logits are to be sampled."""
        if r.recompute is not None:
            r.fed += n
            if r.fed >= len(r.recompute):       # context rebuilt: decoding resumes with output[-1]
                r.recompute, r.fed = None, len(r.prompt)
            return False
        if r.fed < len(r.prompt):
            r.fed += n
            return r.fed >= len(r.prompt)
        r.refeed = 0                            # the kept tokens were fed again with output[-1]
        return True
