"""Eviction policies. Each one decides *which* resident expert leaves; none of them moves bytes.

A policy instance tracks exactly the keys resident in one pool (the pool tells it about every
insert and removal) and is called once per group - the experts one layer needs in one step -
never once per token, so the per-call cost is amortised over the group.

Contract (see ``placement.Pool``):
  on_hit(keys, t, aux)      resident keys needed now; refresh them (called before any load)
  on_insert(keys, t, aux)   keys just loaded (demand or prefetch)
  evict(n, protected)       choose up to n tracked keys not in ``protected``, forget and return them
  forget(key)               key removed for another reason (inclusive-tier back-invalidation)
``t`` is the step index. ``aux`` is a list aligned with ``keys`` carrying what ``wants`` names:
"weights" (router weight summed over the step's tokens) or "next_use" (group index of the key's
next need, for Belady), or None.
"""
from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from typing import Callable

import numpy as np

from .policy_base import _EMPTY, EvictionPolicy, _ScoreHeap, fit_source  # noqa: F401 - re-exported: policies are imported from here
from .reuse import Reuse, ReuseStats  # noqa: F401 - ReuseStats re-exported

INF = float("inf")


class LRU(EvictionPolicy):
    """Least recently used, on an OrderedDict (C-level move-to-end and pop-front).

    A group that fits the pool is taken in one pass: in the group's (ascending) order each hit
    is refreshed and each miss loaded at the most-recent end, then the pool's excess is evicted
    from the least-recent end - never a key of the group, which all sit at the other end. So
    after a group its keys are the most recent in ascending order, hits and loads alike. (A group
    in waves refreshes its hits first, then loads each wave: see Pool.access.)
    """

    name = "lru"

    def __init__(self) -> None:
        self.order = OrderedDict()   # resident keys, least recent first

    def group_access(self, pool, keys, t):
        od = self.order
        mte = od.move_to_end
        n_hits = 0
        for k in keys:
            if k in od:
                mte(k)
                n_hits += 1
            else:
                od[k] = None
        if n_hits == len(keys):
            return n_hits, _EMPTY
        over = len(od) - pool.capacity
        res = pool.resident
        if over > 0:
            pop = od.popitem
            evicted = []
            for _ in range(over):
                evicted.append(pop(False)[0])
            res.difference_update(evicted)
        else:
            evicted = _EMPTY
        res.update(keys)
        return n_hits, evicted

    @staticmethod
    def run(pools: list, keys: list, bounds: list, layer: int, hits_out) -> int:
        """``group_access`` for a run of groups in one loop (replay's hot path): group j is
        keys[bounds[j]:bounds[j+1]] at layer (layer + j) % len(pools); pools[l] is (policy,
        pool) of layer l. Appends each group's hit count to hits_out; returns evictions. Every
        group must fit its pool. Pool.resident is brought up to date at the end."""
        L = len(pools)
        ods = [p.order for p, _ in pools]
        caps = [pool.capacity for _, pool in pools]
        add = hits_out.append
        evictions = 0
        a = bounds[0]
        for b in bounds[1:]:
            od = ods[layer]
            mte = od.move_to_end
            n = 0
            for k in keys[a:b]:
                if k in od:
                    mte(k)
                    n += 1
                else:
                    od[k] = None
            over = len(od) - caps[layer]
            if over > 0:
                evictions += over
                pop = od.popitem
                for _ in range(over):
                    pop(False)
            add(n)
            a = b
            layer += 1
            if layer == L:
                layer = 0
        seen = set()
        for p, pool in pools:
            if id(pool) not in seen:
                seen.add(id(pool))
                pool.resident.clear()
                pool.resident.update(p.order)
        return evictions

    def on_hit(self, keys, t, aux):
        mte = self.order.move_to_end
        for k in keys:
            mte(k)

    def on_insert(self, keys, t, aux):
        od = self.order
        for k in keys:
            od[k] = None

    def evict(self, n, protected):
        od = self.order
        out = []
        for k in od:
            if k not in protected:
                out.append(k)
                if len(out) == n:
                    break
        for k in out:
            del od[k]
        return out

    def forget(self, key):
        self.order.pop(key, None)


