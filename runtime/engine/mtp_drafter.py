"""Speculative decoding's MTP drafter: the checkpoint's own multi-token-prediction layers (runtime/model/mtp.py)
propose the next k tokens of each request (vLLM's ``--speculative-config '{"method": "deepseek_mtp"}'``, SGLang's
NEXTN). ``--speculative mtp``; it registers itself in speculative.py's DRAFTERS as "mtp".

The MTP layer at position i reads the token t[i + 1] and the target's hidden state h[i] after its final norm, and its
logits are the distribution of t[i + 2]. So each target request has one MTP ``Sequence`` in the drafter's own paged
KV cache (``MTPModel.init_kv``, as many token slots as the target's cache) whose position i pairs target position
pos0 + i with its hidden state:

- ``prefilled`` / ``verified`` hand over the target's normed hidden states of the rows it fed (a prompt chunk; the
  last fed token and each kept draft). They wait in ``pending`` until the next ``propose``.
- ``propose``: one catch-up forward over every pending position of every request (the tokens after them are known:
  the prompt and the kept output) - its last row's logits give draft 1 -, then k - 1 chained single-token forwards
  batched over the requests still drafting, each feeding the previous draft's token and the layer's own output at
  the previous position (before shared_head.norm: vLLM's chaining). Greedy requests take the argmax, sampled ones a
  draw from the request's temperature / top-k / top-p / min-p distribution (q, returned for the accept / reject
  rule). The chained positions are speculative: the sequence's length goes back to the caught-up positions after
  drafting (a paged cache's rollback), and the next catch-up rewrites them with the target's hidden states.
- A gap in the hidden states (the prefix cache skipped a prompt's cached blocks, a preempted request recomputed)
  restarts the request's MTP sequence at the first position it has: its drafts then attend to fewer positions (the
  target's verification keeps the output exact whatever the drafts are). So does a request that has not drafted
  for MAX_PENDING positions (the cost rule chose k = 0): only its last MAX_PENDING hidden states are kept.

With several MTP layers in the checkpoint the first drafts every token (vLLM's chaining of one layer; the others'
caches would need their own catch-up). The MTP experts are tiered by their own ExpertStore: device slots for the
same fraction of them as the target's device tier holds of its experts.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..model.layers.cache import KVFull, Sequence
from ..model.layers.context import StepHooks
from ..model.mtp import load_mtp
from .kv_manager import KVManager
from .request import SAMPLING_EPS, distribution
from .spec_draft import DraftTiming
from .speculative import DRAFTERS, NO_DRAFT, Draft, SpecOptions


@dataclass
class _Mirror:
    """One target request's MTP state: its sequence, the target position of its position 0, the target's hidden
    states of the positions after the sequence's length not fed yet."""
    seq: Sequence = field(default_factory=Sequence)
    pos0: int = 0
    pending: list = field(default_factory=list)      # [rows, hidden] tensors, in position order
    gen: "torch.Generator | None" = None

    @property
    def known(self) -> int:
        """Target positions whose hidden state this mirror has (fed or pending): 0 .. known - 1."""
        return self.pos0 + self.seq.length + sum(int(h.shape[0]) for h in self.pending)


@dataclass
class _Work:
    """One request's drafting this step: its index in propose's lists, its catch-up chunk (the token after each
    pending position) and their hidden states [len(chunk), hidden], the drafts made so far and their q rows."""
    i: int
    r: object
    m: _Mirror
    k: int
    chunk: list
    hidden: torch.Tensor
    tokens: list = field(default_factory=list)
    qs: list = field(default_factory=list)


