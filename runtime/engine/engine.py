"""The engine: one ``step()`` = schedule, run, postprocess, record (nano-vllm's ``llm_engine.py``).

``Scheduler`` (scheduler.py) decides which requests run and which tokens each feeds, by the free
blocks of the engine's ``KVManager`` (kv_manager.py); the model runs the forward over its cache tensors; the
scheduler samples and finishes; the engine records, per step, batch size, unique experts per MoE
layer, store hits / misses per tier, bytes per link, time stalled waiting for experts and step
time (``StepRecord``), and the routing of every fed token, written as a trace in the
``cache_policy`` format. As soon as each MoE layer has routed (before its experts compute) the
``PrefetchController`` (the one replay runs) predicts the next layer's experts and the store moves those
the cost rule keeps, so their loads overlap this layer's compute. The model hears of the step through
one ``StepHooks`` per forward. With ``speculative`` (spec_step.py) decoding requests feed drafts after their last
token and keep those the target agrees with: several tokens per request per step.
"""
from __future__ import annotations

import time
from dataclasses import replace

import numpy as np

from cache_policy.keys import LINKS, PREFILL_CHUNK, TIERS
from cache_policy.prefetch import LIVE_PREFETCHERS, PrefetchController
from cache_policy.replay import PREFETCH_RULES
from cache_policy.traces import Trace

from ..model.footprint import default_cache_tokens
from ..model.layers.cache import Sequence
from ..model.layers.context import StepHooks
from ..quant import cost_dtype
from .grammar import GrammarBuilds, GrammarTokenizer, build
from .kv_manager import KVManager
from .request import (SAMPLING_EPS, FinishReason, Request, SamplingParams, SchedulerOutput, StepOutput, StepRecord,
                      StepResult, prompt_logprobs_of, sample)
from .scheduler import SCHEDULES, Scheduler
from .spec_step import SpecStep
from .speculative import SpecOptions, spec_summary

__all__ = ["Engine", "FinishReason", "Request", "SamplingParams", "SchedulerOutput", "StepOutput", "StepRecord",
           "StepResult", "sample", "SAMPLING_EPS"]


