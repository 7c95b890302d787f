"""Expert sizes, hardware profiles, and projected step time from a replay's counts.

Model of one decode step (documented so that projections can be checked by hand):
- Each layer computes its needed experts; expert e with n tokens takes c(n) = the profile's
  measured time for the reference expert at n tokens (log-linear between measured points),
  scaled by (expert params / reference params): small-batch expert compute reads the weights,
  so it scales with their size.
- A copy of one expert over host->device takes bytes / bw(bytes), with bw looked up by copy size
  in the profile (the measured curve already includes per-copy overhead). A disk->host read
  takes bytes / disk bandwidth. The two links run concurrently and pipeline over experts, so a
  layer's demand transfer time is D = max(h2d bytes / h2d bw, disk bytes / disk bw).
- No overlap: step = sum over layers of (P_l + D_l + C_l + H_l + dense_l), P_l the prefetch
  transfer issued for layer l, H_l the host compute of its experts computed on the host.
- Overlap (side stream, as the runtime does it): demand misses stream while resident experts
  compute; the last to arrive still has to compute: dev_l = max(C_l, D_l + c_min) (c_min = one
  expert, one token; 0 when D_l = 0). A prefetch for layer l is issued once layer l-1's routing is
  known, behind that layer's demand loads (prefetches yield to demand), so it has the link time
  layer l-1 leaves idle, W_{l-1} = dev_{l-1} - D_{l-1}, and only its excess stalls:
  spill_l = max(0, P_l - W_{l-1}). Issued only once layer l-1's experts are combined (the runtime before
  issue 28: its prefetch hook fired after the experts), the prefetch has only layer l's non-expert work
  to hide behind: spill_l = max(0, P_l - dense_l) (``stall_after_combine``, for comparison).
- Hybrid execution (``HybridCost``): experts computed on the host CPU from their host-tier slot
  move no bytes. With a host whose cores are not the device's (a GPU node), they run beside the
  device: layer_l = spill_l + max(dev_l, H_l); on a CPU-only machine the "device" is the same
  cores: layer_l = spill_l + dev_l + H_l.
Attention and dense layers add ``non_expert_us_per_layer`` (0 in the shipped profiles: the
projection is then an upper bound on tokens/s).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import numpy as np
from .jsonfile import read_json

PROFILE_DIR = os.path.join(os.path.dirname(__file__), "profiles")

# Bits per parameter with the formats' scales (runtime/weight_formats.py): mxfp4 one E8M0 byte per 32; int4 one
# bf16 scale per group of 32; fp8 one float32 per 128x128 tile (0.002 bits, rounded away).
DTYPE_BITS = {"fp32": 32.0, "bf16": 16.0, "fp16": 16.0, "fp8": 8.0, "int8": 8.5, "mxfp4": 4.25, "int4": 4.5}

# Expert geometry (hidden, intermediate) of SwiGLU experts: 3 matrices of hidden x intermediate.
EXPERT_GEOMETRY = {
    "deepseek-v2-lite": (2048, 1408),   # config.json: hidden_size 2048, moe_intermediate_size 1408
    "kimi-k3": (3584, 3072),            # latent 3584 (LatentMoE); intermediate as measured in h200-anchors.json
    "deepseek-v3": (7168, 2048),        # config.json: hidden_size 7168, moe_intermediate_size 2048
    "deepseek-v4-flash": (4096, 2048),  # transformers' DeepseekV4Config defaults (V4-Flash): hidden 4096, moe_intermediate 2048
    "mixtral-8x7b": (4096, 14336),
    "qwen3-30b-a3b": (2048, 768),
    "olmoe-1b-7b": (2048, 1024),
}
DEFAULT_GEOMETRY = "kimi-k3"
# The models' hidden size (the residual stream a tensor-parallel all-reduce sums; cache_policy/layout.py).
MODEL_HIDDEN = {"deepseek-v2-lite": 2048, "kimi-k3": 7168, "deepseek-v3": 7168, "deepseek-v4-flash": 4096,
                "mixtral-8x7b": 4096, "qwen3-30b-a3b": 2048, "olmoe-1b-7b": 2048}


def geometry_for_model(model: str) -> "tuple[str, bool]":
    """Map a trace's model name to an EXPERT_GEOMETRY entry. Returns (name, known)."""
    m = (model or "").lower()
    for name in EXPERT_GEOMETRY:
        if m.startswith(name) or name in m:
            return name, True
    return DEFAULT_GEOMETRY, False


