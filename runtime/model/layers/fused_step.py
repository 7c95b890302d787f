"""A decode step's consecutive fused layers in one host-kernel call (``tm_decode_layers``, runtime/kernels/moe_cpu.c).

Per fused layer, a decode step in ``FusedDecode`` (layers/fused.py) is four to six kernel calls with Python between
them: the token mixer's block, the store's request for the routed experts, their blob views turned into addresses, the
expert call, the shared experts. On a mid-size checkpoint at batch 1 that Python was a third of a token's time (the
kernels two thirds; llama.cpp runs its whole graph in C). Here the layers run in one call, each MoE layer's experts read
from a residency table (per expert, the addresses of its parts in the slot it holds, 0 where it holds none), and the
store's bookkeeping for each layer - the recorded routing, ``MoEBlock.request``: placement, hit counts - follows the
call, in layer order, from the routing the kernel copied out.

That order is the composed one's in effect only when a request cannot change what the layers before it computed from:
the step takes this path when nothing can move while it runs - no prefetch hook (``hooks.routed``), no cache-aware
routing, no hybrid host compute, no load in flight for an expert in the table - and every expert a layer routes to
is in its table. A layer that routes to one that is not (or gives an expert more rows than the one-call path takes)
stops the call after its block: its experts go through ``FusedDecode``'s general path (the request, misses streaming
in, waves), the tables are brought up to date with whatever moved, and the call resumes at the next layer. Outputs,
hits and the recorded trace equal the per-layer path's and the composed layers' (tests/runtime/model/
test_fused_decode.py)."""
from __future__ import annotations

import ctypes

import numpy as np
import torch

from ... import kernels
from .fused import FusedDecode

_P, _I32, _I64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64
P_N = 8                                  # moe_cpu.h: the parts of an expert (P_GATE_W .. P_DOWN_BIAS)


class FusedLayerArgs(ctypes.Structure):
    """moe_cpu.h's tm_fused_layer_t."""
    _fields_ = [("kind", _I32), ("max_rows", _I32), ("L", _P), ("ext", _P), ("mlp", _P), ("moe", _P), ("table", _P),
                ("ptrs", _P), ("write", _P), ("read", _P), ("pos", _P), ("n", _I64), ("ids", _P), ("used", _P),
                ("counts", _P), ("n_used", _P), ("moe_ns", _P)]


