"""The host tier and the disk under it: fixed slots in one host allocation (pinned when CUDA is present,
laid over the node's shared segment under tensor parallelism), and the store directory's layer files,
read by a thread pool straight into host slots (O_DIRECT where the file system allows it),
checksum-verified.

Under tensor parallelism a host slot holds every rank's slice of its expert, rank-major (rank j's at j x
the rank stride): the disk holds whole blobs, so a whole one is read and cut (runtime/store/slices.py).
"""
from __future__ import annotations

import os
import zlib

import numpy as np
import torch

from ..kernels import hugepages
from .layout import _DTYPES, ALIGN, Manifest
from .shared import SharedSegment
from .slices import Shard, slice_expert


class ChecksumError(RuntimeError):
    pass


class Slab:
    """``n`` fixed slots of ``stride`` bytes in one allocation; slot addresses 4 KiB aligned on
    the host so O_DIRECT reads can land in them."""

    def __init__(self, n: int, stride: int, device: str, pin: bool, buffer: "torch.Tensor | None" = None) -> None:
        """``buffer``: bytes to lay the slots over (a shared host tier, runtime/store/shared.py), else a new
        allocation."""
        pad = ALIGN if device == "cpu" else 0
        raw = buffer if buffer is not None else torch.empty(n * stride + pad, dtype=torch.uint8, device=device,
                                                            pin_memory=pin)
        if buffer is None and device == "cpu" and not pin:
            hugepages.advise(raw)       # before the slots are written: the experts' pages come in 2 MiB
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


def disk_read_rate(store_dir: str, m: Manifest, *, threads: int = 4, seconds: float = 1.0,
                   max_bytes: int = 512 * 2**20) -> "tuple[float, str]":
    """(bytes per second, mode) of reading the store's experts as the store reads its misses: whole experts,
    O_DIRECT where the file system takes it, ``threads`` at once (the demand pool's), in an order that spreads
    over the layer files; for about ``seconds`` or ``max_bytes``, whichever ends first. Without O_DIRECT the page
    cache may answer: the mode says which."""
    import time
    from concurrent.futures import ThreadPoolExecutor
    disk = DiskTier(store_dir, m)
    slab = Slab(threads, m.blob_stride, "cpu", pin=False)
    n_total = m.num_layers * m.num_experts
    order = [(i % m.num_layers, (i * 7919) % m.num_experts) for i in range(n_total)]   # 7919: a prime, a spread
    done = [0]
    t0 = time.perf_counter()

    def worker(j: int) -> None:
        buf = slab.data[j].numpy()
        for i in range(j, n_total, threads):
            if time.perf_counter() - t0 > seconds or done[0] * m.blob_bytes >= max_bytes:
                return
            disk.read_into(*order[i], buf, verify=False)
            done[0] += 1
    try:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(worker, range(threads)))
        dt = time.perf_counter() - t0
    finally:
        disk.close()
    return done[0] * m.blob_bytes / max(dt, 1e-9), disk.mode


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
        # (layer, expert) whose bytes this process has read and checked once: a later read of the same expert (a
        # store bigger than memory rereads its misses) skips the crc32 (0.5 ms per 1.3 MB expert on one core)
        self.verified: set = set()

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
        if verify and (layer, expert) not in self.verified:
            crc = zlib.crc32(memoryview(dst)[: m.blob_bytes])
            if crc != m.checksums[layer][expert]:
                raise ChecksumError(f"{m.layer_file(layer)}: checksum mismatch for layer {layer} expert {expert} "
                                    f"(crc32 {crc:#010x}, manifest {m.checksums[layer][expert]:#010x}): the store is corrupt")
            self.verified.add((layer, expert))

    def close(self) -> None:
        for fd in list(self.fds) + list(self._fallback.values()):
            os.close(fd)
        self.fds, self._fallback = [], {}


def join_shared(share, nbytes: int, cuda: bool) -> SharedSegment:
    """The node's shared host segment (``share``: a ``HostShare``, runtime/store/shared.py): the group's first
    rank creates it, every rank maps it, and once all have, its name is removed; pinned with CUDA."""
    segment = None
    if share.create:
        segment = SharedSegment(share.path, nbytes, create=True)
    share.barrier()
    if not share.create:
        segment = SharedSegment(share.path, nbytes, create=False)
    share.barrier()                 # every rank has mapped it: the name can go
    if share.create:
        segment.unlink()
    if cuda:
        segment.pin()
    return segment


