"""A tensor-parallel rank's slice of every expert, as the store holds it: which rank (``Shard``), the
rank's logical weights (``expert_weights``), the cut of one expert's bytes (``slice_expert``) and the
manifest a rank's slices follow (``rank_manifest``).

Experts split along the intermediate axis: gate and up by rows, down by the same columns, so a rank's
expert computes a partial sum of the whole expert's output (runtime/parallel/shard.py describes the whole
split). Quantized experts split on their block boundaries (``WeightFormat.slice_parts``); a split that
would cut a scale block or a packed word is refused with the numbers that cut it.

Part of the store (the store reads whole blobs from disk and cuts them per rank) and imported by
runtime/parallel/shard.py, which plans the rest of a rank's split, in that direction.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..expert_codec import WeightSpec, blob_tensor_specs
from .layout import ALIGN, Manifest, _align


@dataclass(frozen=True)
class Shard:
    """Rank ``rank`` of ``world`` tensor-parallel ranks."""
    rank: int = 0
    world: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.world, int) or self.world < 1:
            raise ValueError(f"tensor-parallel size must be a positive integer, got {self.world!r}")
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} is outside 0..{self.world - 1}")

    def part(self, n: int) -> tuple:
        """(start, stop) of this rank's equal part of n (n must divide)."""
        k = n // self.world
        return self.rank * k, (self.rank + 1) * k


def expert_weights(weights: list, inter: int, shard: Shard) -> list:
    """The rank's logical expert weights (``WeightSpec``) for a store's ``weights``; ValueError naming
    a weight whose format would be cut inside a block."""
    if inter % shard.world:
        raise ValueError(f"the expert intermediate size {inter} does not split over {shard.world} ranks")
    out = []
    for w in weights:
        shape = _local_shape(w, inter, shard.world)
        spec = WeightSpec(w.name, shape, w.format, dict(w.params))
        _slice(w, _meta_parts(w), shard, inter)           # raises where a block would be cut
        out.append(spec)
    return out


def _local_shape(w: WeightSpec, inter: int, N: int) -> tuple:
    s = tuple(w.shape)
    if w.name in ("gate", "up"):
        return (s[0] // N, s[1])
    if w.name == "down":
        return (s[0], s[1] // N)
    if w.name in ("gate_up", "gate_up_bias"):
        return (s[0] // N,) + s[1:]
    return s                                               # down_bias: whole (rank 0's, zeros elsewhere)


def _meta_parts(w: WeightSpec) -> dict:
    return {p.suffix: torch.empty(p.shape, dtype=p.dtype, device="meta") for p in w.fmt.parts(w.shape)}


def _slice(w: WeightSpec, parts: dict, shard: Shard, inter: int) -> dict:
    fmt, (a, b) = w.fmt, shard.part(inter)
    try:
        if w.name in ("gate", "up"):
            return fmt.slice_parts(w.shape, parts, rows=[(a, b)])
        if w.name == "down":
            return fmt.slice_parts(w.shape, parts, cols=(a, b))
        if w.name in ("gate_up", "gate_up_bias"):      # [gate | up]: the rank's rows of each half, gate first
            return fmt.slice_parts(w.shape, parts, rows=[(a, b), (inter + a, inter + b)])
    except ValueError as e:
        raise ValueError(f"expert weight {w.name} {tuple(w.shape)} ({w.format}) cannot split over {shard.world} "
                         f"tensor-parallel ranks: {e}") from None
    if w.name == "down_bias":
        return parts if shard.rank == 0 else {k: torch.zeros_like(v) for k, v in parts.items()}
    raise ValueError(f"expert weight {w.name!r} has no tensor-parallel split")


def slice_expert(weights: list, views: dict, inter: int, shard: Shard) -> dict:
    """One expert's blob views (``name.suffix`` -> tensor, the whole expert) -> the rank's raw tensors."""
    out = {}
    for w in weights:
        parts = {p.suffix: views[f"{w.name}.{p.suffix}"] for p in w.fmt.parts(w.shape)}
        out.update({f"{w.name}.{k}": v for k, v in _slice(w, parts, shard, inter).items()})
    return out


def rank_bytes_fraction(weights: list, local: list) -> float:
    """Bytes of a rank's slice / bytes of the whole expert."""
    whole = sum(w.fmt.nbytes(w.shape) for w in weights)
    return sum(w.fmt.nbytes(w.shape) for w in local) / whole if whole else 0.0


def rank_manifest(m, shard: Shard):
    """A store's manifest (runtime/store/layout.py) -> the one a rank's slices follow: the rank's logical
    weights, their tensors back to back, the slice's bytes and a 4 KiB-aligned stride (the same for every
    rank: the split is even). Checksums stay the whole blobs' (what the disk holds)."""
    inter = next(w.shape[1] for w in m.weights if w.name == "down")
    local = expert_weights(m.weights, inter, shard)
    tensors, nbytes = Manifest.layout(blob_tensor_specs(local))
    return Manifest(model=m.model, num_layers=m.num_layers, num_experts=m.num_experts, tensors=tensors,
                    blob_bytes=nbytes, blob_stride=_align(nbytes, ALIGN), checksums=m.checksums,
                    layer_numbers=m.layer_numbers, extra=dict(m.extra), weights=local)
