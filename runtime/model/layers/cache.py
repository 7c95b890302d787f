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
class CacheTensor:
    """One tensor a cache spec declares, per layer: ``shape`` per row, ``dtype`` (None: the activation
    dtype). ``per = "slot"``: one row per state slot (a sequence's fixed cache, or a prefix-cache snapshot);
    ``per = "block"``: rows in the KV blocks, one per ``rate`` positions (block_size / rate per block)."""
    shape: tuple
    per: str
    dtype: "torch.dtype | None" = None
    rate: int = 1

    def nbytes(self, rows: int, dtype) -> int:
        return rows * math.prod(self.shape) * torch.tensor([], dtype=self.dtype or dtype).element_size()


@dataclass(frozen=True)
class TokenCacheSpec:
    """What a per-token attention layer caches (vLLM's attention KV cache spec): ``heads`` x ``dim``
    per token for k (and v), full attention and MLA alike (MLA: one "head" of latent + rotary key,
    no v)."""
    heads: int
    dim: int
    with_v: bool = True
    v_dim: int = 0             # values' head dim where it differs from the keys' (MiMo-V2-Flash); 0: dim

    def bytes_per_token(self, dtype) -> int:
        v = (self.v_dim or self.dim) if self.with_v else 0
        return self.heads * (self.dim + v) * torch.tensor([], dtype=dtype).element_size()

    def cache_tensors(self) -> dict:
        """k (and v): [token slots, heads, dim] (v: [token slots, heads, v_dim]), a row per position in the
        sequence's blocks."""
        t = CacheTensor((self.heads, self.dim), "block")
        return {"k": t, "v": CacheTensor((self.heads, self.v_dim or self.dim), "block")} if self.with_v else {"k": t}


@dataclass(frozen=True)
class WindowCacheSpec:
    """What a sliding-window layer caches per sequence: its last ``window`` keys (and values) in a
    ring, whatever the context length (vLLM's sliding-window spec, without paging)."""
    heads: int
    dim: int
    window: int
    with_v: bool = True
    v_dim: int = 0             # as TokenCacheSpec's

    def bytes_per_sequence(self, dtype) -> int:
        return self.window * TokenCacheSpec(self.heads, self.dim, self.with_v, self.v_dim).bytes_per_token(dtype)

    def cache_tensors(self) -> dict:
        """k (and v): [slots, window, heads, dim] (v: ... v_dim), position p at p % window."""
        t = CacheTensor((self.window, self.heads, self.dim), "slot")
        if not self.with_v:
            return {"k": t}
        return {"k": t, "v": CacheTensor((self.window, self.heads, self.v_dim or self.dim), "slot")}


@dataclass(frozen=True)
class StateCacheSpec:
    """What a linear-attention layer caches per sequence, whatever its length (vLLM's Mamba spec): the
    recurrent state (float32) and the short convolution's last inputs (activation dtype)."""
    recurrent: tuple           # [H, K, V]
    conv: tuple                # [C, kernel - 1]

    def bytes_per_sequence(self, dtype) -> int:
        return (math.prod(self.recurrent) * RECURRENT_DTYPE.itemsize
                + math.prod(self.conv) * torch.tensor([], dtype=dtype).element_size())

    def cache_tensors(self) -> dict:
        """recurrent: [slots, H, K, V] float32; conv: [slots, C, kernel - 1]."""
        return {"recurrent": CacheTensor(self.recurrent, "slot", RECURRENT_DTYPE),
                "conv": CacheTensor(self.conv, "slot")}


def kv_block_size(cfg: MoEConfig, default: int = 16) -> int:
    """Tokens per KV block: ``default``, or a multiple of every DeepSeek-V4 compress rate (its compressed
    entries live in the blocks, block_size / rate per block)."""
    b = default
    for r in (cfg.compress_rates or {}).values():
        b = math.lcm(b, int(r))
    return b