def expert_params(hidden: int, intermediate: int) -> int:
    return 3 * hidden * intermediate


def expert_bytes(params: int, dtype: str) -> int:
    if dtype not in DTYPE_BITS:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPE_BITS)}")
    return int(math.ceil(params * DTYPE_BITS[dtype] / 8))


def _interp_log(table: dict, x):
    """Piecewise-linear in log(x) over a {x: y} table, clamped at both ends."""
    xs = np.array(sorted(float(k) for k in table))
    ys = np.array([table[k] for k in sorted(table, key=float)], dtype=np.float64)
    return np.interp(np.log(np.maximum(np.asarray(x, dtype=np.float64), 1e-9)), np.log(xs), ys)


@dataclass
class HardwareProfile:
    name: str
    h2d_GBps_by_MiB: dict
    disk_GBps: float
    compute_us_by_tokens: dict
    reference_params: int
    non_expert_us_per_layer: float = 0.0
    source: str = ""
    raw: dict = field(default_factory=dict, repr=False)
    # Expert compute on the host CPU (hybrid execution), for the same reference expert. None: the
    # device compute curve (a CPU-only machine, where device and host are the same cores).
    host_compute_us_by_tokens: "dict | None" = None
    host_concurrent: bool = False      # host cores run beside the device (GPU node) or are the device (CPU)

    def h2d_seconds(self, nbytes: int) -> float:
        gbps = float(_interp_log(self.h2d_GBps_by_MiB, nbytes / 2**20))
        return nbytes / (gbps * 1e9)

    def h2d_GBps(self, nbytes: int) -> float:
        return float(_interp_log(self.h2d_GBps_by_MiB, nbytes / 2**20))

    def disk_seconds(self, nbytes: int) -> float:
        return nbytes / (self.disk_GBps * 1e9)

    def compute_seconds(self, tokens, params: int):
        return _interp_log(self.compute_us_by_tokens, tokens) * 1e-6 * (params / self.reference_params)

    def host_compute_seconds(self, tokens, params: int):
        """One expert computed on the host CPU from host memory: small-batch expert compute reads
        the weights, so it scales with their size like ``compute_seconds``."""
        tab = self.host_compute_us_by_tokens or self.compute_us_by_tokens
        return _interp_log(tab, tokens) * 1e-6 * (params / self.reference_params)


def list_profiles() -> list:
    return sorted(f[:-5] for f in os.listdir(PROFILE_DIR) if f.endswith(".json"))


def load_profile(name_or_path: str) -> HardwareProfile:
    path = name_or_path
    if not (os.path.sep in name_or_path or name_or_path.endswith(".json")):
        path = os.path.join(PROFILE_DIR, name_or_path + ".json")
        if not os.path.exists(path):
            raise ValueError(f"unknown hardware profile {name_or_path!r}; shipped: {', '.join(list_profiles())}, "
                             f"or give the path of a JSON file")
    if not os.path.exists(path):
        raise ValueError(f"hardware profile file {path!r} does not exist")
    d = read_json(path)
    need = ["host_to_device_GBps_by_copy_MiB", "disk_to_host_GBps", "expert_compute_us_by_tokens", "reference_expert"]
    missing = [k for k in need if k not in d]
    if missing:
        raise ValueError(f"{path}: hardware profile lacks {', '.join(missing)}")
    ref = d["reference_expert"]
    params = ref.get("params") or (expert_params(ref["hidden"], ref["intermediate"]) if "hidden" in ref else None)
    if not params:
        raise ValueError(f"{path}: reference_expert needs 'params' or 'hidden' and 'intermediate'")
    for key in ("host_to_device_GBps_by_copy_MiB", "expert_compute_us_by_tokens", "host_expert_compute_us_by_tokens"):
        if key not in d:
            continue
        tab = d[key]
        if not isinstance(tab, dict) or not tab or any(float(v) <= 0 or float(k) <= 0 for k, v in tab.items()):
            raise ValueError(f"{path}: {key} must map positive sizes to positive numbers")
    if float(d["disk_to_host_GBps"]) <= 0:
        raise ValueError(f"{path}: disk_to_host_GBps must be positive")
    return HardwareProfile(name=d.get("name", os.path.basename(path)[:-5]),
                           h2d_GBps_by_MiB={k: float(v) for k, v in d["host_to_device_GBps_by_copy_MiB"].items()},
                           disk_GBps=float(d["disk_to_host_GBps"]),
                           compute_us_by_tokens={k: float(v) for k, v in d["expert_compute_us_by_tokens"].items()},
                           reference_params=int(params),
                           non_expert_us_per_layer=float(d.get("non_expert_us_per_layer", 0.0)),
                           source=d.get("source", path), raw=d,
                           host_compute_us_by_tokens=({k: float(v) for k, v in d["host_expert_compute_us_by_tokens"].items()}
                                                      if "host_expert_compute_us_by_tokens" in d else None),
                           host_concurrent=bool(d.get("host_concurrent", False)))


