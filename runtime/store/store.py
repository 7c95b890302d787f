"""The live expert store: real bytes in three tiers, moved as ``cache_policy`` decides.

- Device tier: one slab of fixed slots in CUDA memory (CPU memory standing in on a CPU-only
  machine; ``device_is_stand_in`` says so in every report).
- Host tier: one preallocated slab of fixed slots, pinned when CUDA is present.
- Disk tier: the store directory (``layout.py``), read by a thread pool straight into host
  slots (O_DIRECT where the file system allows it), checksum-verified.

``request(layer, experts, t)`` asks placement (the same ``TieredPlacement`` replay uses) what
hits, what loads and what leaves, then returns at once: experts already resident are ready,
misses stream in on worker threads (a side CUDA stream on a GPU) so the caller computes the
resident ones first. Experts are read-only: eviction only drops a slot.

Hybrid execution (``cpu_experts``): placement may decide that a missing expert is computed on the
host from its host-tier slot; ``Fetch.on_host(e)`` says so and ``Fetch.tensors(e)`` then returns
views of the host slot - nothing is copied. Without CUDA that is the zero-copy path: the stand-in
"device" slab is the same memory, so a copy into it only costs time.

The parts: the tiers' slot counts from their budgets (budget.py), the host tier and the disk reads under
it (host_tier.py), the loads on worker threads and a layer's waves (mover.py), a tensor-parallel rank's
slice of each expert (slices.py); this module ties them to placement.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from cache_policy import cost_model as cm
from cache_policy.keys import LINKS, SCOPES, TIERS, CpuExperts
from cache_policy.placement import Moves, TieredPlacement
from cache_policy.policies import LRU, POLICIES, check_policy_name

from .budget import TierSizes, tier_sizes
from .host_tier import ChecksumError, DiskTier, HostTier, Slab  # noqa: F401 - ChecksumError, DiskTier: importable here
from .layout import _DTYPES, Manifest
from .mover import ExpertLoadError, Fetch, Mover
from .slices import Shard, rank_manifest


@dataclass
class StoreStats:
    hits: dict = field(default_factory=lambda: dict.fromkeys(TIERS, 0))      # accesses served from each tier
    bytes: dict = field(default_factory=lambda: dict.fromkeys(LINKS, 0))     # bytes moved over each link
    prefetch_loaded: int = 0
    stall_seconds: float = 0.0
    requests: int = 0
    waves: int = 0   # extra waves: layers whose experts did not fit the device tier at once
    reread: int = 0  # blobs read a second time after a checksum error
    load_errors: int = 0
    computed: dict = field(default_factory=lambda: {"device": 0, "host": 0})   # experts computed where
    host_compute_seconds: float = 0.0   # wall time of expert compute on the host (hybrid execution)
    prefetch_cancelled: int = 0         # prefetches dropped unstarted once their layer had run
    layer_hits: list = field(default_factory=list)   # [layer] -> [device, host, disk] accesses served there

    def counters(self) -> dict:
        """The per-step counters now (a step record is the difference of two of these)."""
        return {"hits": dict(self.hits), "bytes": dict(self.bytes), "stall_seconds": self.stall_seconds}

    def since(self, before: dict) -> dict:
        """The counters' growth since ``before`` (from ``counters``)."""
        return {"hits": {k: self.hits[k] - before["hits"][k] for k in self.hits},
                "bytes": {k: self.bytes[k] - before["bytes"][k] for k in self.bytes},
                "stall_seconds": self.stall_seconds - before["stall_seconds"]}


