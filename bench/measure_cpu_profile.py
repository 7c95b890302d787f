"""Measure a hardware profile on this CPU-only machine -> cache_policy/profiles/cpu.json.

On a machine without a GPU the runtime's device tier is CPU memory, so "host to device" is a
memory-to-memory copy of one expert blob; disk is a read of expert-sized blocks from a file in
the given directory (O_DIRECT where the file system allows it, else buffered after
posix_fadvise(DONTNEED)); expert compute is a SwiGLU expert in torch float32 on all cores.

Usage: python bench/measure_cpu_profile.py [--dir /tmp] [--out cache_policy/profiles/cpu.json]
"""
import argparse
import json
import mmap
import os
import platform
import statistics
import tempfile
import time

import numpy as np
import torch

MiB = 1 << 20


def median_time(fn, reps=7, warm=2):
    for _ in range(warm):
        fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def copy_curve():
    out = {}
    for mb in (1, 4, 17, 66, 256):
        n = mb * MiB
        src = torch.empty(n, dtype=torch.uint8).random_(0, 255)
        dst = torch.empty(n, dtype=torch.uint8)
        t = median_time(lambda: dst.copy_(src))
        out[str(mb)] = round(n / t / 1e9, 2)
    return out


def disk_read(directory, mb=17, blocks=24):
    n = mb * MiB
    fd, path = tempfile.mkstemp(dir=directory, suffix=".blob")
    try:
        with os.fdopen(fd, "wb") as f:
            for _ in range(blocks):
                f.write(np.random.default_rng(0).integers(0, 255, n, dtype=np.uint8).tobytes())
            f.flush()
            os.fsync(f.fileno())
        mode = "O_DIRECT"
        try:
            rfd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        except (OSError, AttributeError):
            rfd, mode = os.open(path, os.O_RDONLY), "buffered after fadvise(DONTNEED)"
        buf = mmap.mmap(-1, n)  # page-aligned, as O_DIRECT requires
        if mode != "O_DIRECT":
            os.posix_fadvise(rfd, 0, 0, os.POSIX_FADV_DONTNEED)
        t0 = time.perf_counter()
        try:
            for i in range(blocks):
                os.preadv(rfd, [buf], i * n)
        except OSError:
            os.close(rfd)
            rfd, mode = os.open(path, os.O_RDONLY), "buffered after fadvise(DONTNEED)"
            os.posix_fadvise(rfd, 0, 0, os.POSIX_FADV_DONTNEED)
            t0 = time.perf_counter()
            for i in range(blocks):
                os.preadv(rfd, [buf], i * n)
        dt = time.perf_counter() - t0
        os.close(rfd)
        return round(blocks * n / dt / 1e9, 3), mode
    finally:
        os.unlink(path)


def expert_compute(hidden, inter):
    torch.manual_seed(0)
    wg = torch.randn(inter, hidden) * 0.02
    wu = torch.randn(inter, hidden) * 0.02
    wd = torch.randn(hidden, inter) * 0.02
    out = {}
    for tok in (1, 8, 64, 512):
        x = torch.randn(tok, hidden)  # x: [tokens, hidden]

        def f():
            h = torch.nn.functional.silu(x @ wg.T) * (x @ wu.T)  # h: [tokens, inter]
            return h @ wd.T

        with torch.inference_mode():
            out[str(tok)] = round(median_time(f) * 1e6, 1)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="directory on the disk to measure")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                  "cache_policy", "profiles", "cpu.json"))
    a = ap.parse_args()
    hidden, inter = 2048, 1408  # DeepSeek-V2-Lite's expert: small enough to time on 2 cores
    curve = copy_curve()
    disk, mode = disk_read(a.dir)
    comp = expert_compute(hidden, inter)
    prof = {
        "name": "cpu",
        "description": f"CPU-only machine: {platform.machine()}, {os.cpu_count()} cores; the device tier is CPU memory.",
        "source": f"bench/measure_cpu_profile.py on {time.strftime('%Y-%m-%d')}, torch {torch.__version__}",
        "device": "cpu",
        "host_to_device_GBps_by_copy_MiB": curve,
        "host_to_device_cite": "memory-to-memory copy of one blob (torch copy_), median of 7",
        "disk_to_host_GBps": disk,
        "disk_to_host_cite": f"sequential 17 MiB reads, {mode}, directory {a.dir}",
        "expert_compute_us_by_tokens": comp,
        "expert_compute_cite": "SwiGLU expert, torch float32, all cores, median of 7",
        "reference_expert": {"hidden": hidden, "intermediate": inter, "dtype": "fp32",
                             "params": 3 * hidden * inter},
        "host_concurrent": False,
        "host_concurrent_cite": "CPU-only: the device tier is host memory and the same cores compute both; host "
                                "compute is the expert_compute curve",
        "non_expert_us_per_layer": 0.0,
    }
    with open(a.out, "w") as f:
        json.dump(prof, f, indent=2)
    print(json.dumps(prof, indent=2))


if __name__ == "__main__":
    main()