def project_step_times(*, profile: HardwareProfile, params: int, nbytes: int, num_layers: int,
                       compute_s: np.ndarray, demand_h2d: np.ndarray, demand_disk: np.ndarray,
                       pref_h2d: np.ndarray, pref_disk: np.ndarray, host_s: "np.ndarray | None" = None) -> dict:
    """Per-step times in seconds, with and without overlap. Group arrays are [steps * L] in
    processing order: counts of experts per link (``*_h2d`` counts every expert that crosses
    host->device, including those that came from disk; ``*_disk`` those read from disk);
    ``compute_s`` the device compute of the group, ``host_s`` the host compute of its experts
    computed on the host (hybrid execution)."""
    t_h2d = profile.h2d_seconds(nbytes)
    t_disk = profile.disk_seconds(nbytes)
    D = np.maximum(demand_h2d * t_h2d, demand_disk * t_disk)
    P = np.maximum(pref_h2d * t_h2d, pref_disk * t_disk)
    dense = profile.non_expert_us_per_layer * 1e-6
    C = compute_s
    H = np.zeros_like(C) if host_s is None else host_s
    serial = (P + D + C + H + dense).reshape(-1, num_layers).sum(1)
    c_min = float(profile.compute_seconds(1, params))
    dev = np.maximum(C, np.where(D > 0, D + c_min, 0.0))
    layer = np.maximum(dev, H) if profile.host_concurrent else dev + H
    # Link time each layer leaves idle, for the next layer's prefetch (the first layer's prefetch
    # had nothing to hide behind).
    free = np.concatenate([[0.0], (layer - D)[:-1]])
    spill = np.maximum(0.0, P - free)
    overlap = (spill + layer + dense).reshape(-1, num_layers).sum(1)
    # per step: the prefetch's stall issued at routing (the runtime) and issued after the combine (before)
    stall = spill.reshape(-1, num_layers).sum(1)
    stall_after = np.maximum(0.0, P - dense).reshape(-1, num_layers).sum(1)
    return {"serial": serial, "overlap": overlap, "stall": stall, "stall_after_combine": stall_after,
            "h2d_seconds_per_expert": t_h2d,
            "disk_seconds_per_expert": t_disk, "compute_seconds_one_token": c_min}