class LayerCache:
    """One layer's cache tensors, by the names its spec declares (``cache_tensors``): views into its spec
    group's tensors. ``slot`` tensors are [slots, ...]; ``block`` tensors [blocks * block_size / rate, ...]."""

    def __init__(self, spec, block_size: int, tensors: dict) -> None:
        self.spec, self.block_size, self.tensors = spec, block_size, tensors

    def __getattr__(self, name: str):
        try:
            return self.__dict__["tensors"][name]
        except KeyError:
            raise AttributeError(f"{type(self.__dict__.get('spec')).__name__} declares no cache tensor {name!r}") from None

    def slot_tensors(self) -> dict:
        """name -> [slots, ...]: the per-sequence part (what a state copy copies)."""
        return {k: self.tensors[k] for k, t in self.spec.cache_tensors().items() if t.per == "slot"}


class PagedKV:
    """Every layer's sequence cache, preallocated from one byte budget and never grown: the tensors. The
    blocks and slots are handed out by the engine's ``KVManager`` (runtime/engine/kv_manager.py), made from
    this cache's geometry (``num_blocks``, ``block_size``, ``state_slots``, ``snapshots``); the model only
    reads the slot tables of the sequences it runs.

    Generic over what the layers declare (vLLM's KV cache groups): ``specs`` maps each layer to its cache
    spec; the layers whose specs are equal form a group and each of the group's declared tensors
    (``cache_tensors``) is allocated once for all of them, [group layers, rows, ...]. Rows: per-token
    tensors (paged attention's k / v, MLA's latent, DeepSeek-V4's compressed entries) live in fixed-size
    blocks (vLLM's paged layout), a sequence's positions mapping to rows through its blocks; per-sequence
    tensors (recurrent states, sliding-window rings, V4's windows) have ``state_slots`` rows, one per
    running sequence, then ``snapshots`` more for the prefix cache's snapshots (KVManager.snapshot). A
    layer reads its own tensors, ``kv[layer]`` (a ``LayerCache``)."""

    def __init__(self, specs: dict, dtype, device, *, num_blocks: int, block_size: int = 16, state_slots: int = 0,
                 snapshots: int = 0) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"KV cache needs at least one block of at least one token, got {num_blocks} x {block_size}")
        decl = {spec: spec.cache_tensors() for spec in set(specs.values())}
        stateful = any(t.per == "slot" for ts in decl.values() for t in ts.values())
        if stateful and state_slots < 1:
            raise ValueError("a model with linear-attention or sliding-window layers needs at least one sequence slot")
        for spec, ts in decl.items():
            for name, t in ts.items():
                if t.per not in ("slot", "block") or (t.per == "block" and block_size % t.rate):
                    raise ValueError(f"{type(spec).__name__} tensor {name!r}: per {t.per!r} rate {t.rate} does not "
                                     f"fit blocks of {block_size} tokens")
        self.device, self.num_blocks, self.block_size = device, num_blocks, block_size
        # per-sequence state: the sequences' slots, then the prefix cache's snapshots
        self.state_slots = state_slots if stateful else 0
        self.snapshots = snapshots if stateful else 0
        slots = self.state_slots + self.snapshots
        self.groups, self.layers = [], {}          # groups: (spec, layers, {name: [layers, rows, ...]})
        for spec in sorted(decl, key=lambda s: min(i for i, x in specs.items() if x == s)):
            members = sorted(i for i, x in specs.items() if x == spec)
            group = {name: torch.zeros(len(members), slots if t.per == "slot" else num_blocks * block_size // t.rate,
                                       *t.shape, dtype=t.dtype or dtype, device=device)
                     for name, t in decl[spec].items()}
            self.groups.append((spec, members, group))
            for j, i in enumerate(members):
                self.layers[i] = LayerCache(spec, block_size, {name: g[j] for name, g in group.items()})

    def __getitem__(self, layer: int) -> LayerCache:
        try:
            return self.layers[layer]
        except KeyError:
            raise KeyError(f"layer {layer} has no cache here (this cache holds layers {sorted(self.layers)})") from None

    def _slot_tensors(self):
        for spec, _, group in self.groups:
            for name, t in spec.cache_tensors().items():
                if t.per == "slot":
                    yield group[name]                # [layers, slots, ...]

    def copy_state(self, src: int, dst: int) -> None:
        """Copy state slot ``src`` into ``dst``: every per-sequence tensor every layer declares."""
        for t in self._slot_tensors():
            t[:, dst] = t[:, src]

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
        return sum(t.numel() * t.element_size() for _, _, g in self.groups for t in g.values())
