"""The base of every eviction policy (``EvictionPolicy``, its contract in policies.py), the lazy
score heap most of them build on, and what a policy fitted on a trace reads (``fit_source``).

Its own module so that the policies built on it in other modules (reuse.py) and the registry that
lists them all (policies.py) import it in one direction.
"""
from __future__ import annotations

import heapq
from typing import Iterable

_EMPTY: tuple = ()


class EvictionPolicy:
    name = "base"
    needs_trace = False   # static (a profile) and belady (the future) cannot run on a live store
    wants: "str | None" = None
    clears_each_step = False
    # Optional whole-group fast path: group_access(pool, keys, t) -> (n_hits, evicted), used when
    # the group fits in the pool. It must leave the same state as on_hit / evict / on_insert.
    group_access = None

    @classmethod
    def for_replay(cls, trace, cfg, future=None, batch: int = 1):
        """A factory of this policy's instances for one replay (``cache_policy.replay``): ``trace`` is
        the replayed trace, ``cfg`` its ReplayConfig, ``future`` the next-use oracle, ``batch`` its
        batch size. A live store calls the class with no argument."""
        return cls

    def on_hit(self, keys: list, t: int, aux) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def on_insert(self, keys: list, t: int, aux) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def evict(self, n: int, protected) -> list:  # pragma: no cover - interface
        raise NotImplementedError

    def forget(self, key: int) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def bind(self, *, num_layers: int, num_experts: int, scope: str = "global") -> "EvictionPolicy":
        """The model's geometry, given by TieredPlacement when it makes a pool (a flat key is
        layer * num_experts + expert). Only policies that reason per layer (reuse) need it."""
        return self

    def on_bypass(self, keys: list, t: int, aux) -> None:
        """Keys needed now but computed on the host without being loaded (hybrid execution).
        Nothing is resident or evicted; a policy that keeps usage statistics may count the use."""

    def on_demand(self, keys: list, t: int) -> None:
        """A demand group arrives whole (before its hits and loads are reported). Lets a policy
        tell demand loads from prefetches without ``aux`` (the live store passes none)."""

    def initial_residents(self, keys: Iterable[int], capacity: int) -> list:
        """Keys to load before the first step (warm start). Only `static` has any."""
        return []


class _ScoreHeap(EvictionPolicy):
    """Evict the lowest score first. A lazy min-heap over resident keys: stale entries (the key
    was re-scored or left) are skipped when popped, so a score change costs one push."""

    keep_history = False  # keep scores of keys that left (bounded by the number of experts)

    def __init__(self) -> None:
        self.score: dict = {}
        self.live: set = set()
        self.heap: list = []

    def _push(self, k, s):
        self.score[k] = s
        if k in self.live:
            heapq.heappush(self.heap, (s, k))
            if len(self.heap) > 8 * len(self.live) + 256:
                score = self.score
                self.heap = [(score[key], key) for key in self.live]
                heapq.heapify(self.heap)

    def evict(self, n, protected):
        out, skipped = [], []
        heap, score, live = self.heap, self.score, self.live
        while len(out) < n and heap:
            s, k = heapq.heappop(heap)
            if k not in live or score.get(k) != s:
                continue  # stale entry
            if k in protected:
                skipped.append((s, k))
                continue
            out.append(k)
            live.discard(k)
            if not self.keep_history:
                del score[k]
        for e in skipped:
            heapq.heappush(heap, e)
        return out

    def forget(self, key):
        self.live.discard(key)
        if not self.keep_history:
            self.score.pop(key, None)


def fit_source(trace, cfg):
    """The trace a policy is fitted on: ``--fit-trace`` when given (its geometry must match), else
    the replayed trace itself."""
    src = cfg.fit_trace if cfg.fit_trace is not None else trace
    if (src.num_layers, src.num_experts) != (trace.num_layers, trace.num_experts):
        raise ValueError(f"--fit-trace {src.source} has {src.num_layers} layers x {src.num_experts} experts, "
                         f"the replayed trace {trace.num_layers} x {trace.num_experts}")
    return src
