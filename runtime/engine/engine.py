"""Continuous batching and the decode loop: one ``step()`` that schedules, executes, then records.

Scheduling: up to ``max_batch`` sequences run at once; a waiting request joins when a slot is
free (between steps); a sequence in prefill feeds up to ``prefill_chunk`` prompt tokens per step,
a decoding sequence one token. Execution: one forward pass over all of the step's tokens.
Recording: per step, batch size, unique experts per MoE layer, store hits / misses per tier,
bytes per link, time stalled waiting for experts, step time; the routing of every fed token,
written as a trace in the ``cache_policy`` format.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from cache_policy.keys import LINKS, TIERS
from cache_policy.prefetch import LIVE_PREFETCHERS

from ..model.moe import Sequence, route


class FinishReason:
    """Why a request ended (the OpenAI ``finish_reason`` values, plus ``error`` and ``abort``)."""
    STOP = "stop"          # an EOS or stop token
    LENGTH = "length"      # max_tokens reached
    ABORT = "abort"        # the client went away or asked
    ERROR = "error"        # the engine failed while serving it (the message says why); others go on


# Temperatures below this are greedy (vLLM's _SAMPLING_EPS): dividing logits by 1e-300 overflows.
SAMPLING_EPS = 1e-5


@dataclass
class StepOutput:
    """One request's result of one step: a new token (None while its prompt is still being fed),
    and, when it finished, why; ``error`` names the cause of a failed request."""
    request_id: int
    token: "int | None"
    finished: bool = False
    finish_reason: "str | None" = None
    error: "str | None" = None


@dataclass
class SamplingParams:
    max_tokens: int = 32
    temperature: float = 0.0          # 0: greedy
    top_p: float = 1.0
    top_k: int = 0                    # 0: off
    seed: "int | None" = None
    stop_token_ids: tuple = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be a non-negative integer, got {self.top_k!r}")


def sample(logits: torch.Tensor, p: SamplingParams, gen: "torch.Generator | None") -> int:
    """logits: [vocab] float32."""
    if not bool(torch.isfinite(logits).any()):
        raise FloatingPointError("the model produced no finite logit for this token")
    if p.temperature < SAMPLING_EPS:
        return int(logits.argmax())
    x = logits.double() / p.temperature            # float64: small temperatures stay finite
    if p.top_k:
        kth = x.topk(min(p.top_k, x.numel())).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = x.softmax(-1)
    if p.top_p < 1:
        sp, si = probs.sort(descending=True)
        keep = sp.cumsum(0) - sp < p.top_p         # the smallest prefix whose mass reaches top_p
        probs = torch.zeros_like(probs).scatter_(0, si[keep], sp[keep])
        probs = probs / probs.sum()
    if not bool(torch.isfinite(probs).all()) or not probs.sum() > 0:
        return int(logits.argmax())                # degenerate distribution: the mode
    return int(torch.multinomial(probs, 1, generator=gen))


@dataclass
class Request:
    id: int
    prompt: list
    params: SamplingParams
    output: list = field(default_factory=list)
    seq: Sequence = field(default_factory=Sequence)
    fed: int = 0                      # prompt tokens fed so far
    finished: bool = False
    finish_reason: "str | None" = None
    gen: "torch.Generator | None" = None
    arrival: float = 0.0
    first_token_time: "float | None" = None
    routing: list = field(default_factory=list)   # per step: [fed tokens, moe layers, k] expert ids
    last_step: int = -1                           # the last step this request ran in
    error: "str | None" = None                    # why it failed (finish_reason "error")
    recompute: "list | None" = None               # after a preemption: prompt + output[:-1], fed again
    preemptions: int = 0


@dataclass
class StepRecord:
    step: int
    batch: int
    tokens: int
    unique_experts: list
    hits: dict
    bytes: dict
    stall_seconds: float
    seconds: float
    failed: int = 0          # requests this step failed (an error while serving them)


class Engine:
    def __init__(self, model, store, *, max_batch: int = 16, prefill_chunk: int = 64, prefetch: str = "none",
                 prefetch_budget: "int | None" = None, max_context: "int | None" = None,
                 schedule: str = "fcfs", max_active: "int | None" = None, cache_bonus: float = 0.0,
                 prefetch_rule: str = "cost") -> None:
        if max_batch < 1 or prefill_chunk < 1:
            raise ValueError("max_batch and prefill_chunk must be positive")
        if schedule not in ("fcfs", "expert-aware"):
            raise ValueError(f"unknown schedule {schedule!r}; choose fcfs or expert-aware")
        if max_active is not None and max_active < max_batch:
            raise ValueError(f"max_active ({max_active}) must be at least max_batch ({max_batch})")
        if not cache_bonus >= 0:
            raise ValueError(f"cache_bonus must be >= 0, got {cache_bonus!r}")
        self.model, self.store = model, store
        self.max_batch, self.prefill_chunk = max_batch, prefill_chunk
        # fcfs: the first max_batch requests run until done. expert-aware: up to max_active requests
        # hold a KV slot, and each step runs the max_batch of them whose recent experts overlap most.
        self.schedule = schedule
        self.max_active = max_active or (4 * max_batch if schedule == "expert-aware" else max_batch)
        model.cache_bonus = float(cache_bonus)
        self.max_context = max_context or model.cfg.max_position_embeddings
        self.waiting: list = []
        self.running: list = []
        self.done: dict = {}
        self.steps: list = []
        self._next_id = 0
        self._step_no = 0
        cfg = model.cfg
        self.prefetch = prefetch
        self.budget = prefetch_budget or cfg.top_k
        self.pf_stats = {"predicted": 0, "correct": 0, "needed": 0}
        self._pred: dict = {}
        self._pf = None
        from cache_policy.replay import PREFETCH_RULES
        if prefetch_rule not in PREFETCH_RULES:
            raise ValueError(f"unknown prefetch rule {prefetch_rule!r}; choose one of {', '.join(PREFETCH_RULES)}")
        # The cost rule replay uses (cache_policy.prefetch.PrefetchGate) on the store's cost model:
        # move a predicted expert only when p x saving > the link time it spills.
        self._gate = None
        if prefetch != "none" and prefetch_rule == "cost":
            from cache_policy.prefetch import PrefetchGate
            self._gate = PrefetchGate(self.budget, store.cost.t_link, store.cost.prefetch_saving(store.cpu_experts.auto))
        if prefetch in ("freq", "transition"):
            from cache_policy.prefetch import make_prefetcher
            self._pf = make_prefetcher(prefetch, num_layers=cfg.num_moe_layers, num_experts=cfg.num_experts)
        elif prefetch not in LIVE_PREFETCHERS:
            raise ValueError(f"unknown prefetch {prefetch!r}; the live engine takes {', '.join(LIVE_PREFETCHERS)}")
        model.record = self._record
        model.prefetch_hook = self._after_moe if prefetch != "none" else None
        self._step_routing: list = []
        # A layer whose experts exceed the device tier runs in waves - which needs a host tier that
        # holds every expert. Without one, a step may feed at most cap // top_k tokens (so no layer
        # can need more experts than the device holds); start-up refuses a tier too small for one
        # decode step of max_batch sequences.
        # The KV cache: preallocated blocks (load_model's kv_cache_bytes, else max_batch sequences of
        # 1024 tokens, and at least one sequence of the whole context up to 8192); admission by free
        # blocks, preemption when out. Its memory is fixed from here on.
        if model.kv is None:
            tokens = max(max_batch * min(self.max_context, 1024), min(self.max_context, 8192))
            # Linear-attention layers: a fixed state slot per running sequence comes out of the same budget.
            model.init_kv(model.kv_bytes or tokens * model.kv_bytes_per_token()
                          + self.max_active * model.state_bytes_per_sequence(), max_seqs=self.max_active)
        self.preemptions = 0
        self.step_tokens = None
        cap = store.placement.device[0].capacity
        if not getattr(store, "_host_holds_all", True) and cap < cfg.num_experts:
            self.step_tokens = cap // cfg.top_k
            if self.step_tokens < min(max_batch, cfg.num_experts):
                need = min(cfg.num_experts, max_batch * cfg.top_k)
                raise ValueError(f"the device tier holds {cap} experts per layer and the host tier does not hold every "
                                 f"expert: a step of --max-batch {max_batch} sequences needs up to {need} experts of a "
                                 f"layer at once. Raise the device budget to hold {need} experts "
                                 f"({need * store.m.blob_stride:,} bytes of expert slots), let the host hold every "
                                 f"expert, or lower --max-batch to {max(1, self.step_tokens)}")

    # -- requests ------------------------------------------------------------------------------
    def add_request(self, prompt: list, params: "SamplingParams | None" = None) -> int:
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
        kv = self.model.kv
        if kv.blocks_for(len(prompt) + params.max_tokens) > kv.num_blocks:
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) needs "
                             f"{kv.blocks_for(len(prompt) + params.max_tokens)} KV blocks of {kv.block_size} tokens; "
                             f"the KV cache budget holds {kv.num_blocks}")
        r = Request(id=self._next_id, prompt=[int(t) for t in prompt], params=params, arrival=time.perf_counter())
        if params.seed is not None:
            r.gen = torch.Generator().manual_seed(params.seed)
        self._next_id += 1
        self.waiting.append(r)
        return r.id

    def abort(self, rid: int) -> None:
        for q in (self.waiting, self.running):
            for r in list(q):
                if r.id == rid:
                    q.remove(r)
                    r.finished, r.finish_reason = True, FinishReason.ABORT
                    self.model.release(r.seq)     # frees its KV slot
                    self.done[rid] = r

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- recording hooks called by the model ---------------------------------------------------
    def _record(self, moe_idx: int, ids: torch.Tensor) -> None:
        self._step_routing.append((moe_idx, ids.cpu().numpy()))

    def _after_moe(self, m: int, used: list, x: torch.Tensor) -> None:
        cfg, model = self.model.cfg, self.model
        if m in self._pred:
            ranked = self._pred.pop(m)
            need = set(used)
            self.pf_stats["correct"] += len(need.intersection(ranked))
            self.pf_stats["needed"] += len(used)
            if self._gate is not None:
                self._gate.observe(ranked, need)
        nxt = m + 1
        if nxt >= cfg.num_moe_layers or nxt < self.store.cpu_experts.layers:
            return
        if self.prefetch == "lookahead":
            layer = cfg.moe_layers[nxt]
            logits = torch.nn.functional.linear(x, model.w[model._router_name(layer)])
            ids, _ = route(logits, cfg, model.w.get(model._p(layer, "mlp.gate.e_score_correction_bias")))
            counts = torch.bincount(ids.reshape(-1), minlength=cfg.num_experts)
            pred = [int(e) for e in counts.argsort(descending=True)[: max(self.budget, 1)] if counts[e] > 0]
        else:
            self._pf.observe(m, used, None, self._step_no)
            pred = self._pf.predict(nxt, used, self.budget)
        self._pred[nxt] = pred
        self.pf_stats["predicted"] += len(pred)
        if self._gate is not None:
            st, pool = self.store.stats, self.store.placement.device[nxt]
            acc = sum(st.hits.values())
            q = st.hits["device"] / acc if acc and len(pool.resident) >= pool.capacity else 0.0
            pred = self._gate.select(pred, self.store.last_idle_link_s, set(self.store.resident(nxt)), q)
        if pred:
            self.store.prefetch(nxt, pred, self._step_no)

    # -- the step ------------------------------------------------------------------------------
    @staticmethod
    def _decoding(r: Request) -> bool:
        return r.recompute is None and r.fed >= len(r.prompt)

    def _preempt(self, r: Request) -> None:
        """Free a running request's KV blocks; it waits at the head of the queue and is fed again
        (prompt + what it generated so far, without sampling) when blocks are free."""
        self.running.remove(r)
        self.model.release(r.seq)
        r.seq = Sequence()
        r.fed = 0
        r.recompute = (r.prompt + r.output[:-1]) if r.output else None
        r.preemptions += 1
        self.preemptions += 1
        self.waiting.insert(0, r)

    def _fail(self, r: Request, message: str) -> StepOutput:
        """End one request with an error; its slots are freed, the engine goes on."""
        if r in self.running:
            self.running.remove(r)
        self.model.release(r.seq)
        r.finished, r.finish_reason, r.error = True, FinishReason.ERROR, message
        self.done[r.id] = r
        return StepOutput(r.id, None, True, FinishReason.ERROR, message)

    def step(self) -> list:
        """Schedule, execute, record. Returns one ``StepOutput`` per request of the step. An
        error while executing the step fails that step's requests (their slots are freed) and
        nobody else's."""
        t0 = time.perf_counter()
        kv = self.model.kv
        # Admission by free KV blocks: a waiting request joins when its whole (re)prefill fits now.
        free = kv.free_blocks
        seqs = kv.free_sequences          # None: no per-sequence state to hand out
        while self.waiting and len(self.running) < self.max_active:
            r = self.waiting[0]
            need = kv.blocks_for(len(r.recompute or r.prompt) + 1)
            if (need > free or seqs == 0) and self.running:
                break
            free -= need                  # promised to this request, allocated chunk by chunk
            if seqs is not None:
                seqs -= 1
            self.running.append(self.waiting.pop(0))
        if not self.running:
            return []
        batch = self._choose() if len(self.running) > self.max_batch else list(self.running)
        chunks = []
        budget = None if self.step_tokens is None else self.step_tokens - sum(self._decoding(r) for r in batch)
        fed = []
        for r in batch:
            if r not in self.running:
                continue              # preempted below for an earlier request of this step
            if not self._decoding(r):
                src = r.recompute if r.recompute is not None else r.prompt
                n = self.prefill_chunk if budget is None else min(self.prefill_chunk, budget)
                if n <= 0:
                    continue          # no room left in this step's token budget: next step
                chunk = src[r.fed:r.fed + n]
            else:
                chunk = [r.output[-1]]
            # KV blocks for this chunk; when none are free, preempt the newest running request
            # (vLLM's recompute: its blocks are freed, it is fed again later) - possibly this one.
            while not kv.ensure(r.seq, r.seq.length + len(chunk)):
                victim = max(self.running, key=lambda x: x.arrival)
                self._preempt(victim)
                if victim in fed:          # already given a chunk this step: take it back
                    j = fed.index(victim)
                    del fed[j], chunks[j]
                if victim is r:
                    break
            if r not in self.running:
                continue
            if budget is not None and not self._decoding(r):
                budget -= len(chunk)
            chunks.append(chunk)
            fed.append(r)
        batch = fed
        if not batch:
            return []
        st = self.store.stats
        before = (dict(st.hits), dict(st.bytes), st.stall_seconds)
        self._step_routing = []
        self.model.step = self._step_no
        try:
            logits = self.model.forward([r.seq for r in batch], chunks)
        except Exception as e:  # noqa: BLE001 - one step's failure must not take the engine down
            msg = f"{type(e).__name__}: {e}"
            out = [self._fail(r, msg) for r in batch]
            self._pred.clear()
            self.store.recover()           # no expert whose load failed stays resident
            self.store.end_step()
            self._record_step(before, chunks, [], t0, failed=len(batch))
            return out
        # Routing of this step's tokens, per request, in feed order: one [tokens, L, k] array per step.
        L, E = self.model.cfg.num_moe_layers, self.model.cfg.num_experts
        per_layer = dict(self._step_routing)
        A = np.stack([per_layer[m] for m in range(L)], axis=1)            # A: [tokens, L, k]
        off = 0
        for r, c in zip(batch, chunks):
            r.routing.append(A[off:off + len(c)])
            r.last_step = self._step_no
            off += len(c)
        seen = np.bincount((A + (np.arange(L) * E)[None, :, None]).reshape(-1), minlength=L * E).reshape(L, E)
        out = []
        finished = []
        failed = 0
        now = time.perf_counter()
        for r, c, lg in zip(batch, chunks, logits):
            if r.recompute is not None:
                r.fed += len(c)
                if r.fed >= len(r.recompute):       # context rebuilt: decoding resumes with output[-1]
                    r.recompute, r.fed = None, len(r.prompt)
                out.append(StepOutput(r.id, None))
                continue
            if r.fed < len(r.prompt):
                r.fed += len(c)
                if r.fed < len(r.prompt):
                    out.append(StepOutput(r.id, None))
                    continue
            try:
                tok = sample(lg, r.params, r.gen)
            except Exception as e:  # noqa: BLE001 - this request alone
                out.append(self._fail(r, f"{type(e).__name__}: {e}"))
                failed += 1
                continue
            if r.first_token_time is None:
                r.first_token_time = now
            r.output.append(tok)
            p = r.params
            if not p.ignore_eos and (tok in p.stop_token_ids or tok in self.model.cfg.eos_token_ids):
                r.finished, r.finish_reason = True, FinishReason.STOP
            elif len(r.output) >= p.max_tokens:
                r.finished, r.finish_reason = True, FinishReason.LENGTH
            out.append(StepOutput(r.id, tok, r.finished, r.finish_reason))
            if r.finished:
                finished.append(r)
        for r in finished:
            self.running.remove(r)
            self.model.release(r.seq)
            self.done[r.id] = r
        self.store.end_step()
        self._record_step(before, chunks, (seen > 0).sum(1).tolist(), t0, failed=failed)
        return out

    def _record_step(self, before, chunks, unique, t0, failed=0) -> None:
        st = self.store.stats
        self.steps.append(StepRecord(
            step=self._step_no, batch=len(chunks), tokens=sum(len(c) for c in chunks), unique_experts=unique,
            hits={k: st.hits[k] - before[0][k] for k in st.hits}, bytes={k: st.bytes[k] - before[1][k] for k in st.bytes},
            stall_seconds=st.stall_seconds - before[2], seconds=time.perf_counter() - t0, failed=failed))
        self._step_no += 1

    def _choose(self) -> list:
        """Expert-aware batching: max_batch of the active requests, grouped by the overlap of the
        experts their last token used. The request that has waited longest since it last ran
        seeds the group (and any request left out for ``4 * max_active / max_batch`` steps is
        taken first), so nobody starves; then, one at a time, the request whose last experts are
        most covered by the group's union joins."""
        L, E = self.model.cfg.num_moe_layers, self.model.cfg.num_experts
        offs = np.arange(L)[:, None] * E
        starve = 4 * self.max_active // self.max_batch
        order = sorted(self.running, key=lambda r: r.last_step)
        chosen = [r for r in order if self._step_no - r.last_step > starve][: self.max_batch] or order[:1]
        union: set = set()
        sets = {}
        for r in self.running:
            sets[r.id] = set((r.routing[-1][-1] + offs).reshape(-1).tolist()) if r.routing else set()
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

    def run(self) -> dict:
        while self.has_work():
            self.step()
        return self.done

    # -- results -------------------------------------------------------------------------------
    def trace(self):
        """The routing of every fed token, as a cache_policy Trace (one sequence per request, by id)."""
        from cache_policy.traces import Trace
        reqs = [self.done[i] for i in sorted(self.done) if self.done[i].routing]
        per_req = [np.concatenate(r.routing) for r in reqs]
        ids = np.concatenate(per_req).astype(np.int64)                       # ids: [tokens, L, k]
        lens = [len(x) for x in per_req]
        from ..quant import COST_DTYPE
        m = self.store.m
        return Trace(ids=ids, seq_offsets=np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
                     num_experts=self.model.cfg.num_experts, model=self.model.cfg.model_type,
                     layer_numbers=np.array(self.model.cfg.moe_layers), expert_bytes=m.blob_bytes,
                     expert_dtype=COST_DTYPE.get(m.expert_format))

    def summary(self) -> dict:
        steps = self.steps
        gen = sum(len(r.output) for r in self.done.values())
        secs = sum(s.seconds for s in steps)
        hits = {k: sum(s.hits[k] for s in steps) for k in TIERS}
        need = sum(hits.values())
        ttft = [r.first_token_time - r.arrival for r in self.done.values() if r.first_token_time]
        p = self.pf_stats
        return {"steps": len(steps), "generated_tokens": gen, "seconds": secs,
                "tokens_per_s": gen / secs if secs else 0.0,
                "decode_tokens_per_s": (sum(s.batch for s in steps if s.tokens == s.batch) /
                                        max(1e-9, sum(s.seconds for s in steps if s.tokens == s.batch))),
                "mean_ttft_s": float(np.mean(ttft)) if ttft else None,
                "hits": hits, "hit_rate_device": hits["device"] / need if need else None,
                "bytes": {k: sum(s.bytes[k] for s in steps) for k in LINKS},
                "stall_seconds": sum(s.stall_seconds for s in steps),
                "mean_unique_experts_per_layer": float(np.mean([np.mean(s.unique_experts) for s in steps])) if steps else 0.0,
                "prefetch": {"precision": p["correct"] / p["predicted"] if p["predicted"] else None,
                             "recall": p["correct"] / p["needed"] if p["needed"] else None,
                             **self.store.snapshot()["prefetch"]},
                "computed": dict(self.store.stats.computed),
                "host_compute_seconds": self.store.stats.host_compute_seconds,
                "device_is_stand_in": self.store.device_is_stand_in}
