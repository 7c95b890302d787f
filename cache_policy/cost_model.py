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
- No overlap: step = sum over layers of (P_l + D_l + C_l + dense_l), P_l the prefetch transfer
  issued for layer l.
- Overlap (side stream, as the runtime does it): a prefetch for layer l runs during layer l-1's
  compute and only its excess stalls: spill_l = max(0, P_l - C_{l-1}). Demand misses stream
  while resident experts compute; the last to arrive still has to compute:
  layer_l = spill_l + max(C_l, D_l + c_min) (c_min = one expert, one token; 0 when D_l = 0).
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

# Bits per parameter with the formats' scales (runtime/quant.py): mxfp4 one E8M0 byte per 32; int4 one
# bf16 scale per group of 32; fp8 one float32 per 128x128 tile (0.002 bits, rounded away).
DTYPE_BITS = {"fp32": 32.0, "bf16": 16.0, "fp16": 16.0, "fp8": 8.0, "mxfp4": 4.25, "int4": 4.5}

# Expert geometry (hidden, intermediate) of SwiGLU experts: 3 matrices of hidden x intermediate.
EXPERT_GEOMETRY = {
    "deepseek-v2-lite": (2048, 1408),   # config.json: hidden_size 2048, moe_intermediate_size 1408
    "kimi-k3": (3584, 3072),            # latent 3584 (LatentMoE); intermediate as measured in h200-anchors.json
    "deepseek-v3": (7168, 2048),        # config.json: hidden_size 7168, moe_intermediate_size 2048
    "mixtral-8x7b": (4096, 14336),
    "qwen3-30b-a3b": (2048, 768),
    "olmoe-1b-7b": (2048, 1024),
}
DEFAULT_GEOMETRY = "kimi-k3"


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

    def h2d_seconds(self, nbytes: int) -> float:
        gbps = float(_interp_log(self.h2d_GBps_by_MiB, nbytes / 2**20))
        return nbytes / (gbps * 1e9)

    def h2d_GBps(self, nbytes: int) -> float:
        return float(_interp_log(self.h2d_GBps_by_MiB, nbytes / 2**20))

    def disk_seconds(self, nbytes: int) -> float:
        return nbytes / (self.disk_GBps * 1e9)

    def compute_seconds(self, tokens, params: int):
        return _interp_log(self.compute_us_by_tokens, tokens) * 1e-6 * (params / self.reference_params)


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
    for key in ("host_to_device_GBps_by_copy_MiB", "expert_compute_us_by_tokens"):
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
                           source=d.get("source", path), raw=d)


def project_step_times(*, profile: HardwareProfile, params: int, nbytes: int, num_layers: int,
                       compute_s: np.ndarray, demand_h2d: np.ndarray, demand_disk: np.ndarray,
                       pref_h2d: np.ndarray, pref_disk: np.ndarray) -> dict:
    """Per-step times in seconds, with and without overlap. Group arrays are [steps * L] in
    processing order: counts of experts per link (``*_h2d`` counts every expert that crosses
    host->device, including those that came from disk; ``*_disk`` those read from disk)."""
    t_h2d = profile.h2d_seconds(nbytes)
    t_disk = profile.disk_seconds(nbytes)
    D = np.maximum(demand_h2d * t_h2d, demand_disk * t_disk)
    P = np.maximum(pref_h2d * t_h2d, pref_disk * t_disk)
    dense = profile.non_expert_us_per_layer * 1e-6
    C = compute_s
    serial = (P + D + C + dense).reshape(-1, num_layers).sum(1)
    c_min = float(profile.compute_seconds(1, params))
    prev_C = np.concatenate([[0.0], C[:-1]])  # the first layer's prefetch had no compute to hide behind
    spill = np.maximum(0.0, P - prev_C)
    overlap = (spill + np.maximum(C, np.where(D > 0, D + c_min, 0.0)) + dense).reshape(-1, num_layers).sum(1)
    return {"serial": serial, "overlap": overlap, "h2d_seconds_per_expert": t_h2d,
            "disk_seconds_per_expert": t_disk, "compute_seconds_one_token": c_min}
