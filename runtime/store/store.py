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
"""
from __future__ import annotations

import os
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from cache_policy import cost_model as cm
from cache_policy.keys import LINKS, SCOPES, TIERS, CpuExperts
from cache_policy.placement import Moves, TieredPlacement
from cache_policy.policies import LRU, POLICIES, check_policy_name

from .layout import ALIGN, Manifest, _DTYPES


class ChecksumError(RuntimeError):
    pass


class ExpertLoadError(RuntimeError):
    """An expert could not be loaded (read twice, corrupt both times). The expert is dropped from
    every tier, so a later request reads it again instead of computing with bad bytes."""


class Slab:
    """``n`` fixed slots of ``stride`` bytes in one allocation; slot addresses 4 KiB aligned on
    the host so O_DIRECT reads can land in them."""

    def __init__(self, n: int, stride: int, device: str, pin: bool, buffer: "torch.Tensor | None" = None) -> None:
        """``buffer``: bytes to lay the slots over (a shared host tier, runtime/store/shared.py), else a new
        allocation."""
        pad = ALIGN if device == "cpu" else 0
        raw = buffer if buffer is not None else torch.empty(n * stride + pad, dtype=torch.uint8, device=device,
                                                            pin_memory=pin)
        off = (-raw.data_ptr()) % ALIGN if pad else 0
        self.data = raw[off:off + n * stride].view(n, stride)   # data: [slots, stride] bytes
        self.free = list(range(n - 1, -1, -1))
        self.slot_of: dict = {}
        self.nbytes = n * stride

    def alloc(self, key: int) -> int:
        if not self.free:
            raise RuntimeError("slab is full: placement and slots disagree")
        s = self.free.pop()
        self.slot_of[key] = s
        return s

    def release(self, key: int) -> None:
        self.free.append(self.slot_of.pop(key))


class DiskTier:
    def __init__(self, store_dir: str, m: Manifest, direct: bool = True) -> None:
        self.dir, self.m = store_dir, m
        self.fds, self.mode = [], "O_DIRECT"
        for layer in range(m.num_layers):
            path = os.path.join(store_dir, m.layer_file(layer))
            fd = None
            if direct and hasattr(os, "O_DIRECT"):
                try:
                    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
                except OSError:
                    fd = None
            if fd is None:
                fd = os.open(path, os.O_RDONLY)
                self.mode = "buffered"
            self.fds.append(fd)
        self._fallback = {}

    def read_into(self, layer: int, expert: int, dst: np.ndarray, verify: bool = True) -> None:
        """dst: [stride] uint8 view of a host slot."""
        m = self.m
        off = expert * m.blob_stride
        try:
            n = os.preadv(self.fds[layer], [dst], off)
        except OSError:  # O_DIRECT refused at read time (some file systems): fall back for this file
            fd = self._fallback.get(layer)
            if fd is None:
                fd = self._fallback[layer] = os.open(os.path.join(self.dir, m.layer_file(layer)), os.O_RDONLY)
                self.mode = "buffered"
            n = os.preadv(fd, [dst], off)
        if n < m.blob_bytes:
            raise ChecksumError(f"{m.layer_file(layer)}: short read of layer {layer} expert {expert} "
                                f"({n} of {m.blob_bytes} bytes): file truncated")
        if verify:
            crc = zlib.crc32(memoryview(dst)[: m.blob_bytes])
            if crc != m.checksums[layer][expert]:
                raise ChecksumError(f"{m.layer_file(layer)}: checksum mismatch for layer {layer} expert {expert} "
                                    f"(crc32 {crc:#010x}, manifest {m.checksums[layer][expert]:#010x}): the store is corrupt")

    def close(self) -> None:
        for fd in list(self.fds) + list(self._fallback.values()):
            os.close(fd)
        self.fds, self._fallback = [], {}


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


class Fetch:
    """One layer's experts: ``ready`` are resident now; ``tensors(e)`` waits for a miss.

    Iterate ``waves()`` to compute: one wave (resident experts first) when the layer's experts fit
    the device tier; otherwise the waves placement planned, each loaded after the previous one
    has been computed (its slots are reused)."""

    def __init__(self, store: "ExpertStore", layer: int, experts: list, pending: dict, plan=None,
                 host: "frozenset | set" = frozenset()) -> None:
        self.store, self.layer, self.experts, self.pending = store, layer, experts, pending
        self.ready = [e for e in experts if e not in pending]
        self.plan = plan
        self.host = host      # experts computed on the host from their host slot (hybrid execution)

    def on_host(self, expert: int) -> bool:
        return expert in self.host

    def waves(self):
        if self.plan is None:
            yield self.ready + [e for e in self.experts if e in self.pending]
            return
        base = self.layer * self.store.m.num_experts
        host = [e for e in self.experts if e in self.host]
        for j, w in enumerate(self.plan):
            if j > 0:
                self.pending.update({k - base: f for k, f in self.store.carry_out(
                    Moves(loaded=w.loaded, device_evicted=w.evicted), self.store.demand_pool).items()})
            wave = [k - base for k in w.keys] + (host if j == 0 else [])
            yield [e for e in wave if e not in self.pending] + [e for e in wave if e in self.pending]

    def tensors(self, expert: int) -> dict:
        if expert in self.host:
            return self.store.slot_views(self.layer * self.store.m.num_experts + expert, host=True)
        fut = self.pending.get(expert)
        if fut is not None:
            t0 = time.perf_counter()
            try:
                fut.result()
            except Exception as e:  # noqa: BLE001 - any failed load: the expert must not stay "resident"
                self.store.invalidate(self.layer * self.store.m.num_experts + expert)
                raise ExpertLoadError(f"layer {self.layer} expert {expert}: {e}") from None
            finally:
                self.store.stats.stall_seconds += time.perf_counter() - t0
        return self.store.slot_views(self.layer * self.store.m.num_experts + expert)

    def wait(self) -> None:
        for e in self.pending:
            self.tensors(e)


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

        Tensor parallelism: ``shard`` (runtime/parallel/shard.py ``Shard``) makes this one rank's store:
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
        from ..parallel.shard import Shard, rank_manifest
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
        L, E, stride = m.num_layers, m.num_experts, m.blob_stride
        Ls = self.layers[1] - self.layers[0]          # the layers this store holds (all but under pipeline stages)
        self.cpu_experts = CpuExperts.parse(cpu_experts, num_layers=L)
        self.profile = cm.load_profile(profile or ("h200" if cuda else "cpu"))
        params = sum(int(np.prod(w.shape)) for w in m.weights)
        self.cost = cm.HybridCost(self.profile, params, m.blob_bytes)
        dev_total = int(device_budget) // stride
        dev_slots = dev_total // L if scope == "layer" else dev_total
        need = min_experts_per_layer
        if dev_slots < need:
            need_bytes = need * stride * (L if scope == "layer" else 1)
            raise ValueError(f"device budget {int(device_budget):,} bytes holds {dev_slots} expert(s)"
                             f"{' per layer' if scope == 'layer' else ''}; one layer's top-k needs {need}: "
                             f"the minimum is {need_bytes:,} bytes ({stride:,} bytes per expert)")
        host_slots = None
        if host_budget is not None:
            host_total = int(host_budget) // stride
            host_slots = host_total // L if scope == "layer" else host_total
            if host_slots < dev_slots:
                raise ValueError(f"host budget {int(host_budget):,} bytes holds {host_slots} experts, fewer than the "
                                 f"device tier's {dev_slots}: tiers are inclusive, the host needs at least "
                                 f"{dev_slots * stride * (L if scope == 'layer' else 1):,} bytes")
            if host_slots >= (E if scope == "layer" else L * E):
                host_slots = None
        if N > 1 and host_slots is not None:
            raise ValueError(f"tensor parallelism needs a host tier that holds every expert ({L * E * self.full_m.blob_stride:,} "
                             f"bytes shared by the node's ranks); a host budget of {int(host_budget):,} bytes holds "
                             f"{host_slots} - drop --host-budget (a disk tier under tensor-parallel ranks is not built yet)")
        factory = POLICIES[policy]
        self.placement = TieredPlacement(num_layers=L, num_experts=E, scope=scope, device_slots=dev_slots,
                                         host_slots=host_slots, policy_factory=factory,
                                         host_policy_factory=LRU if policy == "none" else factory,
                                         hybrid=self.cost if self.cpu_experts.auto else None,
                                         cpu_layers=self.cpu_experts.layers)
        if layers is not None and host_slots is not None:
            raise ValueError("a pipeline stage's store needs a host tier that holds every expert of its layers: "
                             "drop --host-budget")
        n_dev = dev_slots * (Ls if scope == "layer" else 1)
        n_host = Ls * E if host_slots is None else host_slots * (L if scope == "layer" else 1)
        self.dev = Slab(n_dev, stride, self.device, pin=False)
        # The host tier: whole blobs; under tensor parallelism each slot holds every rank's slice, rank-major.
        self.host_stride = stride * N
        self.segment = None
        if share is not None:
            from .shared import SharedSegment
            nbytes = n_host * self.host_stride
            if share.create:
                self.segment = SharedSegment(share.path, nbytes, create=True)
            share.barrier()
            if not share.create:
                self.segment = SharedSegment(share.path, nbytes, create=False)
            share.barrier()                 # every rank has mapped it: the name can go
            if share.create:
                self.segment.unlink()
            if cuda:
                self.segment.pin()
        self.share = share
        self.host = Slab(n_host, self.host_stride, "cpu", pin=cuda and share is None,
                         buffer=self.segment.tensor if self.segment is not None else None)
        self.disk = DiskTier(store_dir, self.full_m, direct=direct_io)
        self._slot_views: dict = {}
        self.verify = verify
        self.stats = StoreStats(layer_hits=[[0, 0, 0] for _ in range(L)])
        self.inflight: dict = {}      # key -> Future of its device copy
        self._prefetching: dict = {}  # key -> Future of a prefetch copy not yet used or settled
        self._last_layer = None       # (experts, counts, host, moved) of the last request: see last_idle_link_s
        self._lock = threading.Lock()
        self.demand_pool = ThreadPoolExecutor(threads, thread_name_prefix="tiered-moe-demand")
        self.prefetch_pool = ThreadPoolExecutor(max(1, threads // 2), thread_name_prefix="tiered-moe-prefetch")
        self.max_inflight_prefetch = max_inflight_prefetch
        self.copy_stream = torch.cuda.Stream(device=self.device) if cuda else None
        self._host_holds_all = host_slots is None
        if self._host_holds_all:
            self._load_all_to_host(progress)
        self.closed = False

    # -- bytes ---------------------------------------------------------------------------------
    def _load_all_to_host(self, progress: bool) -> None:
        m = self.full_m
        keys = [l * m.num_experts + e for l in range(*self.layers) for e in range(m.num_experts)]
        for k in keys:                      # slots in key order: the same on every rank of a group
            self.host.alloc(k)
        share = self.share
        mine = keys if share is None else keys[share.rank::share.ranks]   # the disk read once per node
        bar = None
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=len(mine), desc="loading experts into host memory", unit="expert")
        load = self._read_whole if self.shard.world == 1 else self._read_sliced
        futs = [self.demand_pool.submit(load, k) for k in mine]
        for f in futs:
            f.result()
            if bar:
                bar.update()
        if bar:
            bar.close()
        self.stats.bytes["disk_to_host"] += len(mine) * m.blob_bytes
        if share is not None:
            share.barrier()                 # every rank's part is in: the tier is whole

    def _read_whole(self, key: int) -> None:
        E = self.m.num_experts
        self.disk.read_into(key // E, key % E, self.host.data[self.host.slot_of[key]].numpy(), self.verify)

    def _read_sliced(self, key: int) -> None:
        """Tensor parallelism: one whole blob from disk, cut into every rank's slice, each written to its
        place in the expert's host slot (rank j's at j x the rank stride)."""
        from ..parallel.shard import Shard, slice_expert
        full, E, S = self.full_m, self.m.num_experts, self.m.blob_stride
        raw = torch.empty(full.blob_stride + ALIGN, dtype=torch.uint8)
        off = (-raw.data_ptr()) % ALIGN
        buf = raw[off:off + full.blob_stride]                            # O_DIRECT wants an aligned buffer
        self.disk.read_into(key // E, key % E, buf.numpy(), self.verify)
        views = {ts.name: buf[ts.offset:ts.offset + ts.nbytes].view(_DTYPES[ts.dtype]).view(ts.shape)
                 for ts in full.tensors}
        slot = self.host.data[self.host.slot_of[key]]
        inter = next(w.shape[1] for w in full.weights if w.name == "down")
        for j in range(self.shard.world):
            part = slice_expert(full.weights, views, inter, Shard(j, self.shard.world))
            base = j * S
            for ts in self.m.tensors:
                dst = slot[base + ts.offset:base + ts.offset + ts.nbytes].view(_DTYPES[ts.dtype]).view(ts.shape)
                dst.copy_(part[ts.name])

    def _host_blob(self, slot: int) -> torch.Tensor:
        """This rank's bytes of a host slot (the whole slot without tensor parallelism)."""
        S = self.m.blob_stride
        return self.host.data[slot][self.shard.rank * S:(self.shard.rank + 1) * S]

    def slot_views(self, key: int, host: bool = False) -> dict:
        slab = self.host if host else self.dev
        slot = slab.slot_of[key]
        v = self._slot_views.get((host, slot))
        if v is None:   # views of a slot stay valid while its bytes change: build them once
            blob = self._host_blob(slot) if host else slab.data[slot]
            v = self._slot_views[(host, slot)] = {ts.name: blob[ts.offset:ts.offset + ts.nbytes].view(_DTYPES[ts.dtype]).view(ts.shape)
                                          for ts in self.m.tensors}
        return v

    def _move(self, key: int, from_disk: bool, after=None) -> None:
        """Runs on a worker thread: disk -> host slot (if needed) -> device slot. ``after``: a CUDA
        event recorded when the slot was handed over; compute queued before it may still read
        the slot's previous expert, so the copy waits for it."""
        E = self.m.num_experts
        hslot = self.host.slot_of[key]
        if from_disk:                       # (never under tensor parallelism: the host tier holds every expert)
            dst_host = self.host.data[hslot].numpy()
            try:
                self.disk.read_into(key // E, key % E, dst_host, self.verify)
            except ChecksumError:   # a transient bad read (or a page cache hiccup): read it once more
                self.stats.reread += 1
                self.disk.read_into(key // E, key % E, dst_host, self.verify)
        dst = self.dev.data[self.dev.slot_of[key]]
        if self.copy_stream is not None:
            if after is not None:
                self.copy_stream.wait_event(after)
            with torch.cuda.stream(self.copy_stream):
                dst.copy_(self._host_blob(hslot), non_blocking=True)
            self.copy_stream.synchronize()
        else:
            dst.copy_(self._host_blob(hslot))

    def carry_out(self, d: Moves, pool: ThreadPoolExecutor) -> dict:
        """Carry out a placement decision: free evicted slots, start the loads."""
        for k in d.device_evicted:
            self._settle(k)
            self.dev.release(k)
        for k in d.host_evicted:
            self._settle(k)
            self.host.release(k)
        from_disk = set(d.from_disk)
        started = {}
        handover = None
        if self.copy_stream is not None and d.loaded:
            handover = torch.cuda.Event()
            handover.record(torch.cuda.current_stream(self.device))
        for k in d.loaded:
            if k in from_disk:
                self.host.alloc(k)
            self.dev.alloc(k)
            fut = pool.submit(self._move, k, k in from_disk, handover)
            self.inflight[k] = fut
            started[k] = fut
        nbytes = self.m.blob_bytes
        self.stats.bytes["host_to_device"] += len(d.loaded) * nbytes
        self.stats.bytes["disk_to_host"] += len(from_disk) * nbytes
        return started

    def _settle(self, key: int) -> None:
        """Wait for a load into ``key``'s slot before the slot is reused (its expert is leaving, so
        a failed load does not matter here)."""
        fut = self.inflight.pop(key, None)
        if fut is not None:
            try:
                fut.result()
            except Exception:  # noqa: BLE001
                pass

    def recover(self) -> list:
        """After a failed step: wait for every load in flight and drop the experts whose load
        failed, so none stays "resident" with bad bytes. Returns their keys."""
        bad = []
        for k, fut in list(self.inflight.items()):
            try:
                fut.result()
            except Exception:  # noqa: BLE001
                bad.append(k)
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
                cmap[int(e)] = cmap.get(int(e), 0) + int(c)
        experts = sorted({int(e) for e in experts})
        if experts and (experts[0] < 0 or experts[-1] >= m.num_experts):
            raise ValueError(f"layer {layer}: expert ids must be in [0, {m.num_experts}), got {experts}")
        if not self.layers[0] <= layer < self.layers[1]:
            raise ValueError(f"layer {layer} out of range: the store holds MoE layers {self.layers[0]}.."
                             f"{self.layers[1] - 1} of {m.num_layers}")
        pool_cap = self.placement.device_capacity(layer)
        if len(experts) > pool_cap and not self._host_holds_all:
            raise ValueError(f"layer {layer} needs {len(experts)} experts at once, the device tier holds {pool_cap}: "
                             f"waves need a host tier that holds every expert; raise the device or host budget")
        keys = [layer * m.num_experts + e for e in experts]
        cnt = [cmap[e] for e in experts] if counts is not None else None
        d = self.placement.access_detail(layer, keys, t, counts=cnt)
        self._cancel_prefetches(layer, set(keys))
        host = frozenset(k - layer * m.num_experts for k in d.host)
        self.stats.computed["host"] += len(host)
        self.stats.computed["device"] += len(keys) - len(host)
        self._last_layer = (experts, cnt, host, len(d.misses))
        self.stats.requests += 1
        n_disk = len(d.moves.from_disk)
        self.stats.waves += d.waves - 1
        self.stats.hits["device"] += d.hits
        self.stats.hits["disk"] += n_disk
        self.stats.hits["host"] += len(keys) - d.hits - n_disk   # moved or computed on the host
        lh = self.stats.layer_hits[layer]
        lh[0] += d.hits
        lh[1] += len(keys) - d.hits - n_disk
        lh[2] += n_disk
        plan = d.wave_plan
        if plan is not None:
            first = plan[0]
            started = self.carry_out(Moves(loaded=first.loaded, device_evicted=first.evicted), self.demand_pool)
            return Fetch(self, layer, experts, {k - layer * m.num_experts: f for k, f in started.items()}, plan, host)
        started = self.carry_out(d.moves, self.demand_pool)
        pending = {}
        for e, k in zip(experts, keys):
            fut = started.get(k) or self.inflight.get(k)
            if fut is not None and not fut.done():
                pending[e] = fut
            elif fut is not None:
                self.inflight.pop(k, None)
                try:
                    fut.result()   # surfaces a checksum error of a finished prefetch
                except Exception as ex:  # noqa: BLE001
                    self.invalidate(k)
                    raise ExpertLoadError(f"layer {layer} expert {e}: {ex}") from None
        return Fetch(self, layer, experts, pending, host=host)

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
        """The layer is running: a prefetch for it that has not started and is not needed now is
        dropped (it would only take link time from demand loads); one that started completes."""
        if not self._prefetching:
            return
        E = self.m.num_experts
        for k in [k for k in self._prefetching if k // E == layer]:
            fut = self._prefetching.pop(k)
            # Under tensor parallelism a prefetch is never cancelled: whether its copy has started is timing,
            # and placement must follow the same decisions on every rank.
            if k in needed or self.deterministic or not fut.cancel():
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
        d = self.placement.prefetch_detail(layer, keys, t, set(protect or ()))
        started = self.carry_out(d, self.prefetch_pool)
        disk = set(d.from_disk)    # a half-read host slot must not be dropped: only host->device copies are cancelled
        self._prefetching.update({k: f for k, f in started.items() if k not in disk})
        self.stats.prefetch_loaded += len(d.loaded)
        return len(d.loaded)

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

    def displaced_reuse(self, layer: int) -> float:
        """The chance a resident that a prefetch into ``layer`` displaces is needed again: the device
        hit rate so far when the layer's pool is full, else 0 (nothing is displaced)."""
        st = self.stats
        acc = sum(st.hits.values())
        return st.hits["device"] / acc if acc and self.placement.device_full(layer) else 0.0

    def record_host_compute(self, seconds: float) -> None:
        """Wall time the model spent computing experts on the host (hybrid execution)."""
        self.stats.host_compute_seconds += seconds

    def resident(self, layer: int) -> list:
        """Experts of ``layer`` holding a device slot now (loaded or loading)."""
        E = self.m.num_experts
        lo = layer * E
        return [k - lo for k in self.dev.slot_of if lo <= k < lo + E]

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
        for k in list(self.inflight):
            try:
                self._settle(k)
            except Exception:  # noqa: BLE001 - closing: the error was or will be raised to the caller
                pass
        self.demand_pool.shutdown(wait=True)
        self.prefetch_pool.shutdown(wait=True)
        self.disk.close()
        self.closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
