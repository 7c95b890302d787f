"""What one forward pass knows beyond its activations: which sequences, where their tokens go in the
cache, their rotary angles, and the hooks of the step (vLLM's ``ForwardContext`` / nano-vllm's
``Context``). Built once per forward by the model; every layer reads it, none edits another's part.

``StepHooks`` is what the engine hands one forward: the step number, cache-aware routing's bonus and the
two callbacks. The model keeps none of it between forwards (the engine passes it to every ``forward``)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from .cache import PagedKV
from .rope import RotaryEmbedding, signed_sin


@dataclass(frozen=True)
class StepHooks:
    step: int = 0                    # placement time (the engine's step number)
    cache_bonus: float = 0.0         # cache-aware routing: added to resident experts' router logits
    record: "Optional[Callable]" = None    # record(moe_idx, ids [tokens, k]): the routing of every token
    # routed(moe_idx, used experts, hidden [tokens, hidden]): called as soon as MoE layer moe_idx has routed
    # and asked the store for its experts - before they compute - so the prefetch for the next layer starts
    # while this layer's experts run (its loads overlap this layer's compute, as replay models it)
    routed: "Optional[Callable]" = None
    # prompt_logprobs: the sequences (Sequence objects of this forward) whose every token's logits are wanted, not
    # only their last token's; token_logits(seq, first row, logits [rows, vocab]) hears them, a few rows at a time
    every_token: tuple = ()
    token_logits: "Optional[Callable]" = None
    # speculative decoding's drafters that read the target's hidden states (MTP): token_hidden(seq, first row,
    # hidden [rows, width]) hears every sequence's rows after the final norm (vLLM's convention for MTP), or the
    # hyper-connected streams before the head's collapse, flat, where the model's draft_rows says so (DeepSeek-V4)
    token_hidden: "Optional[Callable]" = None


NO_HOOKS = StepHooks()


@dataclass
class ForwardContext:
    seqs: list                       # Sequence of each chunk
    spans: list                      # (start, end) of each chunk's tokens in the flat batch
    decode: bool                     # one token per sequence: the batched paths
    kv: PagedKV
    hooks: StepHooks = NO_HOOKS      # the engine's step number and callbacks
    # decode: position, write slot [B] and read slots [B, n] of each sequence (padded with slot 0, masked)
    pos: "torch.Tensor | None" = None
    write: "torch.Tensor | None" = None
    read: "torch.Tensor | None" = None
    # decode: (cos, sin) [B, rotary]; prefill: one (cos, sin) [new, rotary] per sequence
    rope: "tuple | list | None" = None
    # the same broadcast over heads with the signed sin (GQA layers): decode [B, 1, rotary]; prefill per sequence
    rope_heads: "tuple | list | None" = None
    prefill: "list | None" = None    # per sequence: (write slots of the new tokens, read slots of its context)
    state: "torch.Tensor | None" = None   # decode: each sequence's state slot [B]
    fresh: "torch.Tensor | None" = None   # decode: slots of sequences on their first token (start from zeros)
    # rope_heads of the sliding-window layers' own RoPE (a model with a RoPE per layer type: Mellum), else None
    window_rope_heads: "tuple | list | None" = None
    masks: dict = field(default_factory=dict)   # masks made once per forward, shared by the layers that use them
    tokens: "torch.Tensor | None" = None  # token ids of the forward [tokens] (DeepSeek-V4's hash-routed layers)


def build_context(seqs: list, chunks: list, kv: PagedKV, rope: RotaryEmbedding, *, rope_heads: bool,
                  device, hooks: StepHooks = NO_HOOKS) -> ForwardContext:
    """Token slots and rotary angles of this forward, computed once for every layer."""
    spans, a = [], 0
    for c in chunks:
        spans.append((a, a + len(c)))
        a += len(c)
    decode = all(b - a == 1 for a, b in spans)
    ctx = ForwardContext(seqs=seqs, spans=spans, decode=decode, kv=kv, hooks=hooks)
    if decode:
        pos = [s.length for s in seqs]
        n = max(pos) + 1
        if len(seqs) == 1 and seqs[0].slot_ids.numel() >= n:       # one sequence: views, no copies
            ctx.read = seqs[0].slot_ids[:n].view(1, n)
            ctx.write = seqs[0].slot_ids[pos[0]:pos[0] + 1]
        else:
            ctx.read = torch.stack([s.slot_ids[:n] if s.slot_ids.numel() >= n else
                                    torch.cat([s.slot_ids, s.slot_ids.new_zeros(n - s.slot_ids.numel())]) for s in seqs])
            ctx.write = torch.stack([s.slot_ids[p] for s, p in zip(seqs, pos)])
        ctx.pos = torch.tensor(pos, device=device)
        tables = rope.decode(pos)
        ctx.rope = tables[:2] if tables is not None else rope(ctx.pos)   # cos, sin: [B, rotary]
        if kv.state_slots:
            ctx.state = torch.tensor([s.state for s in seqs], device=device)
            fresh = [s.state for s in seqs if s.length == 0]
            ctx.fresh = torch.tensor(fresh, device=device) if fresh else None
        if rope_heads:
            cos, sin = ctx.rope
            ctx.rope_heads = (cos[:, None], (tables[2] if tables is not None else signed_sin(sin))[:, None])
        return ctx
    ctx.prefill = [(s.slot_ids[s.length:s.length + b - a], s.slot_ids[:s.length + b - a]) for s, (a, b) in zip(seqs, spans)]
    ctx.rope = [rope(torch.arange(s.length, s.length + b - a, device=device)) for s, (a, b) in zip(seqs, spans)]
    if rope_heads:
        ctx.rope_heads = [(c[:, None], signed_sin(s_)[:, None]) for c, s_ in ctx.rope]
    return ctx


def rope_heads_of(ctx: ForwardContext, rope: RotaryEmbedding, device) -> "tuple | list":
    """A second RoPE's tables in ``rope_heads``' form for this forward's positions (decode: [B, 1, rotary] each;
    prefill: one pair per sequence)."""
    if ctx.decode:
        tables = rope.decode([s.length for s in ctx.seqs])
        if tables is not None:
            return tables[0][:, None], tables[2][:, None]
        cos, sin = rope(ctx.pos)
        return cos[:, None], signed_sin(sin)[:, None]
    out = []
    for s, (a, b) in zip(ctx.seqs, ctx.spans):
        cos, sin = rope(torch.arange(s.length, s.length + b - a, device=device))
        out.append((cos[:, None], signed_sin(sin)[:, None]))
    return out