class ExpertStore:
    def __init__(self, store_dir: str, *, device_budget: int, host_budget: "int | None" = None,
                 policy: str = "reuse", scope: str = "global", device: "str | None" = None,
                 min_experts_per_layer: int = 1, threads: int = 4, verify: bool = True,
                 max_inflight_prefetch: int = 64, direct_io: bool = True, progress: bool = False,
                 cpu_experts: "str | int | CpuExperts" = "0", profile: "str | None" = None,
                 shard=None, share=None, layers: "tuple | None" = None) -> None:
        """``cpu_experts``: 0, N (every expert of the first N MoE layers computed on the host) or
        auto (the cost model decides per expert per step; see cache_policy.cost_model.HybridCost).
        ``profile``: the hardware profile of those decisions and of prefetch's cost rule (default:
        cpu without CUDA, h200 with it).

        Tensor parallelism: ``shard`` (a ``Shard``: runtime/store/slices.py) makes this one rank's store:
        its device slots hold the rank's slice of each expert (``m`` describes the slice; ``full_m`` the
        stored expert), its host tier every expert's slices of every rank, rank-major, laid over the
        node's shared segment when ``share`` (a ``HostShare``: runtime/store/shared.py) says how to join
        it. Placement runs the same on every rank from the same routing (``deterministic``): no
        decision depends on timing, so the ranks' residency never diverges.

        Pipeline stages: ``layers`` = (a, b), the MoE layers [a, b) this stage holds (their global indices
        stay the store's: requests name them as every stage's model does); the host tier holds only them,
        and scope "layer" gives only them device slots."""
        self.dir = store_dir
        self.full_m = Manifest.read(store_dir)
        self.shard = shard or Shard()
        N = self.shard.world
        self.m = m = self.full_m if N == 1 else rank_manifest(self.full_m, self.shard)
        self.deterministic = N > 1 or layers is not None
        self.layers = (0, m.num_layers) if layers is None else (int(layers[0]), int(layers[1]))
        if not 0 <= self.layers[0] < self.layers[1] <= m.num_layers:
            raise ValueError(f"MoE layer range {layers} is outside the store's {m.num_layers} layers")
        check_policy_name(policy, live=True)
        if scope not in SCOPES:
            raise ValueError(f"unknown scope {scope!r}; choose one of {', '.join(SCOPES)}")
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.device_is_stand_in = self.device == "cpu"
        cuda = self.device.startswith("cuda")
        self.cpu_experts = CpuExperts.parse(cpu_experts, num_layers=m.num_layers)
        self.profile = cm.load_profile(profile or ("h200" if cuda else "cpu"))
        params = sum(int(np.prod(w.shape)) for w in m.weights)
        self.cost = cm.HybridCost(self.profile, params, m.blob_bytes)
        sizes = tier_sizes(m, device_budget=device_budget, host_budget=host_budget, scope=scope,
                           min_experts_per_layer=min_experts_per_layer, world=N,
                           full_stride=self.full_m.blob_stride, layers=self.layers)
        self.placement = self._placement(policy, scope, sizes)
        if layers is not None and not sizes.host_holds_all:
            raise ValueError("a pipeline stage's store needs a host tier that holds every expert of its layers: "
                             "drop --host-budget")
        self.dev = Slab(sizes.n_dev, m.blob_stride, self.device, pin=False)
        # The host tier: whole blobs; under tensor parallelism each slot holds every rank's slice, rank-major.
        self.host_tier = HostTier(store_dir, self.full_m, m, self.shard, sizes.n_host, cuda=cuda, share=share,
                                  direct_io=direct_io, verify=verify)
        self.host, self.disk, self.segment = self.host_tier.slab, self.host_tier.disk, self.host_tier.segment
        self.host_stride, self.share, self.verify = self.host_tier.stride, share, verify
        self._slot_views: dict = {}
        self.stats = StoreStats(layer_hits=[[0, 0, 0] for _ in range(m.num_layers)])
        self.mover = Mover(self.dev, self.host_tier, self.stats, m.blob_bytes, device=self.device, threads=threads,
                           cuda=cuda)
        self.inflight = self.mover.inflight             # key -> Future of its device copy
        self.demand_pool, self.prefetch_pool = self.mover.demand_pool, self.mover.prefetch_pool
        self.copy_stream = self.mover.copy_stream
        self._prefetching: dict = {}  # key -> Future of a prefetch copy not yet used or settled
        self._last_layer = None       # (experts, counts, host, moved) of the last request: see last_idle_link_s
        self.max_inflight_prefetch = max_inflight_prefetch
        self._host_holds_all = sizes.host_holds_all
        if self._host_holds_all:
            n = self.host_tier.load_all(self.layers, self.demand_pool, progress)
            self.stats.bytes["disk_to_host"] += n * self.full_m.blob_bytes
        self.closed = False

    def _placement(self, policy: str, scope: str, sizes: TierSizes) -> TieredPlacement:
        """Placement over the tiers' slots: ``policy`` in both (LRU in the host tier when the device runs
        none), the cost model deciding host compute under cpu_experts auto."""
        factory = POLICIES[policy]
        return TieredPlacement(num_layers=self.m.num_layers, num_experts=self.m.num_experts, scope=scope,
                               device_slots=sizes.device_slots, host_slots=sizes.host_slots, policy_factory=factory,
                               host_policy_factory=LRU if policy == "none" else factory,
                               hybrid=self.cost if self.cpu_experts.auto else None, cpu_layers=self.cpu_experts.layers)

    def slot_views(self, key: int, host: bool = False) -> dict:
        slab = self.host if host else self.dev
        slot = slab.slot_of[key]
        v = self._slot_views.get((host, slot))
        if v is None:   # views of a slot stay valid while its bytes change: build them once
            blob = self.host_tier.blob(slot) if host else slab.data[slot]
            v = self._slot_views[(host, slot)] = {ts.name: blob[ts.offset:ts.offset + ts.nbytes].view(_DTYPES[ts.dtype]).view(ts.shape)
                                          for ts in self.m.tensors}
        return v

    def carry_out(self, d: Moves, pool: ThreadPoolExecutor) -> dict:
        """Carry out a placement decision: free evicted slots, start the loads (runtime/store/mover.py)."""
        return self.mover.carry_out(d, pool)

    def _settle(self, key: int) -> None:
        self.mover.settle(key)

    def recover(self) -> list:
        """After a failed step: wait for every load in flight and drop the experts whose load
        failed, so none stays "resident" with bad bytes. Returns their keys."""
        bad = self.mover.failed()
        for k in bad:
            self.invalidate(k)
        return bad

    # -- API -----------------------------------------------------------------------------------
    def request(self, layer: int, experts, t: int, counts=None) -> Fetch:
        """Experts one layer needs now. Returns at once; misses stream in. ``counts``: tokens
        routed to each expert (aligned with ``experts``; hybrid decisions weigh them); default 1."""
        m = self.m
        if counts is not None:
            cmap = {}
            for e, c in zip(experts, counts):
                e = int(e)
                cmap[e] = cmap.get(e, 0) + int(c)
            experts = sorted(cmap)
            cnt = [cmap[e] for e in experts]
        else:
            experts, cnt = sorted({int(e) for e in experts}), None
        if experts and (experts[0] < 0 or experts[-1] >= m.num_experts):
            raise ValueError(f"layer {layer}: expert ids must be in [0, {m.num_experts}), got {experts}")
        if not self.layers[0] <= layer < self.layers[1]:
            raise ValueError(f"layer {layer} out of range: the store holds MoE layers {self.layers[0]}.."
                             f"{self.layers[1] - 1} of {m.num_layers}")
        pool_cap = self.placement.compute_capacity(layer)
        if pool_cap is not None and len(experts) > pool_cap and not self._host_holds_all:
            tier = "host" if self.compute_on_host(layer) else "device"
            raise ValueError(f"layer {layer} needs {len(experts)} experts at once, the {tier} tier holds {pool_cap}: "
                             f"waves need a host tier that holds every expert; raise the device or host budget")
        keys = [layer * m.num_experts + e for e in experts]
        d = self.placement.access_detail(layer, keys, t, counts=cnt)
        self._cancel_prefetches(layer, set(keys))
        host = self._count(layer, experts, cnt, keys, d)
        plan = d.wave_plan
        if plan is not None:
            first = plan[0]
            started = self.carry_out(Moves(loaded=first.loaded, device_evicted=first.evicted), self.demand_pool)
            return Fetch(self, layer, experts, {k - layer * m.num_experts: f for k, f in started.items()}, plan, host)
        mv = d.moves
        if not (mv.loaded or mv.from_disk or mv.device_evicted or mv.host_evicted) and \
                not (self.inflight and any(k in self.inflight for k in keys)):
            return Fetch(self, layer, experts, {}, host=host)        # every expert in place, none of them moving
        started = self.carry_out(mv, self.demand_pool)
        pending = {}
        for e, k in zip(experts, keys):
            fut = started.get(k) or self.inflight.get(k)
            if fut is not None and not fut.done():
                pending[e] = fut
                if k not in started:          # a prefetch this layer needs: it waits for no demand load now
                    self.mover.order.promote(k)
            elif fut is not None:
                self.inflight.pop(k, None)
                try:
                    fut.result()   # surfaces a checksum error of a finished prefetch
                except Exception as ex:  # noqa: BLE001
                    self.invalidate(k)
                    raise ExpertLoadError(f"layer {layer} expert {e}: {ex}") from None
        return Fetch(self, layer, experts, pending, host=host)

    def _count(self, layer: int, experts: list, cnt, keys: list, d) -> frozenset:
        """A request's statistics from its placement ``d``; returns the experts computed on the host."""
        E, stats = self.m.num_experts, self.stats
        host = frozenset(k - layer * E for k in d.host) if d.host else frozenset()
        n_host = len(host)
        stats.computed["host"] += n_host
        stats.computed["device"] += len(keys) - n_host
        self._last_layer = (experts, cnt, host, len(d.misses))
        stats.requests += 1
        n_disk = len(d.moves.from_disk)
        stats.waves += d.waves - 1
        stats.hits["device"] += d.hits
        stats.hits["disk"] += n_disk
        stats.hits["host"] += len(keys) - d.hits - n_disk   # moved or computed on the host
        lh = stats.layer_hits[layer]
        lh[0] += d.hits
        lh[1] += len(keys) - d.hits - n_disk
        lh[2] += n_disk
        return host

    def request_resident(self, layer: int, experts: list, counts: list, t: int, host: bool) -> None:
        """The fused decode step's request (layers/fused_step.py), after its kernel computed the layer: the
        experts (distinct, each with its tokens) were all resident - on the host tier if ``host``, else the
        device - by the residency table the step was given, and nothing can have moved since (the step runs
        only without prefetch, hybrid decisions or loads in flight). The same placement access and statistics
        as ``request`` - a replay of the routing places the same - without the general path's checks and
        Fetch. Raises if placement disagrees: the table was stale, a bug."""
        pairs = sorted(zip(experts, counts))       # request's order: the policy sees the same sequence
        E = self.m.num_experts
        experts = [e for e, _ in pairs]
        cnt = [c for _, c in pairs]
        keys = [layer * E + e for e in experts]
        d = self.placement.access_detail(layer, keys, t, counts=cnt)
        if self._prefetching:
            self._cancel_prefetches(layer, set(keys))
        on_host = self._count(layer, experts, cnt, keys, d)
        mv = d.moves
        busy = []
        for k in [k for k in keys if k in self.inflight] if self.inflight else ():
            fut = self.inflight[k]       # a copy that had finished when the step's table was made: settled now
            if fut.done() and fut.exception() is None:
                del self.inflight[k]
            else:
                busy.append(k)
        if mv.loaded or mv.from_disk or mv.device_evicted or mv.host_evicted or d.wave_plan is not None or busy \
                or (len(on_host) != len(keys) if host else on_host):
            raise RuntimeError(f"MoE layer {layer}: the store placed experts elsewhere than the fused step's residency "
                               f"table had them (moves {mv}, in flight {busy}, host {sorted(on_host)})")

    @property
    def last_idle_link_s(self) -> float:
        """Link time the last requested layer leaves idle: the window of the next layer's
        prefetch (the prefetch rule asks; computed only then)."""
        if self._last_layer is None:
            return 0.0
        experts, cnt, host, moved = self._last_layer
        cnt = cnt or [1] * len(experts)
        return self.cost.idle_link_seconds([c for e, c in zip(experts, cnt) if e not in host], moved,
                                           [c for e, c in zip(experts, cnt) if e in host])

    def _cancel_prefetches(self, layer: int, needed: set) -> None:
        """The layer is running: a prefetch for it that has not started (queued, or waiting for the demand
        loads: mover.DemandFirst) and is not needed now is dropped (it would only take link time from demand
        loads); one whose transfer started completes."""
        if not self._prefetching:
            return
        E = self.m.num_experts
        for k in [k for k in self._prefetching if k // E == layer]:
            fut = self._prefetching.pop(k)
            # Under tensor parallelism a prefetch is never cancelled: whether its copy has started is timing,
            # and placement must follow the same decisions on every rank.
            if k in needed or self.deterministic or not (fut.cancel() or self.mover.order.drop(k)):
                continue
            self.inflight.pop(k, None)
            self.placement.cancel_prefetch(k)
            if k in self.dev.slot_of:
                self.dev.release(k)
            self.stats.prefetch_cancelled += 1
            self.stats.bytes["host_to_device"] -= self.m.blob_bytes   # counted when it was issued

    def prefetch(self, layer: int, experts, t: int, protect: "list[int] | None" = None) -> int:
        """Bring predicted experts of ``layer`` ahead of need; bounded, never blocks demand loads.
        ``protect``: experts of the layer being computed (never evicted for a prefetch). A layer this store
        does not hold (another pipeline stage's) moves nothing."""
        if not self.holds(layer):
            return 0
        # Prefetches in flight: under tensor parallelism those issued and not yet settled by their layer's
        # request (a count every rank agrees on), else those whose copy has not finished.
        busy = len(self._prefetching) if self.deterministic else len([f for f in self.inflight.values() if not f.done()])
        if busy >= self.max_inflight_prefetch:
            return 0
        E = self.m.num_experts
        keys = [layer * E + int(e) for e in experts]
        # protect names experts of the layer computing now, layer - 1: as keys (its pools are keyed layer * E + e)
        d = self.placement.prefetch_detail(layer, keys, t, {(layer - 1) * E + int(e) for e in protect or ()})
        started = self.carry_out(d, self.prefetch_pool)
        disk = set(d.from_disk)    # a half-read host slot must not be dropped: only host->device copies are cancelled
        self._prefetching.update({k: f for k, f in started.items() if k not in disk})
        n = len(d.loaded) + len(disk.difference(d.loaded))    # to the device, or (host-computed) into the host tier
        self.stats.prefetch_loaded += n
        return n

    def holds(self, layer: int) -> bool:
        """Whether this store holds MoE layer ``layer`` (a pipeline stage holds a range)."""
        return self.layers[0] <= layer < self.layers[1]

    def invalidate(self, key: int) -> None:
        """Drop an expert whose load failed from every tier (placement and slots)."""
        fut = self.inflight.pop(key, None)
        if fut is not None:
            try:
                fut.result()
            except Exception:  # noqa: BLE001 - the failure is being reported by the caller
                pass
        self.stats.load_errors += 1
        self.placement.invalidate(key)
        if key in self.dev.slot_of:
            self.dev.release(key)
        if self.placement.host is not None and key in self.host.slot_of:
            self.host.release(key)

    def end_step(self) -> None:
        for p in self.placement.unique_pools("device"):
            if p.clears_each_step:
                for k in list(p.resident):
                    self._settle(k)
                    self.dev.release(k)
        self.placement.end_step()

    @property
    def host_holds_all(self) -> bool:
        """Whether the host tier holds every expert (else a layer's experts must fit the device tier)."""
        return self._host_holds_all

    def device_capacity(self, layer: int = 0) -> int:
        """Experts the device tier can hold for ``layer`` (its pool's capacity)."""
        return self.placement.device_capacity(layer)

    def compute_on_host(self, layer: int) -> bool:
        """Whether every expert of ``layer`` computes from its host-tier slot (cpu_experts N covers it)."""
        return layer < self.cpu_experts.layers

    def compute_capacity(self, layer: int = 0) -> "int | None":
        """Experts of ``layer`` that can be held at once where they compute (the host tier's pool for a layer
        computed on the host, else the device's; None: no limit, the host holds every expert)."""
        return None if self._host_holds_all else self.placement.compute_capacity(layer)

    def displaced_reuse(self, layer: int) -> float:
        """The chance a resident that a prefetch into ``layer`` displaces is needed again: the device
        hit rate so far when the layer's pool is full, else 0 (nothing is displaced)."""
        st = self.stats
        acc = sum(st.hits.values())
        return st.hits["device"] / acc if acc and self.placement.device_full(layer) else 0.0

    def record_host_compute(self, seconds: float) -> None:
        """Wall time the model spent computing experts on the host (hybrid execution)."""
        self.stats.host_compute_seconds += seconds

    def resident(self, layer: int, tier: str = "device") -> list:
        """Experts of ``layer`` holding a slot of ``tier`` (device or host) now (loaded or loading)."""
        E = self.m.num_experts
        lo = layer * E
        if tier == "host" and self._host_holds_all:
            return list(range(E))
        slots = self.dev.slot_of if tier == "device" else self.host.slot_of
        return [k - lo for k in slots if lo <= k < lo + E]

    def resident_bytes(self) -> dict:
        return {"device": (self.dev.data.shape[0] - len(self.dev.free)) * self.m.blob_stride,
                "host": (self.host.data.shape[0] - len(self.host.free)) * self.host_stride}

    def capacity_bytes(self) -> dict:
        return {"device": self.dev.nbytes, "host": self.host.nbytes}

    def snapshot(self) -> dict:
        """Cumulative counters and current gauges, plain numbers (what the metrics endpoint mirrors)."""
        st, pl, stride = self.stats, self.placement, self.m.blob_stride
        res, cap = self.resident_bytes(), self.capacity_bytes()
        return {"hits": dict(st.hits), "layer_hits": [list(x) for x in st.layer_hits], "bytes": dict(st.bytes),
                "evictions": {"device": pl.device_evictions, "host": pl.host_evictions},
                "prefetch": {"issued": pl.prefetch_issued, "used": pl.prefetch_used, "wasted": pl.prefetch_wasted,
                             "wasted_bytes": pl.prefetch_wasted * self.m.blob_bytes, "cancelled": st.prefetch_cancelled},
                "computed": dict(st.computed), "host_compute_seconds": st.host_compute_seconds,
                "resident_bytes": res, "capacity_bytes": cap,
                "resident_experts": {"device": res["device"] // stride, "host": res["host"] // self.host_stride},
                "capacity_experts": {"device": cap["device"] // stride, "host": cap["host"] // self.host_stride},
                "stall_seconds": st.stall_seconds, "waves": st.waves, "reread": st.reread, "load_errors": st.load_errors}

    def close(self) -> None:
        if self.closed:
            return
        self.mover.close()
        self.host_tier.close()
        self.closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