class MTPDrafter:
    """The Drafter protocol (runtime/engine/speculative.py) over an ``MTPModel``."""
    wants_hidden = True
    # hidden-state rows kept per request between drafts (a request the cost rule keeps at k = 0 hands them over at
    # every step): past this, its MTP sequence restarts at the last ones
    MAX_PENDING = 2048

    def __init__(self, mtp, cache_tokens: int, state_slots: int = 1) -> None:
        self.mtp = mtp
        mtp.init_kv(cache_tokens, state_slots=state_slots)   # state: DeepSeek-V4's window rings, one per request
        self.kv = KVManager.for_cache(mtp.kv)
        self.mirrors: dict = {}                       # target request id -> _Mirror
        self.timing = DraftTiming()
        self.restarts = 0                             # mirrors restarted at a gap in the hidden states
        self._step = 0

    # -- the Drafter protocol ------------------------------------------------------------------
    def prefilled(self, r, hidden: "torch.Tensor | None") -> None:
        """A prompt chunk ran: its rows' hidden states cover the target positions up to its sequence's length."""
        if hidden is not None:
            self._take(r, r.seq.length, hidden)

    def verified(self, r, accepted: int, hidden: "torch.Tensor | None") -> None:
        """A decode step of r ran: the rows kept (the last fed token, each kept draft) end before the token it
        emitted last (not fed yet)."""
        if hidden is not None and not r.finished:
            self._take(r, len(r.prompt) + len(r.output) - 1, hidden)

    def release(self, r) -> None:
        m = self.mirrors.pop(r.id, None)
        if m is not None:
            self.kv.release(m.seq)

    def propose(self, reqs: list, ks: list) -> list:
        t0 = time.perf_counter()
        out = [NO_DRAFT for _ in reqs]
        work = []
        for i, (r, k) in enumerate(zip(reqs, ks)):
            m = self.mirrors.get(r.id)
            ctx = list(r.prompt) + list(r.output)
            if k <= 0 or m is None or not m.pending or m.known != len(ctx) - 1:
                continue                              # nothing new to read (or a state it cannot draft from)
            a = m.pos0 + m.seq.length                 # first pending target position
            chunk = ctx[a + 1:]                       # the token after each pending position
            try:
                self.kv.prepare([m.seq], [chunk + [0] * (int(k) - 1)])   # room for the chained drafts too
            except KVFull:
                continue
            work.append(_Work(i, r, m, int(k), chunk, torch.cat(m.pending)))
        if work:
            self._draft(work, out)
        self.timing.proposed(out, t0)
        return out

    def close(self) -> None:
        for m in self.mirrors.values():
            self.kv.release(m.seq)
        self.mirrors.clear()
        if self.mtp.experts is not None:              # dense MTP layers (ERNIE 4.5, MiMo-V2-Flash) have none
            self.mtp.experts.close()

    # -- internals -----------------------------------------------------------------------------
    def _take(self, r, end: int, hidden: torch.Tensor) -> None:
        """hidden [rows, hidden]: the target's normed hidden states of positions end - rows .. end - 1."""
        m = self.mirrors.get(r.id)
        if m is None:
            m = self.mirrors[r.id] = _Mirror()
            seed = getattr(r.params, "seed", None)
            # its own generator: the drafts' draws never shift the target's sampling stream (r.gen)
            m.gen = torch.Generator().manual_seed(seed + 0x3A7B) if seed is not None else None
            m.pos0 = end - int(hidden.shape[0])
        start, known = end - int(hidden.shape[0]), m.known
        if start > known:                             # a gap: restart the sequence at what we have
            self.kv.release(m.seq)
            m.seq, m.pos0, m.pending = Sequence(), start, []
            self.restarts += 1
            known = start
        if end > known:
            m.pending.append(hidden[known - start:].detach())
        rows = sum(int(h.shape[0]) for h in m.pending)
        if rows > self.MAX_PENDING:                   # a request that does not speculate for long: keep the tail
            tail = torch.cat(m.pending)[-self.MAX_PENDING:]
            self.kv.release(m.seq)
            m.seq, m.pos0, m.pending = Sequence(), end - self.MAX_PENDING, [tail]
            self.restarts += 1

    def _forward(self, seqs: list, chunks: list, hidden: torch.Tensor):
        try:
            return self.mtp.forward(seqs, chunks, hidden, hooks=StepHooks(step=self._step))
        finally:
            if self.mtp.experts is not None:
                self.mtp.experts.end_step()
            self._step += 1
            self.timing.forwards += 1

    def _pick(self, r, m: _Mirror, logits: torch.Tensor) -> "tuple[int, torch.Tensor | None]":
        """The next draft from the MTP logits [vocab]: argmax for a greedy request, else a draw from its distribution
        q (float32 [vocab], returned for the accept / reject rule)."""
        if r.params.temperature < SAMPLING_EPS:
            return int(logits.argmax()), None
        q = distribution(logits, r.params)                       # q: [vocab] float64
        if not bool(torch.isfinite(q).all()) or not q.sum() > 0:
            q = torch.nn.functional.one_hot(logits.argmax(), logits.shape[-1]).double()
        return int(torch.multinomial(q, 1, generator=m.gen)), q.float()

    def _draft(self, work: list, out: list) -> None:
        """The catch-up forward (draft 1 from each chunk's last row), then k - 1 chained forwards; the sequences go
        back to their caught-up length."""
        step = self._forward([w.m.seq for w in work], [w.chunk for w in work], torch.cat([w.hidden for w in work]))
        ends = torch.cumsum(torch.tensor([len(w.chunk) for w in work]), 0) - 1
        prev, logits = step.hidden[ends], step.logits             # prev: [n, hidden], each chunk's last output
        caught = [w.m.seq.length for w in work]
        saved = self.mtp.save_state([w.m.seq for w in work])     # the chained drafts write into the state too
        for w in work:
            w.m.pending = []
        live = list(work)
        while True:
            for w, row in zip(live, logits):
                t, q = self._pick(w.r, w.m, row)
                w.tokens.append(t)
                w.qs.append(q)
            keep = [j for j, w in enumerate(live) if len(w.tokens) < w.k]
            live, prev = [live[j] for j in keep], prev[keep]
            if not live:
                break
            step = self._forward([w.m.seq for w in live], [[w.tokens[-1]] for w in live], prev)
            prev, logits = step.hidden, step.logits
        self.mtp.restore_state([w.m.seq for w in work], saved)
        for w, n in zip(work, caught):
            w.m.seq.length = n                        # the chained positions were speculative
            out[w.i] = Draft(w.tokens, None if w.qs[0] is None else torch.stack(w.qs))



def _mtp(engine, spec: SpecOptions) -> MTPDrafter:
    """The drafter of the engine's store's MTP layers: device slots for the same fraction of their experts as the
    target's device tier holds of its own (the host holds them all: load_mtp), computed on the host where the
    target's are; a KV cache of as many token slots as the target's."""
    if getattr(engine.model, "tp", None) is not None:
        raise ValueError("--speculative mtp runs on one process: not with --tensor-parallel / --pipeline-parallel (a "
                         "rank holds a slice of the model the MTP layers would have to be split like)")
    store = engine.store
    cap, total = store.capacity_bytes(), store.m.num_layers * store.m.num_experts * store.m.blob_stride
    on_host = all(store.compute_on_host(m) for m in range(store.m.num_layers))    # e.g. a CPU's one memory
    mtp = load_mtp(store.dir, engine.model, device_fraction=cap["device"] / total, on_host=on_host)
    return MTPDrafter(mtp, engine.kv.num_blocks * engine.kv.block_size, state_slots=engine.kv.state_slots or 1)


DRAFTERS["mtp"] = _mtp
