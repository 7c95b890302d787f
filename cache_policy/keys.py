"""Expert identity, capacity scopes and capacity parsing.

Inside the hot loops an expert is one int, ``layer * num_experts + expert`` (the *flat key*):
hashing a small int is the cheapest thing Python can do, and the same flat key is used by the
replay simulator and by the live store so that both agree on identity. ``ExpertKey`` is the
readable form used at API boundaries.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import NamedTuple

SCOPES = ("layer", "global")
# How the live engine picks each step's requests (runtime/engine/scheduler.py).
SCHEDULES = ("fcfs", "expert-aware")
# Prompt tokens a sequence feeds per step by default: llama.cpp's ubatch. The prefill matmuls need rows - an
# expert gets chunk x top_k / experts of them (16 at 64 on a 32-expert top-4 model, past the host kernels'
# GEMV into BLAS at 512) - and every step pays its per-layer overhead once (bench/results/prefill_chunk.md).
PREFILL_CHUNK = 512


class ExpertKey(NamedTuple):
    layer: int
    expert: int

    def flat(self, num_experts: int) -> int:
        return self.layer * num_experts + self.expert

    @staticmethod
    def from_flat(key: int, num_experts: int) -> "ExpertKey":
        return ExpertKey(key // num_experts, key % num_experts)


_BYTE_UNITS = {
    "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}


def parse_bytes(text: str) -> int:
    """'24GiB' -> 25769803776; a plain integer is bytes ('200000'). Raises ValueError naming the
    text on anything else."""
    if re.fullmatch(r"\s*[0-9]+\s*", str(text)):
        return int(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?i?B)\s*", str(text), flags=re.IGNORECASE)
    if not m:
        raise ValueError(f"cannot parse byte size {text!r}: expected bytes (200000) or a number with a unit such as "
                         f"512MiB, 24GiB, 1.5TB")
    return int(float(m.group(1)) * _BYTE_UNITS[m.group(2).lower()])


@dataclass(frozen=True)
class Capacity:
    """A tier capacity as the user wrote it: a fraction of all experts, a count, or bytes."""

    kind: str  # "fraction" | "count" | "bytes"
    value: float
    text: str

    @staticmethod
    def parse(text: "str | int | float", flag: str = "capacity") -> "Capacity":
        s = str(text).strip()
        if re.search(r"[A-Za-z]", s):
            try:
                return Capacity("bytes", float(parse_bytes(s)), s)
            except ValueError:
                raise ValueError(f"{flag}: cannot parse {s!r}: give a fraction of all experts (0.1), "
                                 f"a count of experts (166) or a size (24GiB)") from None
        try:
            v = float(s)
        except ValueError:
            raise ValueError(f"{flag}: cannot parse {s!r}: give a fraction of all experts (0.1), "
                             f"a count of experts (166) or a size (24GiB)") from None
        if not math.isfinite(v) or v <= 0:
            raise ValueError(f"{flag}: {s!r} must be positive")
        if "." in s or "e" in s.lower():
            if v > 1.0:
                raise ValueError(f"{flag}: fraction {s!r} is above 1.0 (all experts); "
                                 f"write a whole number for a count of experts")
            return Capacity("fraction", v, s)
        return Capacity("count", v, s)

    def slots(self, *, scope: str, num_layers: int, num_experts: int,
              expert_bytes: "int | None" = None, flag: str = "capacity") -> int:
        """Slots of the pool this capacity gives: per layer with scope 'layer', in total with 'global'.

        A count means C slots per layer with scope 'layer' and C slots in total with 'global'.
        Fractions and byte sizes describe the whole tier and are split evenly over layers
        (rounded down) with scope 'layer'.
        """
        if scope not in SCOPES:
            raise ValueError(f"unknown scope {scope!r}; choose one of {', '.join(SCOPES)}")
        total_experts = num_layers * num_experts
        if self.kind == "count":
            n = int(self.value)
            limit = num_experts if scope == "layer" else total_experts
            return min(n, limit)
        if self.kind == "fraction":
            total = int(math.floor(self.value * total_experts + 1e-9))
        else:
            if not expert_bytes:
                raise ValueError(f"{flag}: {self.text!r} is a byte size, which needs the expert size "
                                 f"(pass --expert-bytes or a known --model geometry)")
            total = int(self.value // expert_bytes)
        if scope == "layer":
            return min(total // num_layers, num_experts)
        return min(total, total_experts)


@dataclass(frozen=True)
class CpuExperts:
    """Where experts not on the device are computed (``--cpu-experts``).

    ``0`` (off): every needed expert is moved to the device and computed there.
    ``N``: every expert of the first N MoE layers lives on the host and is computed there
    (llama.cpp's --n-cpu-moe); the rest as with 0.
    ``auto``: per expert per step, the cost model decides between moving an expert and computing
    it on the host CPU from its host-tier slot (``cost_model.HybridCost``).
    """
    auto: bool = False
    layers: int = 0

    @property
    def enabled(self) -> bool:
        return self.auto or self.layers > 0

    def __str__(self) -> str:
        return "auto" if self.auto else str(self.layers)

    @staticmethod
    def parse(value: "str | int | CpuExperts", num_layers: "int | None" = None,
              flag: str = "--cpu-experts") -> "CpuExperts":
        if isinstance(value, CpuExperts):
            c = value
        else:
            s = str(value).strip().lower()
            if s == "auto":
                c = CpuExperts(auto=True)
            elif s in ("", "off", "none"):
                c = CpuExperts()
            elif re.fullmatch(r"[0-9]+", s):
                c = CpuExperts(layers=int(s))
            else:
                raise ValueError(f"{flag}: {value!r} is neither 'auto' nor a number of MoE layers")
        if num_layers is not None and c.layers > num_layers:
            raise ValueError(f"{flag} {c.layers}: the model has {num_layers} MoE layers")
        return c


@dataclass(frozen=True)
class Tier:
    """One level of the hierarchy: its name, the link that fills it, what it is."""
    name: str
    fill_link: "str | None"
    doc: str


# The registry of tiers, fastest first: the store's counters, the engine's summary, replay's
# "served from" and the metrics' labels all come from here.
TIERS = {t.name: t for t in (
    Tier("device", "host_to_device", "accelerator memory (HBM); CPU memory stands in without CUDA"),
    Tier("host", "disk_to_host", "host DRAM, pinned when CUDA is present"),
    Tier("disk", None, "the store's files (holds every expert)"),
)}
LINKS = tuple(t.fill_link for t in reversed(TIERS.values()) if t.fill_link)   # ("disk_to_host", "host_to_device")