class HostTier:
    """``n`` host slots over the store's disk files. ``m``: the manifest of what one rank's device slot holds
    (the whole expert without tensor parallelism); ``full_m``: the stored experts'. A slot is ``stride`` =
    ``m.blob_stride`` x ranks bytes; ``share`` joins the node's shared segment instead of allocating."""

    def __init__(self, store_dir: str, full_m: Manifest, m: Manifest, shard: Shard, n: int, *, cuda: bool,
                 share=None, direct_io: bool = True, verify: bool = True) -> None:
        self.full_m, self.m, self.shard, self.share, self.verify = full_m, m, shard, share, verify
        self.stride = m.blob_stride * shard.world
        self.segment = join_shared(share, n * self.stride, cuda) if share is not None else None
        self.slab = Slab(n, self.stride, "cpu", pin=cuda and share is None,
                         buffer=self.segment.tensor if self.segment is not None else None)
        self.disk = DiskTier(store_dir, full_m, direct=direct_io)

    def blob(self, slot: int) -> torch.Tensor:
        """This rank's bytes of a host slot (the whole slot without tensor parallelism)."""
        S = self.m.blob_stride
        return self.slab.data[slot][self.shard.rank * S:(self.shard.rank + 1) * S]

    def read(self, key: int) -> None:
        """Expert ``key``'s blob from disk into its host slot (never under tensor parallelism: there the host
        tier holds every expert, read at start by ``load_all``)."""
        E = self.m.num_experts
        self.disk.read_into(key // E, key % E, self.slab.data[self.slab.slot_of[key]].numpy(), self.verify)

    def load_all(self, layers: tuple, pool, progress: bool) -> int:
        """Every expert of the MoE layers [a, b) into a slot of its own, read on ``pool``'s threads (shared by
        the node's ranks: each reads every ranks-th, so the disk is read once). Returns the blobs read here."""
        m = self.full_m
        keys = [l * m.num_experts + e for l in range(*layers) for e in range(m.num_experts)]
        for k in keys:                      # slots in key order: the same on every rank of a group
            self.slab.alloc(k)
        share = self.share
        mine = keys if share is None else keys[share.rank::share.ranks]   # the disk read once per node
        bar = None
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=len(mine), desc="loading experts into host memory", unit="expert")
        load = self.read if self.shard.world == 1 else self._read_sliced
        futs = [pool.submit(load, k) for k in mine]
        for f in futs:
            f.result()
            if bar:
                bar.update()
        if bar:
            bar.close()
        if share is not None:
            share.barrier()                 # every rank's part is in: the tier is whole
        return len(mine)

    def _read_sliced(self, key: int) -> None:
        """Tensor parallelism: one whole blob from disk, cut into every rank's slice, each written to its
        place in the expert's host slot (rank j's at j x the rank stride)."""
        full, E, S = self.full_m, self.m.num_experts, self.m.blob_stride
        raw = torch.empty(full.blob_stride + ALIGN, dtype=torch.uint8)
        off = (-raw.data_ptr()) % ALIGN
        buf = raw[off:off + full.blob_stride]                            # O_DIRECT wants an aligned buffer
        self.disk.read_into(key // E, key % E, buf.numpy(), self.verify)
        views = {ts.name: buf[ts.offset:ts.offset + ts.nbytes].view(_DTYPES[ts.dtype]).view(ts.shape)
                 for ts in full.tensors}
        slot = self.slab.data[self.slab.slot_of[key]]
        inter = next(w.shape[1] for w in full.weights if w.name == "down")
        for j in range(self.shard.world):
            part = slice_expert(full.weights, views, inter, Shard(j, self.shard.world))
            base = j * S
            for ts in self.m.tensors:
                dst = slot[base + ts.offset:base + ts.offset + ts.nbytes].view(_DTYPES[ts.dtype]).view(ts.shape)
                dst.copy_(part[ts.name])

    def close(self) -> None:
        self.disk.close()
