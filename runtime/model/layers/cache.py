"""Per-layer cache specs and the one preallocated cache they share (vLLM's KV cache specs)."""
from __future__ import annotations

import math
from collections import OrderedDict
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


class BlockManager:
    """The free lists of the cache (nano-vllm's block manager): KV blocks of ``block_size`` tokens and
    per-sequence slots (recurrent state, sliding-window rings). It hands them to sequences and takes
    them back; it holds no tensor. The scheduler admits and preempts by what it says is free.

    Prefix caching (vLLM's automatic prefix caching): a full block whose tokens a sequence has fed is
    registered under its tokens and its parent block (``register``), so the chain of keys names a whole
    prefix exactly (no hash to collide: the key holds the tokens, and the parent's identity changes when
    it is evicted). Blocks are counted by reference; a registered block nobody holds stays cached,
    evictable in LRU order (a freed sequence's tail first), and is taken back only when no plain free block
    is left. ``match`` hands a new sequence the cached blocks of its prompt's longest cached prefix.

    Models with per-sequence state (linear attention's recurrent state, sliding-window rings, DeepSeek-V4's
    compressor windows) need that state at the prefix's end too, and it is not in any block: ``snapshot`` copies
    a sequence's state, at a block boundary, into one of ``snapshots`` spare state slots, filed under the block
    that ends there (vLLM's prefix caching for hybrid models caches the state at block boundaries the same way).
    A prefix then matches only up to its deepest block with a snapshot, which ``match`` copies into the new
    sequence's own slot (``copy_state(src, dst)``, the cache's tensors). Snapshots are evicted LRU, and with the
    block they belong to."""

    def __init__(self, num_blocks: int, block_size: int, state_slots: int, device, snapshots: int = 0,
                 copy_state=None) -> None:
        self.num_blocks, self.block_size, self.state_slots, self.device = num_blocks, block_size, state_slots, device
        self.free: list = list(range(num_blocks - 1, -1, -1))
        self.free_state: list = list(range(state_slots - 1, -1, -1))
        # state slots state_slots .. state_slots + snapshots - 1 hold snapshots (no sequence runs in them)
        self.snapshots = snapshots if state_slots else 0
        self.free_snap: list = list(range(state_slots + self.snapshots - 1, state_slots - 1, -1))
        self.snap: OrderedDict = OrderedDict()    # block -> the snapshot slot of the state after it, LRU first
        self.copy_state = copy_state
        self.ref = [0] * num_blocks               # sequences holding each block
        self.gen = [0] * num_blocks               # bumped when a cached block is evicted: its old key dies
        self.key_of: dict = {}                    # block -> its key (registered blocks)
        self.cached: dict = {}                    # key -> block
        self.evictable: OrderedDict = OrderedDict()   # registered blocks nobody holds, least recently freed first
        self.queries = self.hits = 0              # prompt tokens looked up / found (prefix caching)

    @property
    def free_blocks(self) -> int:
        """Blocks a sequence can get: free ones and cached ones nobody holds (evicted on demand)."""
        return len(self.free) + len(self.evictable)

    def _take(self) -> int:
        if self.free:
            return self.free.pop()
        b, _ = self.evictable.popitem(last=False)      # the least recently freed cached block
        key = self.key_of.pop(b)
        if self.cached.get(key) == b:
            del self.cached[key]
        self.gen[b] += 1
        s = self.snap.pop(b, None)            # the state after an evicted block can no longer be matched
        if s is not None:
            self.free_snap.append(s)
        return b

    def _slots(self, blocks: list) -> torch.Tensor:
        bs = self.block_size
        return (torch.tensor(blocks, dtype=torch.long)[:, None] * bs + torch.arange(bs)[None, :]).reshape(-1).to(
            self.device)

    def _chain(self, tokens: list, n: int) -> list:
        """The cached blocks of ``tokens``' first ``n`` full blocks, as far as they are cached."""
        bs, got, parent = self.block_size, [], None
        for i in range(n):
            b = self.cached.get((parent, tuple(tokens[i * bs:(i + 1) * bs])))
            if b is None:
                break
            got.append(b)
            parent = (b, self.gen[b])
        return got

    def match(self, seq: Sequence, tokens: list) -> int:
        """Give a sequence that holds nothing the cached blocks of ``tokens``' longest cached prefix of full
        blocks - leaving at least one token to feed (its logits are needed) - and, with per-sequence state, a
        state slot holding the state after them (the prefix then ends at its deepest block with a snapshot);
        returns the tokens it covers."""
        if seq.blocks or seq.state is not None or (self.state_slots and not self.snapshots):
            return 0
        bs = self.block_size
        self.queries += len(tokens)
        got = self._chain(tokens, (len(tokens) - 1) // bs)
        seq.cached_to = len(got) * bs
        if self.state_slots:
            while got and got[-1] not in self.snap:
                got.pop()
            if got:
                seq.state = self.free_state.pop()      # admission saw a free slot
                self.copy_state(self.snap[got[-1]], seq.state)
                self.snap.move_to_end(got[-1])
        for b in got:
            if self.ref[b] == 0:
                del self.evictable[b]
            self.ref[b] += 1
        if got:
            seq.blocks, seq.hashed, seq.length = list(got), len(got), len(got) * bs
            seq.parent = (got[-1], self.gen[got[-1]])
            seq.slot_ids = self._slots(got)
        self.hits += len(got) * bs
        return len(got) * bs

    def snapshot(self, seq: Sequence, tokens: list) -> None:
        """File the sequence's state (it has fed exactly ``seq.length`` tokens, a whole number of blocks) under the
        cached block that ends there - once per block; the least recently used snapshot makes room."""
        bs = self.block_size
        n = seq.length // bs
        if not self.snapshots or seq.state is None or n == 0 or seq.length % bs:
            return
        chain = self._chain(tokens, n)
        if len(chain) < n:
            return                                  # not all of it cached (evicted meanwhile): nothing to file under
        b = chain[-1]
        if b in self.snap:
            self.snap.move_to_end(b)
            return
        slot = self.free_snap.pop() if self.free_snap else self.snap.popitem(last=False)[1]
        self.copy_state(seq.state, slot)
        self.snap[b] = slot

    def register(self, seq: Sequence, tokens: list) -> None:
        """Register the sequence's full blocks fed since the last call (``tokens``: at least its fed ones). A
        block whose prefix is cached already in another block stays unregistered (one copy is cached)."""
        bs = self.block_size
        parent = seq.parent if seq.hashed else None
        for i in range(seq.hashed, min(seq.length // bs, len(seq.blocks))):
            b = seq.blocks[i]
            key = (parent, tuple(tokens[i * bs:(i + 1) * bs]))
            c = self.cached.get(key)
            if c is None and b not in self.key_of:
                self.cached[key] = b
                self.key_of[b] = key
            # the next key's parent is the cached copy of this block: a sequence that computed a cached prefix
            # again (admitted beside the request computing it, or restarting from an earlier state snapshot)
            # files what follows under the chain a later request walks
            c = b if c is None else c
            parent = (c, self.gen[c])
        seq.parent = parent
        seq.hashed = max(seq.hashed, seq.length // bs)

    @property
    def free_sequences(self) -> "int | None":
        """Sequences that can still get a state slot; None when the model keeps no per-sequence state."""
        return len(self.free_state) if self.state_slots else None

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def ensure(self, seq: Sequence, tokens: int) -> bool:
        """Give ``seq`` blocks for ``tokens`` positions; False (and nothing taken) if too few are free."""
        need = self.blocks_for(tokens) - len(seq.blocks)
        if self.state_slots and seq.state is None:
            if not self.free_state or need > self.free_blocks:
                return False
            seq.state = self.free_state.pop()    # stale contents: its first chunk starts from zeros (layers/linear.py)
        if need <= 0:
            return True
        if need > self.free_blocks:
            return False
        new = [self._take() for _ in range(need)]
        for b in new:
            self.ref[b] = 1
        seq.blocks.extend(new)
        ids = self._slots(new)
        seq.slot_ids = ids if seq.slot_ids is None else torch.cat([seq.slot_ids, ids])
        return True

    def release(self, seq: Sequence) -> None:
        for b in reversed(seq.blocks):           # the tail first: it is evicted before the shared head
            self.ref[b] -= 1
            if self.ref[b] == 0:
                if b in self.key_of:
                    self.evictable[b] = None
                else:
                    self.free.append(b)
        seq.blocks, seq.slot_ids, seq.hashed, seq.cached_to, seq.parent = [], None, 0, 0, None
        if seq.state is not None:
            self.free_state.append(seq.state)
            seq.state = None


class PagedKV:
    """Every layer's sequence cache, preallocated from one byte budget and never grown: the tensors
    (they live with the model that runs them) and the ``BlockManager`` that hands out their blocks
    and slots (``manager``; the scheduler's view).

    Per-token layers (full attention, MLA): fixed-size blocks (vLLM's paged layout): k and v are
    [token layers, blocks * block_size, heads, dim] token slots; a sequence owns a list of blocks
    and its positions map to slots through them. Linear-attention and sliding-window layers:
    ``state_slots`` fixed per-sequence caches (recurrent states [state layers, slots, ...]; rings of
    the last ``window`` keys and values [window layers, slots, window, heads, dim], position p at
    p % window); a sequence owns one slot for all of them. MLA caches one "head" (latent + rotary
    key) and no v."""

    def __init__(self, layers: int, heads: int, dim: int, dtype, device, *, num_blocks: int, block_size: int = 16,
                 with_v: bool = True, state: "StateCacheSpec | None" = None, state_layers: int = 0,
                 state_slots: int = 0, window: "WindowCacheSpec | None" = None, window_layers: int = 0,
                 v4: "list | tuple" = (), snapshots: int = 0) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"KV cache needs at least one block of at least one token, got {num_blocks} x {block_size}")
        if (state_layers or window_layers or v4) and state_slots < 1:
            raise ValueError("a model with linear-attention or sliding-window layers needs at least one sequence slot")
        self.with_v = with_v
        T = num_blocks * block_size
        self.k = torch.zeros(layers, T, heads, dim, dtype=dtype, device=device)   # k: [layers, token slots, heads, dim]
        self.v = torch.zeros_like(self.k) if with_v else None
        stateful = bool(state_layers or window_layers or v4)
        self.manager = BlockManager(num_blocks, block_size, state_slots if stateful else 0, device,
                                    snapshots=snapshots if stateful else 0, copy_state=self.copy_state)
        # state arenas: the sequences' slots, then the prefix cache's snapshots (BlockManager.snapshot)
        state_slots = state_slots + self.manager.snapshots
        self.v4 = [V4Arena(spec, num_blocks, block_size, state_slots, dtype, device) for spec in v4]
        self.rec = self.conv = self.win_k = self.win_v = None
        if state_layers:              # rec: [state layers, slots, H, K, V]; conv: [state layers, slots, C, kernel-1]
            self.rec = torch.zeros(state_layers, state_slots, *state.recurrent, dtype=RECURRENT_DTYPE, device=device)
            self.conv = torch.zeros(state_layers, state_slots, *state.conv, dtype=dtype, device=device)
        if window_layers:             # win_k: [window layers, slots, window, heads, dim]
            self.win_k = torch.zeros(window_layers, state_slots, window.window, window.heads, window.dim, dtype=dtype,
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

    @property
    def nbytes(self) -> int:
        n = self.k.numel() * self.k.element_size() * (2 if self.with_v else 1)
        for t in (self.rec, self.conv, self.win_k, self.win_v):
            if t is not None:
                n += t.numel() * t.element_size()
        return n + sum(a.nbytes for a in self.v4)

    _MANAGER_VIEW = frozenset(("num_blocks", "block_size", "state_slots", "free_blocks", "free_sequences",
                               "blocks_for", "ensure", "release"))

    def __getattr__(self, name: str):
        # The manager's figures, for callers that hold the cache (only those: no other attribute leaks).
        if name in PagedKV._MANAGER_VIEW:
            return getattr(self.manager, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

