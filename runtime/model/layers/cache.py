"""Per-layer cache specs and the one preallocated cache they share (vLLM's KV cache specs).

The model owns the cache's tensors (``PagedKV``) and reads each sequence's slot table (``Sequence``: its
blocks, token slots and state slot); who gets which block is the engine's (runtime/engine/kv_manager.py
``KVManager``, the one allocator)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..config import MoEConfig
from ..linear_attention import RECURRENT_DTYPE


@dataclass
class Sequence:
    """One sequence: tokens fed so far and the KV blocks it owns (none until it runs)."""

    length: int = 0
    blocks: list = field(default_factory=list)
    slot_ids: "torch.Tensor | None" = None     # token slot of each position its blocks cover
    state: "int | None" = None                 # its slot of the recurrent-state arena (linear-attention layers)
    hashed: int = 0                            # its leading full blocks registered in the prefix cache
    cached_to: int = 0                         # tokens of its prompt the prefix cache held when it was admitted
    parent: "tuple | None" = None              # the cached (block, generation) its last registered block's key is

    @property
    def slot(self):            # "holds KV" (kept for callers that asked for a slot)
        return self.blocks or None


class KVFull(RuntimeError):
    """The KV cache has no free block for a sequence (the engine preempts or refuses first)."""


@dataclass(frozen=True)
class TokenCacheSpec:
    """What a per-token attention layer caches (vLLM's attention KV cache spec): ``heads`` x ``dim``
    per token for k (and v), full attention and MLA alike (MLA: one "head" of latent + rotary key,
    no v)."""
    heads: int
    dim: int
    with_v: bool = True

    def bytes_per_token(self, dtype) -> int:
        return self.heads * self.dim * torch.tensor([], dtype=dtype).element_size() * (2 if self.with_v else 1)


@dataclass(frozen=True)
class WindowCacheSpec:
    """What a sliding-window layer caches per sequence: its last ``window`` keys (and values) in a
    ring, whatever the context length (vLLM's sliding-window spec, without paging)."""
    heads: int
    dim: int
    window: int
    with_v: bool = True

    def bytes_per_sequence(self, dtype) -> int:
        return self.window * TokenCacheSpec(self.heads, self.dim, self.with_v).bytes_per_token(dtype)


@dataclass(frozen=True)
class StateCacheSpec:
    """What a linear-attention layer caches per sequence, whatever its length (vLLM's Mamba spec): the
    recurrent state (float32) and the short convolution's last inputs (activation dtype)."""
    recurrent: tuple           # [H, K, V]
    conv: tuple                # [C, kernel - 1]

    def bytes_per_sequence(self, dtype) -> int:
        return (math.prod(self.recurrent) * RECURRENT_DTYPE.itemsize
                + math.prod(self.conv) * torch.tensor([], dtype=dtype).element_size())


def kv_block_size(cfg: MoEConfig, default: int = 16) -> int:
    """Tokens per KV block: ``default``, or a multiple of every DeepSeek-V4 compress rate (its compressed
    entries live in the blocks, block_size / rate per block)."""
    b = default
    for r in (cfg.compress_rates or {}).values():
        b = math.lcm(b, int(r))
    return b


class V4Arena:
    """One DeepSeek-V4 layer's cache (layers/v4_attention.py ``CompressedCacheSpec``): per state slot the
    window ring and the compressor's open window (``state``: name -> [slots, ...]), and the compressed
    entries (``comp`` [blocks x block_size / rate, dim]; CSA's indexer keys ``icomp``), entry e of a
    sequence in the block that holds its window's first position."""

    def __init__(self, spec, num_blocks: int, block_size: int, slots: int, dtype, device) -> None:
        self.spec, self.block_size = spec, block_size
        self.state = {k: torch.zeros(slots, *shape, dtype=dtype, device=device) for k, shape in spec.state_shapes().items()}
        self.epb = spec.entries_per_block(block_size)
        n = num_blocks * self.epb
        self.comp = torch.zeros(n, spec.dim, dtype=dtype, device=device) if spec.rate else None
        self.icomp = torch.zeros(n, spec.index_dim, dtype=dtype, device=device) if spec.index_dim else None

    @property
    def nbytes(self) -> int:
        ts = list(self.state.values()) + [t for t in (self.comp, self.icomp) if t is not None]
        return sum(t.numel() * t.element_size() for t in ts)

    def _slot(self, seq: Sequence, e: int) -> int:
        p = e * self.spec.rate
        return seq.blocks[p // self.block_size] * self.epb + (p % self.block_size) // self.spec.rate

    def rows(self, seq: Sequence, name: str):
        """(read(count) -> the sequence's first ``count`` rows [count, dim], write(e, row)) of arena
        ``name`` (comp or icomp); (None, None) where the layer has none."""
        arena = getattr(self, name)
        if arena is None:
            return None, None

        def read(count: int):
            p = torch.arange(count, device=arena.device) * self.spec.rate           # each entry's first position
            blocks = torch.as_tensor(seq.blocks[: -(-count * self.spec.rate // self.block_size)] or [0],
                                     device=arena.device)
            return arena[blocks[p // self.block_size] * self.epb + (p % self.block_size) // self.spec.rate]

        def write(e: int, row) -> None:
            arena[self._slot(seq, e)] = row
        return read, write


class PagedKV:
    """Every layer's sequence cache, preallocated from one byte budget and never grown: the tensors. The
    blocks and slots are handed out by the engine's ``KVManager`` (runtime/engine/kv_manager.py), made from
    this cache's geometry (``num_blocks``, ``block_size``, ``state_slots``, ``snapshots``); the model only
    reads the slot tables of the sequences it runs.

    Per-token layers (full attention, MLA): fixed-size blocks (vLLM's paged layout): k and v are
    [token layers, blocks * block_size, heads, dim] token slots; a sequence owns a list of blocks
    and its positions map to slots through them. Linear-attention and sliding-window layers:
    ``state_slots`` fixed per-sequence caches (recurrent states [state layers, slots, ...]; rings of
    the last ``window`` keys and values [window layers, slots, window, heads, dim], position p at
    p % window); a sequence owns one slot for all of them. MLA caches one "head" (latent + rotary
    key) and no v. ``snapshots`` more state slots hold the prefix cache's snapshots (KVManager.snapshot)."""

    def __init__(self, layers: int, heads: int, dim: int, dtype, device, *, num_blocks: int, block_size: int = 16,
                 with_v: bool = True, state: "StateCacheSpec | None" = None, state_layers: int = 0,
                 state_slots: int = 0, window: "WindowCacheSpec | None" = None, window_layers: int = 0,
                 v4: "list | tuple" = (), snapshots: int = 0) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"KV cache needs at least one block of at least one token, got {num_blocks} x {block_size}")
        if (state_layers or window_layers or v4) and state_slots < 1:
            raise ValueError("a model with linear-attention or sliding-window layers needs at least one sequence slot")
        self.with_v, self.device = with_v, device
        self.num_blocks, self.block_size = num_blocks, block_size
        T = num_blocks * block_size
        self.k = torch.zeros(layers, T, heads, dim, dtype=dtype, device=device)   # k: [layers, token slots, heads, dim]
        self.v = torch.zeros_like(self.k) if with_v else None
        stateful = bool(state_layers or window_layers or v4)
        # per-sequence state: the sequences' slots, then the prefix cache's snapshots
        self.state_slots = state_slots if stateful else 0
        self.snapshots = snapshots if stateful else 0
        slots = self.state_slots + self.snapshots
        self.v4 = [V4Arena(spec, num_blocks, block_size, slots, dtype, device) for spec in v4]
        self.rec = self.conv = self.win_k = self.win_v = None
        if state_layers:              # rec: [state layers, slots, H, K, V]; conv: [state layers, slots, C, kernel-1]
            self.rec = torch.zeros(state_layers, slots, *state.recurrent, dtype=RECURRENT_DTYPE, device=device)
            self.conv = torch.zeros(state_layers, slots, *state.conv, dtype=dtype, device=device)
        if window_layers:             # win_k: [window layers, slots, window, heads, dim]
            self.win_k = torch.zeros(window_layers, slots, window.window, window.heads, window.dim, dtype=dtype,
                                     device=device)
            self.win_v = torch.zeros_like(self.win_k) if window.with_v else None

    def copy_state(self, src: int, dst: int) -> None:
        """Copy state slot ``src`` into ``dst``: every per-sequence tensor (recurrent and convolution states,
        window rings, DeepSeek-V4's windows)."""
        for t in (self.rec, self.conv, self.win_k, self.win_v):
            if t is not None:
                t[:, dst] = t[:, src]               # t: [layers, slots, ...]
        for a in self.v4:
            for t in a.state.values():
                t[dst] = t[src]                     # t: [slots, ...]

    def check(self, seqs: list, chunks: list) -> None:
        """Every sequence holds the blocks (and state slot) its chunk needs: the engine's KVManager.prepare gave
        them; the model allocates nothing."""
        for j, (sq, c) in enumerate(zip(seqs, chunks)):
            need = sq.length + len(c)
            if len(sq.blocks) * self.block_size < need or (self.state_slots and sq.state is None):
                raise ValueError(f"sequence {j} holds KV blocks for {len(sq.blocks) * self.block_size} tokens"
                                 + (" and no state slot" if self.state_slots and sq.state is None else "")
                                 + f", the forward feeds it to {need}: blocks come from the engine's KVManager "
                                 "(runtime/engine/kv_manager.py, prepare) before the forward")

    @property
    def nbytes(self) -> int:
        n = self.k.numel() * self.k.element_size() * (2 if self.with_v else 1)
        for t in (self.rec, self.conv, self.win_k, self.win_v):
            if t is not None:
                n += t.numel() * t.element_size()
        return n + sum(a.nbytes for a in self.v4)