class _Routed:
    """One MoE layer's side of the call: its tm_moe template (scratch for the step's rows), residency table and the
    routing the kernel copies out."""

    def __init__(self, f: FusedDecode, entry: FusedLayerArgs) -> None:
        self.f, self.block, self.kernel = f, f.block, f.kernel
        E = f.args.E
        self.m, self.E = f.block.moe_idx, E
        # a layer whose experts compute from their host slots (--cpu-experts N, and one memory on a CPU, where the
        # host tier is the only one): its table reads those
        self.host = self.m < f.block.store.placement.cpu_layers
        self.ns = np.zeros(1, np.int64)                              # its experts' time in the call
        entry.moe_ns = self.ns.ctypes.data
        self.moe = kernels.MoEArgs.from_buffer_copy(self.kernel.args)
        self.table = np.zeros((E, P_N), np.int64)                    # [E, P_N] part addresses where resident
        self.ptrs = np.zeros((E, P_N), np.int64)
        self.used, self.counts, self.n_used = np.zeros(E, np.int64), np.zeros(E, np.int64), np.zeros(1, np.int64)
        self.ids = np.zeros(0, np.int64)
        entry.max_rows = self.kernel.max_rows
        entry.moe, entry.table, entry.ptrs = ctypes.addressof(self.moe), self.table.ctypes.data, self.ptrs.ctypes.data
        entry.used, entry.counts, entry.n_used = self.used.ctypes.data, self.counts.ctypes.data, self.n_used.ctypes.data
        self.entry = entry

    def size(self, rows: int, bufs) -> None:
        """Scratch for ``rows`` gathered rows (the step buffers' B x k): the expert call's and the routing copy's."""
        a, k = self.moe, self.kernel
        self.h = torch.empty(rows * 2 * a.I)
        self.xq = torch.empty(rows * k._ldq, dtype=torch.int8)
        self.xd = torch.empty(rows * k._ldd)
        a.h, a.xq, a.xd = self.h.data_ptr(), self.xq.data_ptr(), self.xd.data_ptr()
        a.x, a.y = bufs.xs.data_ptr(), bufs.ys.data_ptr()
        a.scratch_rows = rows
        self.ids = np.zeros(rows, np.int64)
        self.entry.ids = self.ids.ctypes.data

    def set(self, e: int, views: "dict | None") -> None:
        self.table[e] = 0 if views is None else self.kernel._row(views)

    def book(self, ctx, B: int, k: int) -> None:
        """After the call computed this layer: the routing recorded and the store's request for what it routed
        (``ExpertStore.request_resident``: every expert was resident, so it finds them all in place). The step
        runs with no ``routed`` hook (``usable``), so the block's request has nothing else to tell."""
        nu = int(self.n_used[0])
        hooks = ctx.hooks
        if hooks.record is not None:      # ids: [B, k], copied: the buffer is the next step's
            hooks.record(self.m, torch.from_numpy(self.ids[:B * k].reshape(B, k).copy()))
        store = self.block.store
        store.request_resident(self.m, self.used[:nu].tolist(), self.counts[:nu].tolist(), hooks.step, self.host)
        if self.host:                    # host compute time, as FusedDecode's record_host_share counts it
            store.record_host_compute(int(self.ns[0]) / 1e9)


