"""Placement: which expert lives in which tier. The one truth for hit rates.

The replay simulator and the live store both call ``TieredPlacement.access`` with the experts one
layer needs in one step, then ``prefetch``; neither decides residency any other way.

Semantics (kept exact so results compare with independent implementations):
- For each step and each layer in order, the needed experts are the union over the step's tokens
  (a *group*), in ascending expert order.
- Needed experts already resident are hits and are refreshed first (``on_hit``). Each missing
  one is loaded, evicting - by the policy - a resident expert not needed by this step and layer.
- If a group needs more experts than its pool holds, the layer runs in *waves*: the resident
  hits plus as many misses as fit form wave 1; each later wave loads up to ``capacity`` more
  misses, evicting experts the layer has already computed. Every needed expert is still counted
  once, as a hit or a miss; the number of waves is reported.
- Tiers are inclusive: the host tier holds everything the device tier holds (a host eviction of
  a device-resident expert also drops the device copy), the disk tier holds every expert.
- Pools: scope ``layer`` gives each layer its own pool of C slots; ``global`` one pool of C slots.
- Hybrid execution: with a ``hybrid`` rule (``cost_model.HybridCost``) a needed expert that is on
  the host but not on the device may be computed on the host instead of moved; it is then not
  loaded into the device tier (the policy hears of it through ``on_bypass``) and counts as a
  device miss served by the host. ``cpu_layers`` = N computes every expert of the first N MoE
  layers on the host (llama.cpp's --n-cpu-moe): they never take a device slot.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

from .keys import SCOPES
from .policies import EvictionPolicy

_EMPTY: tuple = ()


class Access(NamedTuple):
    """Counts of one demand access (a tuple, so the replay loop stores it as it is)."""
    device_hits: int
    host_hits: int         # device misses the host served: moved, or computed there
    disk_loads: int
    waves: int
    prefetch_used: int
    host_computed: int     # of host_hits, computed on the host (hybrid execution)


@dataclass(frozen=True)
class Wave:
    """One wave of a layer whose experts exceed its pool: the experts it computes, those it loads
    first, and those it evicts for them (flat keys)."""
    keys: tuple
    loaded: tuple
    evicted: tuple


@dataclass(frozen=True, slots=True)
class Moves:
    """What a placement decision asks the live store to carry out (flat keys): free the evicted
    slots of each tier, load ``loaded`` onto the device (``from_disk`` of them read from disk first)."""
    loaded: tuple = ()
    from_disk: tuple = ()
    device_evicted: tuple = ()
    host_evicted: tuple = ()


_NO_MOVES = Moves()        # the decision of an access whose experts are all in place (most decode steps)


@dataclass(frozen=True, slots=True)
class Placement:
    """A demand access decided (``TieredPlacement.access_detail``): device hits, the misses to bring
    to the device, the experts computed on the host, the waves, and the moves to carry out."""
    hits: int
    misses: tuple
    host: tuple               # computed on the host from its slot, not moved (hybrid execution)
    waves: int
    prefetch_used: int
    moves: Moves
    wave_plan: "tuple | None" = None    # Wave per wave when waves > 1 (the first one's moves replace ``moves``)


class Pool:
    """One tier's slots for one scope unit: a resident set of at most ``capacity`` keys."""

    __slots__ = ("capacity", "policy", "resident", "clears_each_step", "last_waves")

    def __init__(self, capacity: int, policy: EvictionPolicy) -> None:
        if capacity < 1:
            raise ValueError(f"a pool needs at least 1 slot, got {capacity}")
        self.capacity = capacity
        self.policy = policy
        self.resident: set = set()
        self.clears_each_step = policy.clears_each_step
        self.last_waves: list = []

    def _make_room(self, n_new: int, protected) -> list:
        over = len(self.resident) + n_new - self.capacity
        if over <= 0:
            return []
        ev = self.policy.evict(over, protected)
        if len(ev) != over:  # cannot happen while groups are split into waves
            raise RuntimeError(f"policy {self.policy.name} found {len(ev)} of {over} evictable experts")
        self.resident.difference_update(ev)
        return ev

    def evict_for(self, n_new: int, keys) -> "list | tuple":
        """Room for ``n_new`` loads of a group that fits the pool: the policy's victims, never a
        key of the group; they leave ``resident``."""
        over = len(self.resident) + n_new - self.capacity
        if over <= 0:
            return _EMPTY
        # A short group is searched as a list: cheaper than building a set for it.
        evicted = self.policy.evict(over, keys if len(keys) <= 16 else set(keys))
        if len(evicted) != over:
            raise RuntimeError(f"policy {self.policy.name} found {len(evicted)} of {over} evictable experts")
        self.resident.difference_update(evicted)
        return evicted

    def access(self, keys: Sequence[int], t: int, aux=None, detail: bool = True):
        """Demand access of one group. Returns (n_hits, misses, evicted, waves); ``misses`` is
        the list of loaded keys, or None when ``detail`` is off and the policy's fast path ran."""
        res = self.resident
        policy = self.policy
        cap = self.capacity
        if len(keys) <= cap and policy.group_access is not None:
            misses = [k for k in keys if k not in res] if detail else None
            n_hits, evicted = policy.group_access(self, keys, t)
            return n_hits, misses, evicted, 1
        policy.on_demand(keys, t)
        hits = [k for k in keys if k in res]
        if len(hits) == len(keys):
            if hits:
                policy.on_hit(hits, t, aux)
            return len(hits), [], _EMPTY, 1
        misses = [k for k in keys if k not in res]
        if aux is not None:
            aux_h = [a for k, a in zip(keys, aux) if k in res]
            aux_m = [a for k, a in zip(keys, aux) if k not in res]
        else:
            aux_h = aux_m = None
        if hits:
            policy.on_hit(hits, t, aux_h)
        if len(keys) <= cap:
            evicted = self.evict_for(len(misses), keys)
            res.update(misses)
            policy.on_insert(misses, t, aux_m)
            return len(hits), misses, evicted, 1
        # Waves: the group does not fit in the pool.
        evicted = []
        first = cap - len(hits)
        chunks = [(misses[:first], hits + misses[:first])] if first > 0 else []
        for i in range(max(first, 0), len(misses), cap):
            chunks.append((misses[i:i + cap], misses[i:i + cap]))
        # The plan a live store follows: per wave, the experts computed, loaded and evicted.
        plan = [(list(hits), [], [])] if first <= 0 else []
        off = 0
        for new, protected in chunks:
            ev = self._make_room(len(new), set(protected))
            evicted.extend(ev)
            res.update(new)
            policy.on_insert(new, t, None if aux_m is None else aux_m[off:off + len(new)])
            off += len(new)
            plan.append((list(protected), list(new), list(ev)))
        self.last_waves = plan
        return len(hits), misses, evicted, len(plan)

    def prefetch(self, keys: Sequence[int], t: int, protected: set):
        """Load keys not resident, never evicting ``protected`` or each other. Returns (inserted, evicted)."""
        res = self.resident
        new = [k for k in keys if k not in res]
        if not new:
            return _EMPTY, _EMPTY
        evicted = _EMPTY
        free = self.capacity - len(res)
        if free < len(new):
            guard = protected.union(keys)
            evicted = self.policy.evict(len(new) - free, guard)
            res.difference_update(evicted)
            new = new[: free + len(evicted)]
        res.update(new)
        self.policy.on_insert(new, t, None)
        return new, evicted

    def remove(self, key: int) -> bool:
        if key in self.resident:
            self.resident.discard(key)
            self.policy.forget(key)
            return True
        return False

    def clear(self) -> list:
        gone = list(self.resident)
        for k in gone:
            self.policy.forget(k)
        self.resident.clear()
        return gone


