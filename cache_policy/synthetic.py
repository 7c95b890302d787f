"""Seeded synthetic routing traces with locality knobs, at any geometry.

Knobs (all default to uniform, independent routing):
- ``zipf_s``: popularity skew. Expert of rank r (a random permutation per layer) is drawn with
  probability proportional to 1 / r^s; s = 0 is uniform.
- ``persistence``: the chance that each of a token's k slots re-uses the expert the previous
  token of the same sequence chose in that slot, at that layer (temporal locality).
- ``cross_layer``: the chance that each slot at layer l follows a fixed random map of the
  expert chosen in that slot at layer l-1 (a predictable path through the layers).
The k experts of a token at a layer are always distinct. Same seed, same trace.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .traces import Trace

GEOMETRIES = {
    # name: (layers, experts, top_k) of the MoE layers
    "kimi-k3": (93, 896, 16),
    "deepseek-v3": (58, 256, 8),
    "deepseek-v4-flash": (43, 256, 6),
    "deepseek-v2-lite": (26, 64, 6),
    "mixtral-8x7b": (32, 8, 2),
    "qwen3-30b-a3b": (48, 128, 8),
    "olmoe-1b-7b": (16, 64, 8),
    "small": (8, 64, 6),
}


@dataclass(frozen=True)
class SyntheticSpec:
    num_layers: int = 8
    num_experts: int = 64
    top_k: int = 6
    num_sequences: int = 64
    seq_len: int = 64
    seq_len_min: "int | None" = None  # lengths uniform in [seq_len_min, seq_len] when set
    zipf_s: float = 0.0
    persistence: float = 0.0
    cross_layer: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_experts", "top_k", "num_sequences", "seq_len"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"synthetic: {name} must be a positive integer, got {v!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"synthetic: top_k {self.top_k} exceeds num_experts {self.num_experts}")
        if self.seq_len_min is not None and not 1 <= self.seq_len_min <= self.seq_len:
            raise ValueError(f"synthetic: seq_len_min must be in [1, seq_len={self.seq_len}], got {self.seq_len_min}")
        if self.zipf_s < 0:
            raise ValueError(f"synthetic: zipf_s must be >= 0, got {self.zipf_s}")
        for name in ("persistence", "cross_layer"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"synthetic: {name} must be in [0, 1], got {v}")

    @staticmethod
    def with_geometry(name: str, **kw) -> "SyntheticSpec":
        if name not in GEOMETRIES:
            raise ValueError(f"unknown geometry {name!r}; choose one of {', '.join(GEOMETRIES)}")
        L, E, k = GEOMETRIES[name]
        return SyntheticSpec(num_layers=L, num_experts=E, top_k=k, **kw)


def generate(spec: SyntheticSpec) -> Trace:
    rng = np.random.default_rng(spec.seed)
    L, E, k, S, N = spec.num_layers, spec.num_experts, spec.top_k, spec.num_sequences, spec.seq_len
    ranks = np.arange(1, E + 1, dtype=np.float64)
    logp = np.empty((L, E))
    for l in range(L):
        p = ranks ** -spec.zipf_s
        logp[l, rng.permutation(E)] = np.log(p / p.sum())
    path = np.stack([rng.permutation(E) for _ in range(L)])  # path[l][e]: follower at layer l of e at l-1
    ids = np.empty((S, N, L, k), dtype=np.int64)   # ids: [seqs, positions, layers, k]
    wts = np.empty((S, N, L, k), dtype=np.float32)
    rows = np.arange(S)[:, None]
    BIG = 1e6
    for pos in range(N):
        for l in range(L):
            g = logp[l][None, :] + rng.gumbel(size=(S, E))  # g: [seqs, experts]; Gumbel top-k = sampling without replacement
            score = g.copy()
            if pos > 0 and spec.persistence > 0:
                keep = rng.random((S, k)) < spec.persistence
                prev = ids[:, pos - 1, l, :]
                np.add.at(score, (np.broadcast_to(rows, prev.shape)[keep], prev[keep]), BIG)
            if l > 0 and spec.cross_layer > 0:
                follow = rng.random((S, k)) < spec.cross_layer
                nxt = path[l][ids[:, pos, l - 1, :]]
                np.add.at(score, (np.broadcast_to(rows, nxt.shape)[follow], nxt[follow]), BIG)
            top = np.argpartition(-score, k - 1, axis=1)[:, :k]
            ids[:, pos, l, :] = top
            w = np.exp(np.take_along_axis(g, top, axis=1))
            wts[:, pos, l, :] = w / w.sum(1, keepdims=True)
    if spec.seq_len_min is not None:
        lens = rng.integers(spec.seq_len_min, N + 1, size=S)
    else:
        lens = np.full(S, N)
    mask = np.arange(N)[None, :] < lens[:, None]
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    name = (f"synthetic(L={L},E={E},k={k},zipf_s={spec.zipf_s:g},persistence={spec.persistence:g},"
            f"cross_layer={spec.cross_layer:g},seed={spec.seed})")
    dtype = np.uint8 if E <= 256 else np.uint16
    return Trace(ids=ids[mask].astype(dtype), seq_offsets=offsets, num_experts=E, weights=wts[mask],
                 model=name, layer_numbers=np.arange(L), source=name)
