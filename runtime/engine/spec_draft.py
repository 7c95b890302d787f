"""Speculative decoding's draft-model drafter: a smaller model with the target's tokenizer proposes the next k
tokens of each request (vLLM's ``--speculative-config '{"model": ...}'``, llama.cpp's ``-md``).

The draft model is loaded from any store we read (a converted store, or a Hugging Face checkpoint folder through
its cached conversion - runtime/model/store_cache.py), with its own expert store and its own paged KV cache
(``KVManager.for_model``): nothing of it is shared with the target. Each target request has one draft ``Sequence``
that mirrors the target's tokens (prompt + accepted output):

- ``prefilled``: each prompt chunk the target runs, the draft runs too (its prompt is prefilled beside the target's).
- ``propose``: the draft first catches up on the tokens it has not fed (the target's token after the last accepted
  draft, any accepted draft it never fed - or the whole prompt of a request it never saw), one chunk per request,
  all requests in one forward; the last row's logits give draft 1. Then k - 1 single-token forwards (batched over
  the requests still drafting) give drafts 2..k: greedy (argmax) for greedy requests, else sampled from the draft's
  distribution at the request's temperature / top-k / top-p / min-p (``request.distribution``), whose rows are
  returned as q [k, vocab] for the accept / reject rule. The k-th draft is not fed: if it is accepted the next
  catch-up feeds it with the target's token.
- ``verified``: the first ``accepted`` drafts were kept, so the draft sequence rolls back to the context it drafted
  from plus those of them it fed - with a paged KV cache that is a length reset (positions past the length are
  never read, and are overwritten when fed again). ``propose`` also checks the fed tokens against the target's and
  rolls back to their common prefix, so a missed ``verified`` (a preemption, an abort) never drafts from a wrong
  context.
- ``release``: the request's blocks go back to the draft's cache.

Draft models with per-sequence state (linear attention's recurrent state, sliding-window rings, DeepSeek-V4's
compressor windows) cannot roll back by a length reset - their state has absorbed the rejected drafts - and are
refused (a snapshot / restore per verify step is not implemented). A vocabulary-size mismatch with the target is
refused too: the accept / reject rule compares distributions over the same token ids.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..model import load_model
from ..model.layers.cache import KVFull, Sequence, kv_block_size
from ..model.layers.context import StepHooks
from ..model.store_cache import resolve_model
from .kv_manager import KVManager
from .request import SAMPLING_EPS, distribution
from .speculative import DRAFTERS, Draft


@dataclass
class DraftTiming:
    """What drafting has cost so far (the cost rule's live DraftCost for kind "model" reads it): forwards of the
    draft model, tokens proposed, wall seconds inside ``propose``."""
    calls: int = 0
    forwards: int = 0
    tokens: int = 0
    seconds: float = 0.0
    prefill_seconds: float = 0.0     # feeding prompts beside the target's prefill (not drafting)

    @property
    def seconds_per_token(self) -> "float | None":
        return self.seconds / self.tokens if self.tokens else None

    def proposed(self, drafts: list, t0: float) -> None:
        """One ``propose`` call that began at perf_counter ``t0`` and returned ``drafts``."""
        self.calls += 1
        self.tokens += sum(len(d.tokens) for d in drafts)
        self.seconds += time.perf_counter() - t0


@dataclass
class _Mirror:
    """One target request's draft state: its sequence in the draft's cache and the tokens that sequence has fed
    (a prefix of the target's prompt + output, plus drafts not yet verified)."""
    seq: Sequence = field(default_factory=Sequence)
    fed: list = field(default_factory=list)
    base: int = 0                    # tokens of the target's context when the last drafts were made
    drafted_fed: int = 0             # of those drafts, how many the draft sequence fed (k - 1)
    gen: "torch.Generator | None" = None


def _common_prefix(a: list, b: list) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class DraftModelDrafter:
    """The Drafter protocol (runtime/engine/speculative.py) over a draft ``MoEModel`` with its own store and KV
    cache. ``target_vocab``: the target's vocabulary size (must equal the draft's)."""
    wants_hidden = False

    def __init__(self, model, store, target_vocab: int, *, name: str = "the draft model",
                 kv_tokens: "int | None" = None) -> None:
        V = model.cfg.vocab_size
        if V != target_vocab:
            raise ValueError(f"--draft-model: {name} has a vocabulary of {V} tokens and the target model "
                             f"{target_vocab}: a draft model must share the target's tokenizer (the same vocabulary "
                             f"size)")
        if model.state_bytes_per_sequence():
            raise ValueError(f"--draft-model: {name} ({model.cfg.model_type}) keeps per-sequence state (linear "
                             f"attention, sliding-window rings or compressor windows), which rejected drafts cannot "
                             f"be rolled back out of; choose a draft model of full-attention layers only")
        self.model, self.store, self.name = model, store, name
        if model.kv is None and kv_tokens:
            # as many tokens as the target's cache holds: every sequence the target runs fits (init_kv's default,
            # 16 sequences of 4096 tokens, would reserve far more than a small engine's)
            model.init_kv(num_blocks=max(1, -(-int(kv_tokens) // kv_block_size(model.cfg))))
        self.kv = KVManager.for_model(model)          # the draft's own cache: its blocks are nobody else's
        self.max_positions = model.cfg.max_position_embeddings
        self.mirrors: dict = {}                       # target request id -> _Mirror
        self.timing = DraftTiming()
        self._step = 0

    @classmethod
    def load(cls, path: str, target_vocab: int, *, device: "str | None" = None,
             kv_tokens: "int | None" = None) -> "DraftModelDrafter":
        """The drafter of the model at ``path`` (a store or a checkpoint folder), every expert of it resident (a
        draft model is small: it is chosen to be cheap next to the target); ``kv_tokens``: its KV cache's size
        (None: init_kv's default)."""
        try:
            store_dir = resolve_model(path)
        except ValueError as e:
            raise ValueError(f"--draft-model: {e}") from None
        model, store = load_model(store_dir, device=device)
        try:
            return cls(model, store, target_vocab, name=f"--draft-model {path}", kv_tokens=kv_tokens)
        except ValueError:
            store.close()
            raise

    # -- the Drafter protocol ------------------------------------------------------------------
    def propose(self, reqs: list, ks: list) -> list:
        """One ``Draft`` per request: up to ``ks[i]`` tokens following r.prompt + r.output (fewer, or none, when
        the draft's context or KV cache runs out)."""
        t0 = time.perf_counter()
        out = [Draft([]) for _ in reqs]
        work = []                                       # (index, request, mirror, k, chunk)
        for i, (r, k) in enumerate(zip(reqs, ks)):
            ctx = list(r.prompt) + list(r.output)
            k = min(int(k), self.max_positions - len(ctx))
            if k <= 0:
                continue
            m = self._mirror(r)
            self._sync(m, ctx)
            chunk = ctx[m.seq.length:]
            try:
                self.kv.prepare([m.seq], [chunk + [0] * (k - 1)])   # room for the chunk and the k - 1 fed drafts
            except KVFull:
                self.release(r)                         # no room in the draft's cache: no drafts this step
                continue
            m.base, m.drafted_fed = len(ctx), 0
            work.append((i, r, m, k, chunk))
        if work:
            self._draft(work, out)
        self.timing.proposed(out, t0)
        return out

    def verified(self, r, accepted: int, hidden=None) -> None:
        """The first ``accepted`` drafts were kept: roll the draft sequence back to its context at drafting time
        plus the accepted drafts it fed (a length reset of the paged cache)."""
        m = self.mirrors.get(r.id)
        if m is None:
            return
        keep = m.base + min(int(accepted), m.drafted_fed)
        if keep < m.seq.length:
            m.seq.length = keep
            del m.fed[keep:]
        # settled: a later call without drafts (a plain decode step: accepted 0) leaves it as it is
        m.base, m.drafted_fed = m.seq.length, 0

    def prefilled(self, r, hidden=None) -> None:
        """A prompt chunk of r ran on the target: the draft feeds the same prompt tokens now, so its prompt is
        prefilled with the target's (time to first token) and not by the first decode step that drafts. Its
        seconds are kept apart (``DraftTiming.prefill_seconds``): the rule prices drafting per drafted token."""
        t0 = time.perf_counter()
        m = self._mirror(r)
        self._sync(m, list(r.prompt) + list(r.output) + [-1])        # (-1: no token; keeps all that matches)
        chunk = list(r.prompt[m.seq.length:min(r.fed, len(r.prompt))])
        if not chunk or m.seq.length + len(chunk) > self.max_positions:
            return
        try:
            self.kv.prepare([m.seq], [chunk])
        except KVFull:
            self.release(r)                             # no room: propose catches up later, if there is room then
            return
        self._forward([m.seq], [chunk])
        m.fed.extend(chunk)
        m.base, m.drafted_fed = m.seq.length, 0
        self.timing.prefill_seconds += time.perf_counter() - t0

    def release(self, r) -> None:
        m = self.mirrors.pop(r.id, None)
        if m is not None:
            self.kv.release(m.seq)

    def close(self) -> None:
        for m in self.mirrors.values():
            self.kv.release(m.seq)
        self.mirrors.clear()
        self.store.close()

    # -- internals -----------------------------------------------------------------------------
    def _mirror(self, r) -> _Mirror:
        m = self.mirrors.get(r.id)
        if m is None:
            m = self.mirrors[r.id] = _Mirror()
            seed = getattr(r.params, "seed", None)
            # its own generator: the draft's draws never shift the target's sampling stream (r.gen)
            m.gen = torch.Generator().manual_seed(seed + 0x5EED) if seed is not None else None
        return m

    def _sync(self, m: _Mirror, ctx: list) -> None:
        """Roll the draft sequence back to the longest prefix it shares with the target's context, leaving at
        least one token to feed (its logits give the first draft)."""
        keep = min(_common_prefix(m.fed, ctx), len(ctx) - 1)
        if keep < m.seq.length:
            m.seq.length = keep
        del m.fed[keep:]

    def _forward(self, seqs: list, chunks: list) -> torch.Tensor:
        """One forward of the draft model over its own cache; logits of each chunk's last token [len(seqs), vocab]."""
        hooks = StepHooks(step=self._step)
        try:
            return self.model.forward(seqs, chunks, hooks)
        finally:
            self.store.end_step()
            self._step += 1
            self.timing.forwards += 1

    def _pick(self, r, m: _Mirror, logits: torch.Tensor) -> "tuple[int, torch.Tensor | None]":
        """The next draft token from the draft's logits [vocab]: argmax for a greedy request, else a draw from
        its distribution q (float32 [vocab], returned for the accept / reject rule)."""
        if r.params.temperature < SAMPLING_EPS:
            return int(logits.argmax()), None
        q = distribution(logits, r.params)                       # q: [vocab] float64
        if not bool(torch.isfinite(q).all()) or not q.sum() > 0:
            q = torch.nn.functional.one_hot(logits.argmax(), logits.shape[-1]).double()
        # the draw on the CPU where the request's generator lives (a seeded one is a CPU generator); q stays on the
        # model's device, where the target's rows are
        draw = q.cpu() if m.gen is not None else q
        return int(torch.multinomial(draw, 1, generator=m.gen)), q.float()

    def _draft(self, work: list, out: list) -> None:
        """Catch-up forward (draft 1 from its last row), then k - 1 batched single-token forwards."""
        logits = self._forward([m.seq for _, _, m, _, _ in work], [c for *_, c in work])   # logits: [n, vocab]
        for _, _, m, _, c in work:
            m.fed.extend(c)
        toks = {i: [] for i, *_ in work}
        qs = {i: [] for i, *_ in work}
        live = list(range(len(work)))                   # rows of `work` still drafting
        while True:
            for row, j in enumerate(live):
                i, r, m, _, _ = work[j]
                t, q = self._pick(r, m, logits[row])
                toks[i].append(t)
                qs[i].append(q)
            live = [j for j in live if len(toks[work[j][0]]) < work[j][3]]
            if not live:
                break
            seqs = [work[j][2].seq for j in live]
            chunks = [[toks[work[j][0]][-1]] for j in live]
            logits = self._forward(seqs, chunks)        # one token per sequence: the batched decode path
            for j, c in zip(live, chunks):
                work[j][2].fed.extend(c)
                work[j][2].drafted_fed += 1
        for i, r, _, _, _ in work:
            probs = None if qs[i][0] is None else torch.stack(qs[i])      # probs: [k, vocab] float32
            out[i] = Draft(toks[i], probs)


def _draft_factory(engine, spec) -> DraftModelDrafter:
    """DRAFTERS["draft"]: the drafter of ``--draft-model`` on the target engine's device, its KV cache as many
    tokens as the target's."""
    kv = engine.kv
    return DraftModelDrafter.load(spec.draft_model, engine.model.cfg.vocab_size, device=engine.store.device,
                                  kv_tokens=kv.num_blocks * kv.block_size)


DRAFTERS["draft"] = _draft_factory      # speculative.make_drafter imports this module, which registers it