class FusedStep:
    """The step runner over a model's layers (``PlainResidual.run``): runs of consecutive fused layers through one
    ``tm_decode_layers`` call while the step allows it (module doc), every other layer through its ``forward``."""

    def __init__(self, layers: list, fused: list) -> None:
        self.lib = kernels.lib()
        self.n = len(layers)
        self.entries = (FusedLayerArgs * self.n)()
        self.index = {id(layer): i for i, layer in enumerate(layers)}
        self.fused, self.routed, self.mlps = [None] * self.n, [None] * self.n, []
        self.bufs = next((f.bufs for f in fused if f is not None), None)
        self.store = None
        for i, f in enumerate(fused):
            if f is None or (f.dense and f.mlp is None):
                continue                                    # composed, or a dense MLP the kernels cannot read
            e = self.entries[i]
            e.kind, e.L = f.part.kind, ctypes.addressof(f.args)
            if f.mlp is not None:
                e.mlp = ctypes.addressof(f.mlp.args)
                self.mlps.append(f.mlp)
            if not f.dense:
                self.routed[i] = _Routed(f, e)
                self.store = f.block.store
            self.fused[i] = f
        self.by_moe = {r.m: r for r in self.routed if r is not None}     # MoE layer index -> its side
        self._rows = None
        self._slots: dict = {}           # host (bool) -> the slots the tables were built from
        self._loading: dict = {}         # host -> keys that were loading then (not in the tables yet)
        self.calls = 0                   # tm_decode_layers calls (tests)
        self.routed_done = 0             # MoE layers whose experts ran in those calls

    def usable(self, ctx) -> bool:
        """Whether this forward may run its fused layers in one call: a decode step with no prefetch hook or
        cache-aware routing, and no per-expert hybrid decisions in the store (module doc)."""
        hooks = ctx.hooks
        if not ctx.decode or hooks.cache_bonus or hooks.routed is not None or self.bufs is None:
            return False
        st = self.store
        return st is None or st.placement.hybrid is None

    def _sync(self) -> None:
        """The residency tables brought up to date with the slots (the device's, or the host's for host-computed
        layers): only what changed since the last sync."""
        st = self.store
        if st is None:
            return
        # host slots only where the host tier holds every expert (loaded at start, never moved): a host tier that
        # reads from disk on demand leaves those layers' tables empty (they run the general way)
        for host, slab in ((False, st.dev), (True, st.host)) if st.host_holds_all else ((False, st.dev),):
            slots, old = slab.slot_of, self._slots.get(host, {})
            if slots == old and not self._loading.get(host):
                continue
            E, L = st.m.num_experts, self.by_moe
            changed = {k for k, v in slots.items() if old.get(k) != v} | {k for k in old if k not in slots} \
                | self._loading.get(host, set())
            loading = self._loading[host] = set()
            for key in changed:
                r = L.get(key // E)
                if r is None or r.host != host:
                    continue
                # a slot whose copy is in flight, or ended in an error (the store's request raises it), is not live
                fut = st.inflight.get(key)
                live = key in slots and (fut is None or (fut.done() and fut.exception() is None))
                if key in slots and not live:
                    loading.add(key)
                r.set(key % E, st.slot_views(key, host=host) if live else None)
            self._slots[host] = dict(slots)

    def _size(self, B: int) -> None:
        bufs = self.bufs
        k = bufs.dims[5]
        rows = bufs.B * max(k, 1)
        # the step buffers were (re)made - grown with the batch or the context - or first use: scratch for their
        # rows and pointers into them
        if (rows, bufs.xs.data_ptr()) != self._rows:
            self._rows = (rows, bufs.xs.data_ptr())
            for r in self.routed:
                if r is not None:
                    r.size(rows, bufs)
        for mlp in self.mlps:
            mlp.size(B)

    def run(self, layers: list, x: torch.Tensor, ctx) -> torch.Tensor:
        """The layers over x [B, hidden] for one forward: runs of fused layers in one call where ``usable``."""
        if not self.usable(ctx):
            for layer in layers:
                x = layer.forward(x, ctx)
            return x
        idx = [self.index.get(id(layer)) for layer in layers]
        i = 0
        while i < len(layers):
            j = i
            while j < len(layers) and idx[j] is not None and self.fused[idx[j]] is not None \
                    and (j == i or idx[j] == idx[j - 1] + 1):
                j += 1
            if j == i:
                x = layers[i].forward(x, ctx)
                i += 1
                continue
            x = self._run(idx[i], j - i, x, ctx)
            i = j
        return x

    def _run(self, i0: int, n: int, x: torch.Tensor, ctx) -> torch.Tensor:
        bufs = self.bufs
        x = x.contiguous()
        a = bufs.begin(x, ctx)
        B, k = x.shape[0], bufs.dims[5]
        self._size(B)
        keep = []
        for i in range(i0, i0 + n):       # each layer's arguments pointed at this forward
            f, e = self.fused[i], self.entries[i]
            ext, ring = f.part.prepare(f.args, ctx)
            e.ext = ctypes.addressof(ext) if ext is not None else None
            if ring is not None:
                write, read, pos = ring
                e.write, e.read, e.pos, e.n = write.data_ptr(), read.data_ptr(), pos.data_ptr(), read.shape[1]
                keep.append(ring)
            else:
                e.write = None
        done = ctypes.c_int64(0)
        size = ctypes.sizeof(FusedLayerArgs)
        while n > 0:
            self._sync()
            self.calls += 1
            rc = self.lib.tm_decode_layers(ctypes.byref(self.entries, i0 * size), n, ctypes.byref(a),
                                           ctypes.byref(done))
            d = done.value
            for i in range(i0, i0 + d):  # the store's bookkeeping, in layer order
                if self.routed[i] is not None:
                    self.routed[i].book(ctx, B, k)
                    self.routed_done += 1
            if rc:
                raise RuntimeError(f"the fused decode kernel refused layer {self.fused[i0 + d].layer.index} (code {rc}: "
                                   f"{self.lib.tm_strerror(rc).decode()})")
            if d == n:
                break
            f = self.fused[i0 + d]        # stopped after this layer's block: its experts the general way
            f._ffn(ctx, bufs)
            i0, n = i0 + d + 1, n - d - 1
        return x