class _DecayedScore(_ScoreHeap):
    """score_k(t) = sum over past uses of w * 2^-((t - t_use)/half_life).

    Stored as sum of w * g^(t_use - t0) with g = 2^(1/half_life): multiplying every score by the
    same decay factor never changes their order, so old popularity fades without touching every
    key each step. Rescaled before the increments overflow. Scores of experts that left the pool
    are kept (at most one per expert), so a re-loaded expert keeps its popularity.
    """

    keep_history = True

    def __init__(self, half_life: float) -> None:
        super().__init__()
        if not (half_life > 0 and math.isfinite(half_life)):
            raise ValueError(f"{self.name}: half-life must be a positive number of steps, got {half_life!r}")
        self.log_g = math.log(2.0) / half_life
        self.t0 = 0
        self._t_cached = None
        self._inc = 1.0

    def _increment(self, t):
        if t != self._t_cached:
            x = (t - self.t0) * self.log_g
            if x > 600:  # rescale everything by the same factor: order is unchanged
                f = math.exp(-x)
                self.score = {k: v * f for k, v in self.score.items()}
                self.heap = [(self.score[k], k) for k in self.live]
                heapq.heapify(self.heap)
                self.t0, x = t, 0.0
            self._t_cached, self._inc = t, math.exp(x)
        return self._inc

    def on_hit(self, keys, t, aux):
        inc = self._increment(t)
        score, push = self.score, self._push
        if aux is None:
            for k in keys:
                push(k, score.get(k, 0.0) + inc)
        else:
            for k, w in zip(keys, aux):
                push(k, score.get(k, 0.0) + inc * w)

    def on_insert(self, keys, t, aux):
        self.live.update(keys)
        if aux is None and self.wants == "weights":
            # A prefetch: enter with the learned score, do not invent a use.
            score, push = self.score, self._push
            for k in keys:
                push(k, score.get(k, 0.0))
            return
        self.on_hit(keys, t, aux)


class LFU(_DecayedScore):
    """Least frequently used, with decay: each use counts 1, halving every `half_life` steps."""

    name = "lfu"

    def __init__(self, half_life: float = 1024.0) -> None:
        super().__init__(half_life)

    @classmethod
    def for_replay(cls, trace, cfg, future=None, batch=1):
        return lambda: cls(cfg.lfu_half_life)


class Freq(_DecayedScore):
    """Routing frequency: exponential moving average of each expert's router weight.

    EMA with factor `ema` per step, s <- (1-ema) s + ema * w (w = 0 in steps that do not route
    to the expert). Without weights in the trace, w is the number of the step's tokens routed
    to the expert. A prefetched expert enters with the score it has, so an unused prefetch of a
    cold expert is the first to go.
    """

    name = "freq"
    wants = "weights"

    def __init__(self, ema: float = 0.05) -> None:
        if not 0.0 < ema < 1.0:
            raise ValueError(f"freq: ema must be in (0, 1), got {ema!r}")
        super().__init__(half_life=math.log(2.0) / -math.log1p(-ema))

    @classmethod
    def for_replay(cls, trace, cfg, future=None, batch=1):
        return lambda: cls(cfg.freq_ema)