class Engine:
    def __init__(self, model, store, *, max_batch: int = 16, prefill_chunk: int = PREFILL_CHUNK, prefetch: str = "none",
                 prefetch_budget: "int | None" = None, max_context: "int | None" = None,
                 schedule: str = "fcfs", max_active: "int | None" = None, cache_bonus: float = 0.0,
                 prefetch_rule: str = "cost", keep_records: bool = True, prefix_caching: bool = True,
                 prefix_snapshots: "int | None" = None, speculative: "SpecOptions | None" = None) -> None:
        if max_batch < 1 or prefill_chunk < 1:
            raise ValueError("max_batch and prefill_chunk must be positive")
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {schedule!r}; choose {' or '.join(SCHEDULES)}")
        if max_active is not None and max_active < max_batch:
            raise ValueError(f"max_active ({max_active}) must be at least max_batch ({max_batch})")
        if prefix_snapshots is not None and (not isinstance(prefix_snapshots, int) or prefix_snapshots < 0):
            raise ValueError(f"prefix_snapshots must be a non-negative integer, got {prefix_snapshots!r}")
        if not cache_bonus >= 0:
            raise ValueError(f"cache_bonus must be >= 0, got {cache_bonus!r}")
        if prefetch_rule not in PREFETCH_RULES:
            raise ValueError(f"unknown prefetch rule {prefetch_rule!r}; choose one of {', '.join(PREFETCH_RULES)}")
        if speculative is not None and not isinstance(speculative, SpecOptions):
            raise ValueError(f"speculative must be a SpecOptions or None, got {type(speculative).__name__}")
        if prefetch not in LIVE_PREFETCHERS:
            raise ValueError(f"unknown prefetch {prefetch!r}; the live engine takes {', '.join(LIVE_PREFETCHERS)}")
        self.model, self.store = model, store
        cfg = model.cfg
        # fcfs: the first max_batch requests run until done. expert-aware: up to max_active requests
        # hold a KV slot, and each step runs the max_batch of them whose recent experts overlap most.
        max_active = max_active or (4 * max_batch if schedule == "expert-aware" else max_batch)
        self.cache_bonus = float(cache_bonus)
        self.max_context = max_context or cfg.max_position_embeddings
        self.done: dict = {}
        self.steps: list = []             # StepRecord of every step (keep_records=False: only the last)
        self.keep_records = keep_records
        self._next_id = 0
        self._step_no = 0
        # The cost rule replay uses (PrefetchGate) on the store's cost model: move a predicted expert
        # only when p x saving > the link time it spills.
        self.prefetch = prefetch
        self.prefetcher = PrefetchController(prefetch, num_layers=cfg.num_moe_layers, num_experts=cfg.num_experts,
                                             budget=prefetch_budget or cfg.top_k, rule=prefetch_rule,
                                             link_s=store.cost.t_link,
                                             saving_s=store.cost.prefetch_saving(store.cpu_experts.auto),
                                             preview=model.route_preview)
        self._pred: dict = {}             # MoE layer -> experts predicted for it this step
        self._known = model.known_expert_layers    # MoE layers whose experts the token ids give (moved, not predicted)
        self._step_routing: list = []
        # True under tensor parallelism (runtime/parallel/group.py): an error inside a step is raised, not
        # turned into failed requests - the other ranks are waiting in a collective this rank left.
        self.fail_fast = False
        # Pipeline stages: callable(this rank's [(MoE layer, ids)]) -> every stage's, so each rank files the
        # routing of every layer (the scheduler's expert-aware choice and the trace read it). None: one stage.
        self.routing_sync = None
        # The KV cache: preallocated blocks (load_model's kv_cache_bytes, else max_batch sequences of
        # 1024 tokens, and at least one sequence of the whole context up to 8192); admission by free
        # blocks, preemption when out. Its memory is fixed from here on.
        # Models with per-sequence state: the prefix cache keeps that state at block boundaries in spare state slots
        # (KVManager.snapshot), max_active of them unless told; they come out of the same budget.
        per_seq = model.state_bytes_per_sequence()
        self.prefix_snapshots = (0 if not (prefix_caching and per_seq) else
                                 max_active if prefix_snapshots is None else prefix_snapshots)
        # Speculative decoding on such models: one scratch state slot per sequence of a step (the state before a
        # verify chunk, restored when a draft is rejected: spec_step.py), out of the same budget.
        scratch = max_batch if speculative is not None and per_seq else 0
        if model.kv is None:
            tokens = default_cache_tokens(self.max_context, max_batch)
            # Linear-attention layers: a fixed state slot per running sequence comes out of the same budget.
            model.init_kv(model.kv_bytes or tokens * model.kv_bytes_per_token()
                          + (max_active + self.prefix_snapshots + scratch) * per_seq, max_seqs=max_active + scratch,
                          snapshots=self.prefix_snapshots)
        self.kv = KVManager.for_cache(model.kv)       # the one allocator of the cache's blocks and slots
        # (a cache made before: its spare sequence slots, one left for the sequences at least)
        scratch = [self.kv.free_state.pop() for _ in range(min(scratch, len(self.kv.free_state) - 1))]
        self.grammars = GrammarBuilds()               # requests whose grammar is compiling (off the loop)
        self.scheduler = Scheduler(lambda: self.kv, max_batch=max_batch, max_active=max_active,
                                   prefill_chunk=prefill_chunk, step_tokens=self._step_tokens(max_batch),
                                   schedule=schedule, num_moe_layers=cfg.num_moe_layers, num_experts=cfg.num_experts,
                                   eos_token_ids=cfg.eos_token_ids, prefix_caching=prefix_caching)
        self.speculative = speculative
        self.spec = SpecStep(self, speculative, scratch) if speculative is not None else None

    def _step_tokens(self, max_batch: int) -> "int | None":
        """A layer whose experts exceed the device tier runs in waves - which needs a host tier that
        holds every expert. Without one, a step may feed at most cap // top_k tokens (so no layer
        can need more experts than the device holds); start-up refuses a tier too small for one
        decode step of max_batch sequences."""
        cfg, store = self.model.cfg, self.store
        cap = store.compute_capacity(0)        # the device tier's, or the host's where layers compute there
        if cap is None or cap >= cfg.num_experts:
            return None
        step_tokens = cap // cfg.top_k
        if step_tokens < min(max_batch, cfg.num_experts):
            need = min(cfg.num_experts, max_batch * cfg.top_k)
            tier = "host" if store.compute_on_host(0) else "device"
            raise ValueError(f"the {tier} tier the experts compute from holds {cap} experts per layer and the host "
                             f"tier does not hold every expert: a step of --max-batch {max_batch} sequences needs up "
                             f"to {need} experts of a layer at once. Raise the {tier} budget to hold {need} experts "
                             f"({need * store.m.blob_stride:,} bytes of expert slots), let the host hold every "
                             f"expert, or lower --max-batch to {max(1, step_tokens)}")
        return step_tokens

    _SCHEDULER_VIEW = frozenset(("max_batch", "max_active", "prefill_chunk", "step_tokens", "waiting", "running",
                                 "preemptions"))

    def __getattr__(self, name: str):
        # The scheduler's queues and figures, read-only, for callers that watch the engine.
        if name in Engine._SCHEDULER_VIEW and "scheduler" in self.__dict__:
            return getattr(self.scheduler, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def drafter(self):
        """The speculative drafter (speculative.py's Drafter), None when speculation is off."""
        return self.spec.drafter if self.spec is not None else None

    @property
    def schedule(self) -> str:
        return self.scheduler.schedule_kind

    def _grammar_tokenizer(self):
        """The tokenizer as the grammar engine indexes it: built on the first constrained request."""
        if getattr(self, "_gtok", None) is None:
            import os
            path = os.path.join(self.store.dir, "tokenizer.json")
            if not os.path.exists(path):
                raise ValueError("structured output needs the model's tokenizer.json, which this store lacks")
            self._gtok = GrammarTokenizer(path, self.model.cfg.vocab_size, list(self.model.cfg.eos_token_ids))
        return self._gtok

    @property
    def longest_sequence(self) -> int:
        """Tokens (prompt + completion) one request may have: the context, or what the whole KV cache holds
        when that is less - what a server advertises as the model's length and fills when a request names no
        max_tokens."""
        blocks = self.scheduler.blocks
        return min(self.max_context, blocks.num_blocks * blocks.block_size)

    # -- requests ------------------------------------------------------------------------------
    def add_request(self, prompt: list, params: "SamplingParams | None" = None, cache_salt: "str | None" = None) -> int:
        """Queue a request; its id. ``cache_salt`` (vLLM's): it shares prefix-cache blocks only with requests of
        the same salt (None: with the other unsalted ones)."""
        params = params or SamplingParams()
        if not prompt:
            raise ValueError("prompt is empty")
        V = self.model.cfg.vocab_size
        bad = [t for t in prompt if not 0 <= int(t) < V]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {V})")
        if len(prompt) + params.max_tokens > self.max_context:
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds the context "
                             f"of {self.max_context} tokens")
        blocks = self.scheduler.blocks
        if blocks.blocks_for(len(prompt) + params.max_tokens) > blocks.num_blocks:
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) needs "
                             f"{blocks.blocks_for(len(prompt) + params.max_tokens)} KV blocks of {blocks.block_size} "
                             f"tokens; the KV cache budget holds {blocks.num_blocks}")
        if cache_salt is not None and not (isinstance(cache_salt, str) and cache_salt):
            raise ValueError(f"cache_salt must be a non-empty string or None, got {str(cache_salt)[:40]!r}")
        r = Request(id=self._next_id, prompt=[int(t) for t in prompt], params=params, arrival=time.perf_counter(),
                    cache_salt=cache_salt)
        if params.trigger is not None and not 0 <= params.trigger[0] < V:
            raise ValueError(f"trigger token id {params.trigger[0]} is outside the vocabulary [0, {V})")
        if params.allowed_token_ids is not None and max(params.allowed_token_ids) >= V:
            raise ValueError(f"allowed_token_ids: token id {max(params.allowed_token_ids)} is outside the vocabulary "
                             f"[0, {V})")
        if params.prompt_logprobs is not None:
            r.prompt_logprobs = [None] * len(r.prompt)      # filled as its prompt's chunks run (_step_hooks)
        if params.seed is not None:
            import torch
            r.gen = torch.Generator().manual_seed(params.seed)
        self._next_id += 1
        if params.grammar is not None or params.trigger is not None:
            gt = self._grammar_tokenizer()
            if self.fail_fast:        # tensor parallel: every rank schedules alike, so it compiles now (a ValueError)
                build(r, gt)
            else:
                # compiled on a thread: the loop steps the others meanwhile; it joins when compiled (_join_grammars)
                self.grammars.submit(r, gt)
                return r.id
        self.scheduler.add(r)
        return r.id

    def _join_grammars(self) -> list:
        """Requests whose grammar compiled join the schedule; those whose grammar cannot be served end, rejected
        (their outputs). With nothing else to step, waits a little for a compile rather than spin."""
        out = []
        for r, err in self.grammars.finished(0.0 if self.scheduler.has_work() else 0.005):
            if err is None:
                self.scheduler.add(r)
                continue
            r.finished, r.finish_reason, r.error = True, FinishReason.REJECTED, str(err)
            self.done[r.id] = r
            out.append(StepOutput(r.id, None, True, FinishReason.REJECTED, str(err)))
        return out

    def abort(self, rid: int) -> None:
        r = self.scheduler.remove(rid) or self.grammars.remove(rid)     # frees its KV slot
        if r is not None:
            r.finished, r.finish_reason = True, FinishReason.ABORT
            self.done[rid] = r

    def forget(self, rid: int) -> "Request | None":
        """Drop a finished request (a server keeps none)."""
        return self.done.pop(rid, None)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self.grammars)

    # -- hooks called by the model -------------------------------------------------------------
    def _record(self, moe_idx: int, ids) -> None:
        self._step_routing.append((moe_idx, ids.cpu().numpy()))

    def _hooks(self, record: bool = True) -> StepHooks:
        """What the model hears of this step (one object per forward; the model keeps none of it)."""
        return StepHooks(step=self._step_no, cache_bonus=self.cache_bonus, record=self._record if record else None,
                         routed=self._routed if self.prefetcher.active else None)

    def _routed(self, m: int, used: list, x) -> None:
        """MoE layer m has routed and asked for its experts (they have not computed yet): score what was
        predicted for it, predict layer m + 1 and move what pays - the loads overlap layer m's experts. Layer
        m's experts are protected: a prefetch never evicts what is about to compute (replay protects them
        alike)."""
        ctl, store = self.prefetcher, self.store
        if m in self._pred:
            ctl.learn(self._pred.pop(m), used)
        nxt = m + 1
        on_host = nxt < self.model.cfg.num_moe_layers and store.compute_on_host(nxt)
        if (nxt >= self.model.cfg.num_moe_layers or (on_host and store.host_holds_all) or nxt in self._known
                or not store.holds(nxt)):
            return                  # (a hash-routed layer's experts were moved exactly at the step's start; another
            #                          pipeline stage predicts its own first layer from its own routing; a layer
            #                          computed from a host tier that holds every expert has nothing to read)
        ctl.observe(m, used, None, self._step_no)
        pred = self._pred[nxt] = ctl.predict(nxt, used, hidden=x)
        if on_host:
            # computed from host memory (one memory on a CPU, --cpu-experts N): the predicted experts the host tier
            # lacks are read from disk now, while layer m computes - a read never crosses a link to a device
            have = set(store.resident(nxt, "host"))
            pred = [e for e in pred if e not in have]
        else:
            pred = ctl.select(pred, store.last_idle_link_s, set(store.resident(nxt)), store.displaced_reuse(nxt))
        if pred:
            store.prefetch(nxt, pred, self._step_no, protect=used)

    # -- the step ------------------------------------------------------------------------------
    def step(self) -> list:
        """Schedule, execute, record. Returns one ``StepOutput`` per request of the step."""
        return self.step_result().outputs

    def step_result(self) -> StepResult:
        """One step: its outputs and its record. An error while executing the step fails that step's
        requests (their slots are freed) and nobody else's."""
        t0 = time.perf_counter()
        rejected = self._join_grammars() if self.grammars else []
        if rejected:
            return StepResult(rejected, None)
        sched = self.scheduler.schedule(self._step_no)
        if not sched.requests:
            return StepResult([], None)
        plan = None
        before = self.store.stats.counters()
        try:
            if self.spec is not None:
                sched, plan = self.spec.plan(sched)      # drafts appended to the chunks of requests that speculate
            logits = self._run(sched, plan)
        except Exception as e:  # noqa: BLE001 - one step's failure must not take the engine down
            if plan is not None:
                self.spec.abandon(plan)
            if self.fail_fast:
                raise
            msg = f"{type(e).__name__}: {e}"
            out = [self.scheduler.fail(r, msg) for r in sched.requests]
            for r in sched.requests:
                self.done[r.id] = r
            self._pred.clear()
            self.store.recover()           # no expert whose load failed stays resident
            self.store.end_step()
            return StepResult(out, self._record_step(before, sched, [], t0, failed=len(sched.requests)))
        if self.routing_sync is not None:
            self._step_routing = self.routing_sync(self._step_routing)
        unique = self._file_routing(sched)
        fig = None
        if plan is not None:
            out, ended, failed, fig = self.spec.postprocess(sched, plan, logits, time.perf_counter())
        else:
            out, ended, failed = self.scheduler.postprocess(sched, logits, time.perf_counter())
        for r in ended:
            self.done[r.id] = r
        self.store.end_step()
        rec = self._record_step(before, sched, unique, t0, failed=failed, spec=fig)
        if self.spec is not None:
            self.spec.after_step(sched.requests, rec)      # the draft-length rule's live inputs
        return StepResult(out, rec)

    def _run(self, sched: SchedulerOutput, plan=None):
        self._step_routing = []
        if self.prefetcher.active and self._known:
            # Layers whose experts follow from the step's tokens (DeepSeek-V4's hash tables): moved now,
            # exactly, while the first layers run - not predicted
            for m, experts in self.model.known_experts([t for c in sched.chunks for t in c]).items():
                self.store.prefetch(m, experts, self._step_no)
        hooks = self._step_hooks(sched)
        if plan is not None:
            hooks = self.spec.hooks(hooks, plan)        # every row's logits of the verify chunks
        return self.model.forward([r.seq for r in sched.requests], sched.chunks, hooks)

    def _step_hooks(self, sched: SchedulerOutput) -> StepHooks:
        """The step's hooks, with the requests whose prompt's log-probabilities this step computes (prompt_logprobs:
        every prompt token's logits, not only the last's; each request's whole prompt is computed - scheduler.py)."""
        hooks = self._hooks()
        want = {id(r.seq): r for r in sched.requests
                if r.params.prompt_logprobs is not None and not r.output and r.recompute is None
                and r.fed < len(r.prompt)}
        if not want:
            return hooks
        # a chunk's first row is its request's position r.fed (advanced after the forward, in postprocess)
        start = {k: r.fed for k, r in want.items()}
        return replace(hooks, every_token=tuple(r.seq for r in want.values()),
                       token_logits=lambda seq, row, logits: self._file_prompt_logprobs(want[id(seq)],
                                                                                     start[id(seq)] + row, logits))

    @staticmethod
    def _file_prompt_logprobs(r: Request, pos: int, logits) -> None:
        """Rows of logits [rows, vocab] from prompt position ``pos`` on: row i predicts prompt token pos + i + 1 (the
        last position's row predicts the first output token: not the prompt's)."""
        rows = min(logits.shape[0], len(r.prompt) - 1 - pos)
        if rows > 0:
            r.prompt_logprobs[pos + 1:pos + 1 + rows] = prompt_logprobs_of(
                logits[:rows], r.prompt[pos + 1:pos + 1 + rows], r.params.prompt_logprobs)

    def _file_routing(self, sched: SchedulerOutput) -> list:
        """Routing of this step's tokens, per request, in feed order (one [tokens, L, k] array per
        step); returns the unique experts per MoE layer."""
        L = self.model.cfg.num_moe_layers
        routing = self._step_routing
        if len(routing) == L and all(m == i for i, (m, _) in enumerate(routing)):
            A = np.stack([ids for _, ids in routing], axis=1)     # one forward, layers in order: A [tokens, L, k]
        else:
            per_layer: dict = {}
            for m, ids in routing:                   # micro-batches of a pipeline: one entry each, in order
                per_layer.setdefault(m, []).append(ids)
            A = np.stack([np.concatenate(per_layer[m]) for m in range(L)], axis=1)
        off = 0
        for r, c in zip(sched.requests, sched.chunks):
            r.routing.append(A[off:off + len(c)])
            r.last_step = self._step_no
            off += len(c)
        # distinct experts per layer: a sorted row's value changes (cheaper than a bincount over L x E for the
        # few rows of a decode step)
        flat = np.sort(A.transpose(1, 0, 2).reshape(L, -1), axis=1)                 # flat: [L, tokens * k]
        return (1 + (flat[:, 1:] != flat[:, :-1]).sum(1)).tolist()

    def _record_step(self, before, sched: SchedulerOutput, unique, t0, failed=0, spec=None) -> StepRecord:
        d = self.store.stats.since(before)
        rec = StepRecord(step=self._step_no, batch=len(sched.chunks), tokens=sched.tokens, unique_experts=unique,
                         hits=d["hits"], bytes=d["bytes"], stall_seconds=d["stall_seconds"],
                         seconds=time.perf_counter() - t0, failed=failed)
        if spec is not None:
            rec = replace(rec, spec_drafted=spec.drafted, spec_accepted=spec.accepted, spec_refed=spec.refed,
                          spec_lengths=tuple(spec.lengths), spec_verify_unique_experts=spec.unique)
        if not self.keep_records:
            self.steps.clear()
        self.steps.append(rec)
        self._step_no += 1
        return rec

    def run(self) -> dict:
        while self.has_work():
            self.step()
        return self.done

    def score(self, prompts: list):
        """Logits of each prompt's last token, [len(prompts), vocab] float32: one forward over new
        sequences, outside the schedule (their KV blocks are freed after). Experts are requested as in
        any step (the store counts them); nothing is recorded or sampled."""
        import torch

        if not prompts or any(not p for p in prompts):
            raise ValueError("score needs non-empty prompts")
        seqs = [Sequence() for _ in prompts]
        chunks = [[int(t) for t in p] for p in prompts]
        try:
            self.kv.prepare(seqs, chunks)
            with torch.inference_mode():
                return self.model.forward(seqs, chunks, self._hooks(record=False))
        finally:
            for s in seqs:
                self.kv.release(s)
            self.store.end_step()

    # -- results -------------------------------------------------------------------------------
    def trace(self):
        """The routing of every fed token, as a cache_policy Trace (one sequence per request, by id)."""
        reqs = [self.done[i] for i in sorted(self.done) if self.done[i].routing]
        per_req = [np.concatenate(r.routing) for r in reqs]
        ids = np.concatenate(per_req).astype(np.int64)                       # ids: [tokens, L, k]
        lens = [len(x) for x in per_req]
        m = self.store.full_m          # whole experts (a tensor-parallel rank moves slices of them)
        return Trace(ids=ids, seq_offsets=np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
                     num_experts=self.model.cfg.num_experts, model=self.model.cfg.model_type,
                     layer_numbers=np.array(self.model.cfg.moe_layers), expert_bytes=m.blob_bytes,
                     expert_dtype=cost_dtype(m.expert_format))

    def summary(self) -> dict:
        steps = self.steps
        gen = sum(len(r.output) for r in self.done.values())
        secs = sum(s.seconds for s in steps)
        hits = {k: sum(s.hits[k] for s in steps) for k in TIERS}
        need = sum(hits.values())
        ttft = [r.first_token_time - r.arrival for r in self.done.values() if r.first_token_time]
        snap = self.store.snapshot()
        # steps without prefill: one token per sequence, plus its drafts and kept tokens fed again (speculation)
        decode = [s for s in steps if s.tokens == s.batch + s.spec_drafted + s.spec_refed]
        decode_secs = sum(s.seconds for s in decode)
        return {"steps": len(steps), "generated_tokens": gen, "seconds": secs,
                "tokens_per_s": gen / secs if secs else 0.0,
                "decode_tokens_per_s": sum(s.batch + s.spec_accepted for s in decode) / max(1e-9, decode_secs),
                # the decode steps alone: how fast the disk was read while tokens were generated
                "decode_seconds": decode_secs, "decode_bytes": {k: sum(s.bytes[k] for s in decode) for k in LINKS},
                "mean_ttft_s": float(np.mean(ttft)) if ttft else None,
                "hits": hits, "hit_rate_device": hits["device"] / need if need else None,
                "bytes": {k: sum(s.bytes[k] for s in steps) for k in LINKS},
                "stall_seconds": sum(s.stall_seconds for s in steps),
                "mean_unique_experts_per_layer": float(np.mean([np.mean(s.unique_experts) for s in steps])) if steps else 0.0,
                "prefetch": {**self.prefetcher.precision_recall(), **snap["prefetch"]},
                "computed": snap["computed"], "host_compute_seconds": snap["host_compute_seconds"],
                "device_is_stand_in": self.store.device_is_stand_in,
                **({"speculative": spec_summary(self.speculative, self.done.values())} if self.speculative else {})}
