"""Moving experts between the tiers: the loads placement decides, carried out on worker threads (a side
CUDA stream on a GPU), and ``Fetch`` - one layer's experts as the model computes them, resident ones
first, misses as they arrive, in waves when they do not fit the device tier at once.

Experts are read-only: eviction only drops a slot, and a load is disk -> host slot (when the host tier
does not hold the expert) -> device slot.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from cache_policy.placement import Moves

from .host_tier import ChecksumError, HostTier, Slab


class ExpertLoadError(RuntimeError):
    """An expert could not be loaded (read twice, corrupt both times). The expert is dropped from
    every tier, so a later request reads it again instead of computing with bad bytes."""


class DemandFirst:
    """Demand loads before prefetches. Both share one disk and one link; a prefetch for layer m + 1 is issued as
    soon as layer m routes (the ``routed`` step hook), while layer m's own misses are still loading, so started
    at once it would split their bandwidth and delay the layer about to compute. A prefetch therefore starts its
    transfer only when no demand load is pending (as the cost model prices it: a prefetch has the link time the
    layer's demand loads leave idle). A prefetch a layer turns out to need is promoted: it waits no longer.
    ``patience``: the longest a prefetch waits (seconds), so a stream of demand loads cannot starve it."""

    def __init__(self, patience: float = 1.0) -> None:
        self._cv = threading.Condition()
        self._pending = 0
        self._urgent: set = set()      # prefetched keys a request now needs
        self._waiting: set = set()     # prefetches waiting for their turn
        self._dropped: set = set()     # ... and cancelled while they wait
        self.patience = patience

    def submitted(self) -> None:            # a demand load was queued
        with self._cv:
            self._pending += 1

    def done(self) -> None:                 # a demand load finished (or failed)
        with self._cv:
            self._pending -= 1
            if self._pending == 0:
                self._cv.notify_all()

    def promote(self, key: int) -> None:    # a request needs a prefetch still in flight (queued or waiting)
        with self._cv:
            self._urgent.add(key)
            self._cv.notify_all()

    def finished(self, key: int) -> None:   # a prefetch's job ended
        with self._cv:
            self._urgent.discard(key)

    def drop(self, key: int) -> bool:
        """Cancel a prefetch that has not started its transfer; False when it has (it completes)."""
        with self._cv:
            if key not in self._waiting:
                return False
            self._dropped.add(key)
            self._cv.notify_all()
            return True

    def wait_turn(self, key: int) -> bool:
        """A prefetch, before its transfer: wait for the demand loads pending; False when it was dropped."""
        with self._cv:
            self._waiting.add(key)
            self._cv.wait_for(lambda: self._pending == 0 or key in self._urgent or key in self._dropped,
                              timeout=self.patience)
            self._waiting.discard(key)
            self._urgent.discard(key)
            if key in self._dropped:
                self._dropped.discard(key)
                return False
            return True


class Mover:
    """The loads in flight (``inflight``: key -> Future of its device copy) and the thread pools that run
    them: demand loads on ``demand_pool``, prefetches on the smaller ``prefetch_pool``; a prefetch's transfer
    waits for the demand loads pending (``DemandFirst``)."""

    def __init__(self, dev: Slab, host: HostTier, stats, blob_bytes: int, *, device: str, threads: int,
                 cuda: bool) -> None:
        self.dev, self.host, self.stats, self.blob_bytes = dev, host, stats, blob_bytes
        self.inflight: dict = {}
        self.demand_pool = ThreadPoolExecutor(threads, thread_name_prefix="tiered-moe-demand")
        self.prefetch_pool = ThreadPoolExecutor(max(1, threads // 2), thread_name_prefix="tiered-moe-prefetch")
        self.order = DemandFirst()
        self.device = device
        self.copy_stream = torch.cuda.Stream(device=device) if cuda else None

    def read_host(self, key: int) -> None:
        """Runs on a worker thread: disk -> host slot (an expert computed there, or on its way to the device)."""
        try:
            self.host.read(key)
        except ChecksumError:   # a transient bad read (or a page cache hiccup): read it once more
            self.stats.reread += 1
            self.host.read(key)

    def move(self, key: int, from_disk: bool, after=None) -> None:
        """Runs on a worker thread: disk -> host slot (if needed) -> device slot. ``after``: a CUDA
        event recorded when the slot was handed over; compute queued before it may still read
        the slot's previous expert, so the copy waits for it."""
        host = self.host
        hslot = host.slab.slot_of[key]
        if from_disk:                       # (never under tensor parallelism: the host tier holds every expert)
            self.read_host(key)
        dst = self.dev.data[self.dev.slot_of[key]]
        if self.copy_stream is not None:
            if after is not None:
                self.copy_stream.wait_event(after)
            with torch.cuda.stream(self.copy_stream):
                dst.copy_(host.blob(hslot), non_blocking=True)
            self.copy_stream.synchronize()
        else:
            dst.copy_(host.blob(hslot))

    def carry_out(self, d: Moves, pool: ThreadPoolExecutor) -> dict:
        """Carry out a placement decision: free evicted slots, start the loads."""
        for k in d.device_evicted:
            self.settle(k)
            self.dev.release(k)
        for k in d.host_evicted:
            self.settle(k)
            self.host.slab.release(k)
        from_disk = set(d.from_disk)
        started = {}
        handover = None
        if self.copy_stream is not None and d.loaded:
            handover = torch.cuda.Event()
            handover.record(torch.cuda.current_stream(self.device))
        job = self._demand if pool is self.demand_pool else self._prefetch
        for k in d.loaded:
            if k in from_disk:
                self.host.slab.alloc(k)
            self.dev.alloc(k)
            fut = job(pool, k, self.move, k, k in from_disk, handover)
            self.inflight[k] = fut
            started[k] = fut
        # experts computed on the host that only the disk holds: read into their host slot, nothing moves on
        for k in from_disk.difference(d.loaded):
            self.host.slab.alloc(k)
            started[k] = self.inflight[k] = job(pool, k, self.read_host, k)
        self.stats.bytes["host_to_device"] += len(d.loaded) * self.blob_bytes
        self.stats.bytes["disk_to_host"] += len(from_disk) * self.blob_bytes
        return started

    def _demand(self, pool: ThreadPoolExecutor, key: int, fn, *args):
        self.order.submitted()

        def run():
            try:
                fn(*args)
            finally:
                self.order.done()
        try:
            return pool.submit(run)
        except BaseException:
            self.order.done()
            raise

    def _prefetch(self, pool: ThreadPoolExecutor, key: int, fn, *args):
        def run():
            try:
                if self.order.wait_turn(key):
                    fn(*args)
            finally:
                self.order.finished(key)
        return pool.submit(run)

    def settle(self, key: int) -> None:
        """Wait for a load into ``key``'s slot before the slot is reused (its expert is leaving, so
        a failed load does not matter here)."""
        fut = self.inflight.pop(key, None)
        if fut is not None:
            try:
                fut.result()
            except Exception:  # noqa: BLE001
                pass

    def failed(self) -> list:
        """Wait for every load in flight; the keys of those that failed."""
        bad = []
        for k, fut in list(self.inflight.items()):
            try:
                fut.result()
            except Exception:  # noqa: BLE001
                bad.append(k)
        return bad

    def close(self) -> None:
        for k in list(self.inflight):
            try:
                self.settle(k)
            except Exception:  # noqa: BLE001 - closing: the error was or will be raised to the caller
                pass
        self.demand_pool.shutdown(wait=True)
        self.prefetch_pool.shutdown(wait=True)


class Fetch:
    """One layer's experts: ``ready`` are resident now; ``tensors(e)`` waits for a miss.

    Iterate ``waves()`` to compute: one wave (resident experts first) when the layer's experts fit
    the device tier; otherwise the waves placement planned, each loaded after the previous one
    has been computed (its slots are reused)."""

    def __init__(self, store, layer: int, experts: list, pending: dict, plan=None,
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
        """The expert's tensors where it computes (its host slot, or its device slot), once its load is in."""
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
        return self.store.slot_views(self.layer * self.store.m.num_experts + expert, host=expert in self.host)

    def wait(self) -> None:
        for e in self.pending:
            self.tensors(e)