class TieredPlacement:
    """Device (HBM) and host (pinned DRAM) pools over a disk tier that holds everything.

    ``host_slots=None`` means the host tier holds every expert (the usual single-node set-up:
    the whole model fits in DRAM) and the disk tier is never read.
    """

    def __init__(self, *, num_layers: int, num_experts: int, scope: str,
                 device_slots: int, host_slots: "int | None",
                 policy_factory: Callable[[], EvictionPolicy],
                 host_policy_factory: "Callable[[], EvictionPolicy] | None" = None,
                 hybrid=None, cpu_layers: int = 0) -> None:
        if scope not in SCOPES:
            raise ValueError(f"unknown scope {scope!r}; choose one of {', '.join(SCOPES)}")
        self.num_layers, self.num_experts, self.scope = num_layers, num_experts, scope
        self.device_slots, self.host_slots = device_slots, host_slots
        if host_slots is not None and host_slots < device_slots:
            raise ValueError(f"host capacity ({host_slots} slots) is below device capacity "
                             f"({device_slots} slots); tiers are inclusive, the host must hold at least the device's experts")

        def pools(slots, factory):
            def make():  # the policy learns the geometry (flat key = layer * E + expert) here
                return factory().bind(num_layers=num_layers, num_experts=num_experts, scope=scope)
            if scope == "layer":
                return [Pool(slots, make()) for _ in range(num_layers)]
            return [Pool(slots, make())] * num_layers  # one shared pool, indexed by layer

        self.device = pools(device_slots, policy_factory)
        full = host_slots is None or (host_slots >= (num_experts if scope == "layer" else num_layers * num_experts))
        self.host = None if full else pools(host_slots, host_policy_factory or policy_factory)
        self.pending: set = set()  # prefetched into the device, not yet used
        self.prefetch_issued = self.prefetch_used = self.prefetch_wasted = 0
        self.prefetch_from_disk = 0
        self.back_invalidations = 0
        self.device_evictions = self.host_evictions = 0
        if not 0 <= cpu_layers <= num_layers:
            raise ValueError(f"cpu_layers must be in [0, {num_layers}] (MoE layers), got {cpu_layers}")
        self.hybrid, self.cpu_layers = hybrid, cpu_layers
        self.host_computed = 0
        self.last_host: list = []   # keys of the last access computed on the host

    def unique_pools(self, tier: str = "device") -> list:
        pools = self.device if tier == "device" else (self.host or [])
        seen, out = set(), []
        for p in pools:
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
        return out

    def warm_start(self) -> int:
        """Fill pools whose policy asks for it (static). Returns experts loaded."""
        n = 0
        E = self.num_experts
        for tier in ("host", "device"):
            pools = self.device if tier == "device" else self.host
            if not pools:
                continue
            if self.scope == "layer":
                groups = [(pools[l], range(l * E, (l + 1) * E)) for l in range(self.num_layers)]
            else:
                groups = [(pools[0], range(self.num_layers * E))]
            for pool, keys in groups:
                init = pool.policy.initial_residents(keys, pool.capacity)
                if init:
                    pool.resident.update(init)
                    pool.policy.on_insert(init, 0, None)
                    n += len(init) if tier == "device" else 0
        return n

    def end_step(self) -> None:
        for p in self.unique_pools("device"):
            if p.clears_each_step:
                gone = p.clear()
                self.device_evictions += len(gone)
                self._note_evicted(gone)

    def _note_evicted(self, evicted) -> None:
        if self.pending:
            pend = self.pending
            for k in evicted:
                if k in pend:
                    pend.discard(k)
                    self.prefetch_wasted += 1

    def _split_host(self, layer: int, keys, t: int, aux, counts, queued: float):
        """Hybrid execution: remove from a group the experts computed on the host. Returns the
        keys (and aux) the device tier serves, and the host-computed keys."""
        if layer < self.cpu_layers:
            host_keys, dev_keys, dev_aux = list(keys), [], None if aux is None else []
        else:
            res = self.device[layer].resident
            hres = None if self.host is None else self.host[layer].resident
            cnt = counts if counts is not None else [1] * len(keys)
            hit_counts, miss_pos, forced = [], [], 0
            for i, k in enumerate(keys):
                if k in res:
                    hit_counts.append(cnt[i])
                elif hres is None or k in hres:
                    miss_pos.append(i)
                else:
                    forced += 1     # on disk only: it crosses the link whatever we decide
            if not miss_pos:
                self.last_host = []
                return keys, aux, []
            sel = self.hybrid.split(hit_counts, [cnt[i] for i in miss_pos], queued + forced * self.hybrid.t_link)
            if not sel:
                self.last_host = []
                return keys, aux, []
            hp = {miss_pos[j] for j in sel}
            host_keys = [keys[i] for i in sorted(hp)]
            dev_keys = [k for i, k in enumerate(keys) if i not in hp]
            dev_aux = None if aux is None else [a for i, a in enumerate(aux) if i not in hp]
        if host_keys:
            hs = set(host_keys)
            self.device[layer].policy.on_bypass(host_keys, t, None if aux is None else
                                                [a for k, a in zip(keys, aux) if k in hs])
        self.host_computed += len(host_keys)
        self.last_host = host_keys
        return dev_keys, dev_aux, host_keys

    def access(self, layer: int, keys: Sequence[int], t: int, aux=None, counts=None, queued: float = 0.0):
        """Demand access of one group. Returns its ``Access`` counts. ``counts``: tokens per key (hybrid decisions); ``queued``: link
        seconds already queued for this layer (its prefetches)."""
        n_host = 0
        dev_keys, dev_aux = keys, aux
        if self.hybrid is not None or layer < self.cpu_layers:
            dev_keys, dev_aux, host_keys = self._split_host(layer, keys, t, aux, counts, queued)
            n_host = len(host_keys)
        n_hits, _, evicted, waves = self.device[layer].access(dev_keys, t, dev_aux, False)
        used = self._take_pending(dev_keys) if self.pending else 0
        if evicted:
            self.device_evictions += len(evicted)
            self._note_evicted(evicted)
        if self.host is None:
            return Access(n_hits, len(keys) - n_hits, 0, waves, used, n_host)
        _, hmiss, hev, _ = self.host[layer].access(keys, t, aux, True)
        if hev:
            self.host_evictions += len(hev)
            self._back_invalidate(hev)
        return Access(n_hits, len(keys) - n_hits - len(hmiss), len(hmiss), waves, used, n_host)

    def access_detail(self, layer: int, keys: Sequence[int], t: int, aux=None, counts=None,
                      queued: float = 0.0) -> dict:
        """Like ``access`` but names the experts: for the live store, which must move them.
        Returns a ``Placement``: the misses (to bring to the device), from_disk (of those, not on
        the host), host (computed on the host from its slot, not moved), the keys evicted from each
        tier and, for a layer in waves, its wave plan."""
        host_keys = []
        dev_keys, dev_aux = keys, aux
        if self.hybrid is not None or layer < self.cpu_layers:
            dev_keys, dev_aux, host_keys = self._split_host(layer, keys, t, aux, counts, queued)
        dev = self.device[layer]
        n_hits, misses, evicted, waves = dev.access(dev_keys, t, dev_aux, True)
        evicted = list(evicted)
        used = self._take_pending(dev_keys) if self.pending else 0
        self.device_evictions += len(evicted)
        self._note_evicted(evicted)
        from_disk, host_evicted = [], []
        if self.host is not None:
            _, from_disk, host_evicted, _ = self.host[layer].access(keys, t, aux, True)
            if host_evicted:
                self.host_evictions += len(host_evicted)
                evicted += self._back_invalidate(host_evicted)
        plan = tuple(Wave(tuple(k), tuple(n), tuple(e)) for k, n, e in dev.last_waves) if waves > 1 else None
        moves = _NO_MOVES if not (misses or from_disk or evicted or host_evicted) else \
            Moves(loaded=tuple(misses), from_disk=tuple(from_disk), device_evicted=tuple(evicted),
                  host_evicted=tuple(host_evicted))
        return Placement(hits=n_hits, misses=tuple(misses), host=tuple(host_keys), waves=waves, prefetch_used=used,
                         moves=moves, wave_plan=plan)

    def _take_pending(self, keys) -> int:
        """Prefetched experts needed now count as used. One still pending is still resident:
        evictions drop it from pending."""
        got = self.pending.intersection(keys)
        if got:
            self.pending.difference_update(got)
            self.prefetch_used += len(got)
        return len(got)

    def _back_invalidate(self, host_evicted) -> list:
        E = self.num_experts
        dev = self.device
        gone = [k for k in host_evicted if dev[k // E].remove(k)]
        if gone:
            self.back_invalidations += len(gone)
            self.device_evictions += len(gone)
            self._note_evicted(gone)
        return gone

    def prefetch(self, layer: int, keys: Sequence[int], t: int, protected: set):
        """Bring predicted experts of ``layer`` to the device. Returns (from_host, from_disk)."""
        d = self.prefetch_detail(layer, keys, t, protected)
        return len(d.loaded) - len(d.from_disk), len(d.from_disk)

    def prefetch_detail(self, layer: int, keys: Sequence[int], t: int, protected: set) -> Moves:
        """Like ``prefetch`` but names the experts: loaded (to the device), from_disk (of those),
        and what each tier evicted for them. A layer computed on the host (``cpu_layers``): predictions only the
        disk holds are read into the host tier (``from_disk``, none ``loaded``); nothing goes to the device."""
        if layer < self.cpu_layers:
            if self.host is None:
                return Moves()
            hins, hev = self.host[layer].prefetch(keys, t, protected)
            dev_evicted = self._back_invalidate(hev) if hev else []
            self.host_evictions += len(hev)
            self.prefetch_from_disk += len(hins)
            return Moves(from_disk=tuple(hins), device_evicted=tuple(dev_evicted), host_evicted=tuple(hev))
        ins, ev = self.device[layer].prefetch(keys, t, protected)
        dev_evicted = list(ev)
        if ev:
            self.device_evictions += len(ev)
            self._note_evicted(ev)
        if not ins:
            return Moves(device_evicted=tuple(dev_evicted))
        self.pending.update(ins)
        if self.host is None:
            self.prefetch_issued += len(ins)
            return Moves(loaded=tuple(ins), device_evicted=tuple(dev_evicted))
        loaded, host_evicted = list(ins), []
        hp = self.host[layer]
        # Inclusive: what reaches the device must be on the host; those not there come from disk.
        from_disk = [k for k in ins if k not in hp.resident]
        if from_disk:
            hins, hev = hp.prefetch(from_disk, t, protected.union(ins))
            if hev:
                self.host_evictions += len(hev)
                host_evicted = list(hev)
                dev_evicted += self._back_invalidate(hev)
            # Anything the host could not take cannot stay on the device either.
            dropped = set(from_disk) - set(hins)
            for k in dropped:
                self.device[layer].remove(k)
                self.pending.discard(k)
            if dropped:
                loaded = [k for k in ins if k not in dropped]
                from_disk = [k for k in from_disk if k not in dropped]
        self.prefetch_from_disk += len(from_disk)
        self.prefetch_issued += len(loaded)
        return Moves(loaded=tuple(loaded), from_disk=tuple(from_disk), device_evicted=tuple(dev_evicted),
                     host_evicted=tuple(host_evicted))

    def cancel_prefetch(self, key: int) -> None:
        """A prefetched expert that will not load after all (its layer ran without it): no longer
        pending, no longer resident."""
        self.pending.discard(key)
        self.device[key // self.num_experts].remove(key)

    def invalidate(self, key: int) -> None:
        """An expert whose load failed: out of every tier, so the next access loads it again."""
        self.pending.discard(key)
        self.device[key // self.num_experts].remove(key)
        if self.host is not None:
            self.host[key // self.num_experts].remove(key)

    def device_capacity(self, layer: int) -> int:
        return self.device[layer].capacity

    def compute_capacity(self, layer: int) -> "int | None":
        """Experts of ``layer`` that can be resident at once where they compute: the host tier's pool for a layer
        computed on the host (``cpu_layers``; None where the host holds every expert), else the device pool."""
        if layer < self.cpu_layers:
            return None if self.host is None else self.host[layer].capacity
        return self.device[layer].capacity

    def device_full(self, layer: int) -> bool:
        pool = self.device[layer]
        return len(pool.resident) >= pool.capacity