class Static(_ScoreHeap):
    """Pins the hottest experts of a profile (llama.cpp --n-cpu-moe, KTransformers, Fiddler).

    Scores are fixed, from a training trace; the pool is filled with the top experts before the
    first step. A miss evicts the lowest-scored resident not needed now, so the hottest experts
    stay and the coldest slots stream - the same as pinning the top-N with N = capacity minus
    the slots that streaming needs.
    """

    name = "static"
    needs_trace = True

    @classmethod
    def for_replay(cls, trace, cfg, future=None, batch=1):
        prof = static_profile(fit_source(trace, cfg))
        return lambda: cls(prof)

    def __init__(self, profile: dict) -> None:
        super().__init__()
        if not profile:
            raise ValueError("static: needs a non-empty profile (fit it on a training trace with --fit-trace)")
        self.profile = profile

    def on_hit(self, keys, t, aux):
        pass

    def on_insert(self, keys, t, aux):
        self.live.update(keys)
        p = self.profile
        for k in keys:
            self._push(k, p.get(k, 0.0))

    def initial_residents(self, keys, capacity):
        p = self.profile
        ranked = sorted(keys, key=lambda k: (-p.get(k, 0.0), k))
        return [k for k in ranked[:capacity] if p.get(k, 0.0) > 0]


class Belady(_ScoreHeap):
    """MIN: evict the resident whose next use is farthest in the future. The offline optimum for
    demand loading; every report shows it as the bound. Needs the future: ``aux`` carries each
    key's next-use group index; prefetched keys (no aux) ask ``next_use_fn``."""

    name = "belady"
    needs_trace = True
    wants = "next_use"

    def __init__(self, next_use_fn: "Callable[[int], float] | None" = None) -> None:
        super().__init__()
        self.next_use_fn = next_use_fn

    @classmethod
    def for_replay(cls, trace, cfg, future=None, batch=1):
        return lambda: cls(future)

    def _set(self, keys, aux):
        if aux is None:
            if self.next_use_fn is None:
                raise ValueError("belady: loaded a key without its next use; belady needs the whole trace")
            aux = [self.next_use_fn(k) for k in keys]
        for k, nu in zip(keys, aux):
            self._push(k, -nu)  # min-heap on -next_use = max next use first

    def on_hit(self, keys, t, aux):
        self._set(keys, aux)

    def on_insert(self, keys, t, aux):
        self.live.update(keys)
        self._set(keys, aux)


class NoCache(EvictionPolicy):
    """Load on demand, keep nothing beyond the current step (the pool clears at each step)."""

    name = "none"
    clears_each_step = True

    def __init__(self) -> None:
        self.keys: dict = {}

    def on_hit(self, keys, t, aux):
        pass

    def on_insert(self, keys, t, aux):
        self.keys.update(dict.fromkeys(keys))

    def evict(self, n, protected):
        out = [k for k in self.keys if k not in protected][:n]
        for k in out:
            del self.keys[k]
        return out

    def forget(self, key):
        self.keys.pop(key, None)


def static_profile(trace, scope_keys=None) -> dict:
    """Access counts per flat key on a training trace: the `static` policy's scores."""
    L, E = trace.num_layers, trace.num_experts
    flat = (trace.ids.astype(np.int64) + (np.arange(L) * E)[None, :, None]).reshape(-1)
    counts = np.bincount(flat, minlength=L * E)
    return {int(k): float(c) for k, c in enumerate(counts) if c > 0}


POLICIES = {c.name: c for c in (LRU, LFU, Freq, Static, Belady, NoCache, Reuse)}
LIVE_POLICIES = tuple(n for n, c in POLICIES.items() if not c.needs_trace)   # the built-in ones


def register_policy(cls) -> type:
    """Add an eviction policy (a subclass of EvictionPolicy with a unique ``name``): replay, the live
    store and the CLI take it by name. Usable as a class decorator."""
    if not (isinstance(cls, type) and issubclass(cls, EvictionPolicy)) or cls.name in ("base", ""):
        raise ValueError(f"{cls!r}: a policy is an EvictionPolicy subclass with its own name")
    POLICIES[cls.name] = cls
    return cls


def live_policies() -> tuple:
    """Policies a live store can run (those that need no trace), registered ones included."""
    return tuple(n for n, c in POLICIES.items() if not c.needs_trace)


def check_policy_name(name: str, live: bool = False) -> str:
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")
    if live and POLICIES[name].needs_trace:
        raise ValueError(f"policy {name!r} needs a trace (a profile or the future); a live store takes "
                         f"{', '.join(live_policies())}")
    return name
