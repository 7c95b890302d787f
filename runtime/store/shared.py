"""One host tier per node, shared by the tensor-parallel ranks on it.

Every rank of a tensor-parallel group needs the same experts in host memory, each only its slice of
them. Held once per rank, a node with N ranks would hold the host tier N times; here it is one file in
``/dev/shm`` that every rank maps (``MAP_SHARED``): the group's first rank creates it, every rank maps
it, and once all have, the file's name is removed - the memory stays until the last rank unmaps it,
so a crashed group leaves nothing behind. Each expert's slot holds the ranks' slices back to back
(rank-major), so a rank's slice is one contiguous range: one copy to its device, one view for the
host kernels. With CUDA each rank registers the mapping with the driver (``cudaHostRegister``):
pinned, so its copies to the device run at the link's speed.
"""
from __future__ import annotations

import mmap
import os
import tempfile
from dataclasses import dataclass

import torch


def shm_dir() -> str:
    """Where shared segments live: /dev/shm (memory) where it exists, else the temp directory."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


@dataclass
class HostShare:
    """How a rank joins its node's shared host tier: the segment's ``path``, whether this rank
    ``create``s it, its ``rank`` / ``ranks`` among the ranks sharing it (each loads every ranks-th expert
    from disk: the disk is read once), and ``barrier`` - a callable that returns once every sharing rank
    has called it."""
    path: str
    create: bool
    rank: int
    ranks: int
    barrier: object


class SharedSegment:
    """``nbytes`` of memory mapped from ``path`` (created when ``create``); ``tensor``: them as uint8."""

    def __init__(self, path: str, nbytes: int, create: bool) -> None:
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        try:
            fd = os.open(path, flags, 0o600)
        except OSError as e:
            raise RuntimeError(f"shared host tier {path}: {e.strerror} (a stale segment of a crashed group? remove it)") \
                from None
        try:
            if create:
                os.ftruncate(fd, nbytes)
            elif os.fstat(fd).st_size < nbytes:
                raise RuntimeError(f"shared host tier {path}: {os.fstat(fd).st_size} bytes, expected {nbytes}")
            self.mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.path, self.nbytes = path, nbytes
        self.tensor = torch.frombuffer(self.mm, dtype=torch.uint8)      # tensor: [nbytes], page aligned
        self.pinned = False

    def pin(self) -> bool:
        """Register the mapping with CUDA (page-locked for DMA). False where that is refused."""
        if not torch.cuda.is_available():
            return False
        try:
            rc = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), self.nbytes, 0)
            self.pinned = int(getattr(rc, "value", rc)) == 0
        except Exception:  # noqa: BLE001 - unpinned memory still works, at a lower copy speed
            self.pinned = False
        return self.pinned

    def unlink(self) -> None:
        """Remove the name (the creator, once every rank mapped it)."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