class HybridCost:
    """Where each expert a layer needs is computed, decided per expert per step from the cost
    model (llama.cpp --n-cpu-moe, KTransformers and Fiddler compute cold experts where they live).

    A needed expert that is not on the device is either moved (``t_link`` on the host->device link
    behind what is already queued, then computed on the device) or computed on the host CPU from
    its host-tier slot, moving nothing. ``split`` picks the host share that minimises the layer's
    time under the overlap model of ``project_step_times``: device side max(C, D + c_min), host
    side H, concurrent (GPU node: max) or not (CPU-only: sum). Misses are ranked by host time per
    device-side second saved, and every prefix of that ranking is evaluated: with equal token
    counts (batch 1) this is the exact optimum; with mixed counts it is the best of the
    ranking's prefixes. Ties go to the host (fewer bytes moved).
    """

    def __init__(self, profile: HardwareProfile, params: int, nbytes: int) -> None:
        self.profile, self.params = profile, params
        self.t_link = profile.h2d_seconds(nbytes)
        self.c_min = float(profile.compute_seconds(1, params))
        self.concurrent = profile.host_concurrent
        self._dev = [0.0]
        self._host = [0.0]
        self._memo: dict = {}

    def tables(self, max_tokens: int) -> "tuple[list, list]":
        """Device and host seconds of one expert by token count 0..max_tokens (cached; lists, as
        the replay loop indexes them per key)."""
        if max_tokens >= len(self._dev):
            n = np.arange(max(max_tokens + 1, 2 * len(self._dev)))
            self._dev = np.where(n > 0, self.profile.compute_seconds(np.maximum(n, 1), self.params), 0.0).tolist()
            self._host = np.where(n > 0, self.profile.host_compute_seconds(np.maximum(n, 1), self.params), 0.0).tolist()
        return self._dev, self._host

    def layer_seconds(self, dev_compute: float, n_moved: int, host_compute: float, queued: float = 0.0) -> float:
        D = queued + n_moved * self.t_link
        dev = max(dev_compute, D + self.c_min) if n_moved else dev_compute
        return max(dev, host_compute) if self.concurrent else dev + host_compute

    def prefetch_saving(self, hybrid: bool) -> float:
        """What a prefetched expert saves when it is needed (one token): the demand transfer it
        avoids - or, with hybrid execution, what computing the miss on the host would have added:
        beside the device, at most that host time; on the device's own cores (CPU-only), the
        host time beyond a hit's compute, which is nothing when both are the same CPU."""
        if not hybrid:
            return self.t_link
        dev, host = self.tables(1)
        extra = host[1] if self.concurrent else max(0.0, host[1] - dev[1])
        return min(self.t_link, extra)

    def idle_link_seconds(self, dev_counts, n_moved: int, host_counts=(), queued: float = 0.0) -> float:
        """Link time a layer leaves idle - the window the next layer's prefetch has (the overlap
        formula of ``project_step_times``): its time minus its demand transfers. ``dev_counts``:
        tokens per expert computed on the device; ``host_counts``: per expert computed on the host."""
        dev, host = self._dev, self._host
        if max(dev_counts, default=0) >= len(dev) or max(host_counts, default=0) >= len(dev):
            dev, host = self.tables(max(max(dev_counts, default=0), max(host_counts, default=0)))
        c = sum(dev[n] for n in dev_counts)
        h = sum(host[n] for n in host_counts)
        D = queued + n_moved * self.t_link
        return self.layer_seconds(c, n_moved, h, queued) - D

    def split(self, hit_counts, miss_counts, queued: float = 0.0) -> list:
        """Positions in ``miss_counts`` (tokens per missing expert) to compute on the host.
        ``hit_counts``: tokens per device-resident expert of the layer; ``queued``: link seconds
        already queued ahead of this layer's demand loads. Decisions are cached by their inputs
        (at batch 1 a handful of distinct groups repeat millions of times in a replay)."""
        if not miss_counts:
            return []
        key = (tuple(hit_counts), tuple(miss_counts), queued)
        got = self._memo.get(key)
        if got is None:
            if len(self._memo) > 200_000:
                self._memo.clear()
            got = self._memo[key] = self._split(hit_counts, miss_counts, queued)
        return got

    def _split(self, hit_counts, miss_counts, queued: float) -> list:
        m = len(miss_counts)
        mx = max(max(miss_counts), max(hit_counts, default=0))
        dev, host = self.tables(mx)
        c_hits = float(sum(dev[n] for n in hit_counts))
        a = [self.t_link + dev[n] for n in miss_counts]         # device-side seconds the host saves
        b = [host[n] for n in miss_counts]                      # host seconds it costs
        order = sorted(range(m), key=lambda i: (b[i] / a[i], i))
        c_dev = c_hits + sum(dev[n] for n in miss_counts)
        best_j, best_t = 0, self.layer_seconds(c_dev, m, 0.0, queued)
        h = 0.0
        for j, i in enumerate(order, 1):
            c_dev -= dev[miss_counts[i]]
            h += b[i]
            t = self.layer_seconds(c_dev, m - j, h, queued)
            if t <= best_t * (1 + 1e-9):   # a tie (to rounding) goes to the host: fewer bytes moved
                best_j, best_t = j, min(t, best_t)
        return sorted(order[:best_j])
