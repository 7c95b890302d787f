"""The engine's KV manager: which sequence holds which blocks of the model's cache (block tables, free
lists, the prefix cache's blocks and state snapshots). The model allocates nothing; it reads the slot tables
(runtime/model/layers/cache.py ``Sequence``) this fills, over its ``PagedKV`` tensors."""
from __future__ import annotations

from collections import OrderedDict

import torch

from ..model.layers.cache import KVFull, PagedKV, Sequence


class KVManager:
    """The free lists of the cache (nano-vllm's block manager, vLLM's KVCacheManager): KV blocks of
    ``block_size`` tokens and per-sequence slots (recurrent state, sliding-window rings). It hands them to
    sequences and takes them back - the one allocator: the model only reads the slot tables - and holds no
    tensor (``copy_state`` is the cache's). The scheduler admits and preempts by what it says is free.

    Prefix caching (vLLM's automatic prefix caching): a full block whose tokens a sequence has fed is
    registered under its tokens and its parent block (``register``), so the chain of keys names a whole
    prefix exactly (no hash to collide: the key holds the tokens, and the parent's identity changes when
    it is evicted). Blocks are counted by reference; a registered block nobody holds stays cached,
    evictable in LRU order (a freed sequence's tail first), and is taken back only when no plain free block
    is left. ``match`` hands a new sequence the cached blocks of its prompt's longest cached prefix.

    A salt (vLLM's ``cache_salt``) is the parent of a prompt's first block (``_root``), so the whole chain of a
    salted prompt is keyed apart: blocks are shared only between sequences with the same salt, and unsalted
    sequences share only with each other. Without it one client could tell from another's time to first token
    (or ``cached_tokens``) whether a prefix was sent before: the prefix cache's timing side channel.

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

    @staticmethod
    def _root(salt: "str | None"):
        """The parent of a prompt's first block: None unsalted; a salt's tagged tuple (never a block's
        (block, generation) pair) otherwise."""
        return None if salt is None else ("salt", salt)

    def _chain(self, tokens: list, n: int, salt: "str | None" = None) -> list:
        """The cached blocks of ``tokens``' first ``n`` full blocks (under ``salt``), as far as they are cached."""
        bs, got, parent = self.block_size, [], self._root(salt)
        for i in range(n):
            b = self.cached.get((parent, tuple(tokens[i * bs:(i + 1) * bs])))
            if b is None:
                break
            got.append(b)
            parent = (b, self.gen[b])
        return got

    def match(self, seq: Sequence, tokens: list, salt: "str | None" = None) -> int:
        """Give a sequence that holds nothing the cached blocks of ``tokens``' longest cached prefix of full
        blocks under ``salt`` - leaving at least one token to feed (its logits are needed) - and, with
        per-sequence state, a state slot holding the state after them (the prefix then ends at its deepest block
        with a snapshot); returns the tokens it covers."""
        if seq.blocks or seq.state is not None or (self.state_slots and not self.snapshots):
            return 0
        bs = self.block_size
        self.queries += len(tokens)
        got = self._chain(tokens, (len(tokens) - 1) // bs, salt)
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

    def snapshot(self, seq: Sequence, tokens: list, salt: "str | None" = None) -> None:
        """File the sequence's state (it has fed exactly ``seq.length`` tokens, a whole number of blocks) under the
        cached block that ends there (``salt``: the sequence's) - once per block; the least recently used snapshot
        makes room."""
        bs = self.block_size
        n = seq.length // bs
        if not self.snapshots or seq.state is None or n == 0 or seq.length % bs:
            return
        chain = self._chain(tokens, n, salt)
        if len(chain) < n:
            return                                  # not all of it cached (evicted meanwhile): nothing to file under
        b = chain[-1]
        if b in self.snap:
            self.snap.move_to_end(b)
            return
        slot = self.free_snap.pop() if self.free_snap else self.snap.popitem(last=False)[1]
        self.copy_state(seq.state, slot)
        self.snap[b] = slot

    def register(self, seq: Sequence, tokens: list, salt: "str | None" = None) -> None:
        """Register the sequence's full blocks fed since the last call (``tokens``: at least its fed ones; ``salt``:
        the sequence's, the same at every call). A block whose prefix is cached already in another block stays
        unregistered (one copy is cached)."""
        bs = self.block_size
        parent = seq.parent if seq.hashed else self._root(salt)
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
        """Take back a sequence's blocks and state slot (nothing where it holds none)."""
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

    @classmethod
    def for_cache(cls, kv: PagedKV) -> "KVManager":
        """The manager of ``kv``'s blocks and slots (its geometry), copying state through ``kv``'s tensors."""
        return cls(kv.num_blocks, kv.block_size, kv.state_slots, kv.device, snapshots=kv.snapshots,
                   copy_state=kv.copy_state)

    @classmethod
    def for_model(cls, model) -> "KVManager":
        """The manager of ``model``'s cache, which is made (``init_kv``'s defaults) if the model has none yet:
        for running ``model.forward`` without an engine (``prepare`` before each forward, ``release`` after)."""
        if model.kv is None:
            model.init_kv()
        return cls.for_cache(model.kv)

    def prepare(self, seqs: list, chunks: list) -> None:
        """Give every sequence the blocks (and state slot) its chunk needs before a forward; KVFull names the
        first that cannot get them (what it took before stays with it)."""
        for sq, c in zip(seqs, chunks):
            if not self.ensure(sq, sq.length + len(c)):
                raise KVFull(f"the KV cache ({self.num_blocks} blocks of {self.block_size} tokens"
                             + (f", {self.state_slots} sequence slots" if self.state_slots else "")
                             + f") has no free block for a sequence of {sq.length + len(c)} tokens")
