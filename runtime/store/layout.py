"""The on-disk tiered layout: one contiguous blob per expert, a manifest, a checksum per blob.

A store directory holds ``manifest.json`` and one file per MoE layer, ``layer-NNN.bin``, in
which expert e's blob starts at ``e * blob_stride`` (a multiple of 4096, so every blob can be
read with O_DIRECT into an aligned slot). A blob is the expert's tensors (e.g. gate, up, down)
back to back at the offsets the manifest gives, so moving an expert is one copy.
"""
from __future__ import annotations

import json
import os
import zlib
from dataclasses import dataclass, field

import numpy as np
import torch
from cache_policy.jsonfile import read_json

from ..quant import WeightSpec, blob_tensor_specs, encode_expert

FORMAT = "tiered-moe-store"
VERSION = 3   # 2: expert tensors stored input-major; 3: logical weights with a format each (runtime/weight_formats.py)
ALIGN = 4096

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "float8_e4m3fn": getattr(torch, "float8_e4m3fn", None), "uint8": torch.uint8, "int8": torch.int8,
           "int32": torch.int32}


def dtype_name(dt: torch.dtype) -> str:
    for name, d in _DTYPES.items():
        if d == dt:
            return name
    raise ValueError(f"expert tensors of dtype {dt} are not supported; use one of "
                     f"{', '.join(n for n, d in _DTYPES.items() if d is not None)}")


def _align(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple
    dtype: str
    offset: int  # bytes from the blob start

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * _DTYPES[self.dtype].itemsize


@dataclass
class Manifest:
    model: str
    num_layers: int
    num_experts: int
    tensors: list          # [TensorSpec], the same for every expert
    blob_bytes: int
    blob_stride: int
    checksums: list        # [layer][expert] crc32 of the blob's bytes
    layer_numbers: list    # model layer index of each MoE layer
    extra: dict
    weights: list = field(default_factory=list)   # [WeightSpec]: the logical weights the tensors encode

    @property
    def formats(self) -> dict:
        """Logical weight name -> format name (e.g. {"gate": "mxfp4", ...})."""
        return {w.name: w.format for w in self.weights}

    @property
    def expert_format(self) -> str:
        """The format of the expert matrices (the down projection's), e.g. "bf16" or "mxfp4"."""
        return next((w.format for w in self.weights if w.name == "down"), "?")

    @staticmethod
    def layout(specs: "list[tuple[str, tuple, torch.dtype]]") -> "tuple[list, int]":
        """Tensor specs packed back to back, each at a 64-byte aligned offset."""
        out, off = [], 0
        for name, shape, dt in specs:
            ts = TensorSpec(name, tuple(int(s) for s in shape), dtype_name(dt), off)
            out.append(ts)
            off = _align(off + ts.nbytes, 64)
        return out, off

    def layer_file(self, layer: int) -> str:
        return f"layer-{layer:03d}.bin"

    def to_json(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "model": self.model, "num_layers": self.num_layers,
                "num_experts": self.num_experts, "blob_bytes": self.blob_bytes, "blob_stride": self.blob_stride,
                "tensors": [{"name": t.name, "shape": list(t.shape), "dtype": t.dtype, "offset": t.offset}
                            for t in self.tensors],
                "weights": [w.to_json() for w in self.weights],
                "layer_numbers": self.layer_numbers, "checksums": self.checksums, "extra": self.extra}

    @staticmethod
    def current(store_dir: str) -> bool:
        """Whether ``store_dir`` holds a store this version reads (used to rebuild caches)."""
        try:
            with open(os.path.join(store_dir, "manifest.json")) as f:
                d = json.load(f)
        except (OSError, ValueError):
            return False
        return d.get("format") == FORMAT and d.get("version") == VERSION

    @staticmethod
    def read(store_dir: str) -> "Manifest":
        path = os.path.join(store_dir, "manifest.json")
        if not os.path.isdir(store_dir):
            raise ValueError(f"store directory {store_dir!r} does not exist")
        if not os.path.exists(path):
            raise ValueError(f"{store_dir}: not a tiered-moe store (no manifest.json); convert a model first")
        d = read_json(path)
        if d.get("format") != FORMAT:
            raise ValueError(f"{path}: format {d.get('format')!r} is not {FORMAT!r}")
        if d.get("version") != VERSION:
            raise ValueError(f"{path}: store version {d.get('version')!r}, this tiered-moe reads version {VERSION}; "
                             f"convert the model again")
        need = ("model", "num_layers", "num_experts", "blob_bytes", "blob_stride", "tensors", "checksums", "weights")
        missing = [k for k in need if k not in d]
        if missing:
            raise ValueError(f"{path}: manifest lacks {', '.join(missing)}")
        m = Manifest(model=d["model"], num_layers=int(d["num_layers"]), num_experts=int(d["num_experts"]),
                     tensors=[TensorSpec(t["name"], tuple(t["shape"]), t["dtype"], int(t["offset"])) for t in d["tensors"]],
                     blob_bytes=int(d["blob_bytes"]), blob_stride=int(d["blob_stride"]), checksums=d["checksums"],
                     layer_numbers=d.get("layer_numbers", list(range(int(d["num_layers"])))), extra=d.get("extra", {}))
        try:
            m.weights = [WeightSpec.from_json(w) for w in d["weights"]]
            want = {n: (tuple(s), dtype_name(dt)) for n, s, dt in blob_tensor_specs(m.weights)}
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: manifest weights are not readable ({e})") from None
        got = {t.name: (t.shape, t.dtype) for t in m.tensors}
        if got != want:
            raise ValueError(f"{path}: the blob's tensors {got} do not encode its weights (expected {want})")
        # each tensor inside the blob and none over another: a negative or overlapping offset would serve other
        # bytes than the tensor's, under checksums that pass (they cover the blob, not the table)
        prev = None
        for t in sorted(m.tensors, key=lambda t: t.offset):
            if t.offset < 0:
                raise ValueError(f"{path}: tensor {t.name!r} has a negative offset ({t.offset})")
            if prev is not None and t.offset < prev.offset + prev.nbytes:
                raise ValueError(f"{path}: tensor {t.name!r} at offset {t.offset} overlaps {prev.name!r} "
                                 f"(bytes {prev.offset}..{prev.offset + prev.nbytes})")
            prev = t
        end = max((t.offset + t.nbytes for t in m.tensors), default=0)
        if end > m.blob_bytes or m.blob_bytes > m.blob_stride:
            raise ValueError(f"{path}: a tensor ends at byte {end} of a {m.blob_bytes}-byte blob (stride {m.blob_stride}): "
                             f"offsets outside the blob")
        if len(m.checksums) != m.num_layers or any(len(c) != m.num_experts for c in m.checksums):
            raise ValueError(f"{path}: checksums do not cover {m.num_layers} layers x {m.num_experts} experts")
        for layer in range(m.num_layers):
            f = os.path.join(store_dir, m.layer_file(layer))
            if not os.path.exists(f):
                raise ValueError(f"{store_dir}: expert file {m.layer_file(layer)} of layer {layer} is missing")
            size = os.path.getsize(f)
            if size < m.num_experts * m.blob_stride:
                raise ValueError(f"{f}: {size} bytes, expected {m.num_experts * m.blob_stride} "
                                 f"({m.num_experts} experts x {m.blob_stride}): truncated")
        return m


class StoreWriter:
    """Writes a store expert by expert, never holding more than one blob in memory."""

    def __init__(self, store_dir: str, *, model: str, num_layers: int, num_experts: int,
                 weights: list, layer_numbers=None, extra=None) -> None:
        os.makedirs(store_dir, exist_ok=True)
        tensors, blob = Manifest.layout(blob_tensor_specs(weights))
        self.dir = store_dir
        self.m = Manifest(model=model, num_layers=num_layers, num_experts=num_experts, tensors=tensors,
                          blob_bytes=blob, blob_stride=_align(blob), checksums=[[None] * num_experts for _ in range(num_layers)],
                          layer_numbers=list(layer_numbers if layer_numbers is not None else range(num_layers)),
                          extra=extra or {}, weights=list(weights))
        self._files = {}

    def write(self, layer: int, expert: int, weights: dict) -> None:
        """weights: logical weight name -> float tensor ([out, in], quantized here to its format) or
        {part suffix: tensor} already in its format (bytes as shipped)."""
        m = self.m
        try:
            tensors = encode_expert(m.weights, weights)
        except (KeyError, ValueError) as e:
            raise ValueError(f"layer {layer} expert {expert}: {e}") from None
        buf = bytearray(m.blob_stride)
        for ts in m.tensors:
            if ts.name not in tensors:
                raise ValueError(f"layer {layer} expert {expert}: tensor {ts.name!r} missing")
            t = tensors[ts.name]
            if tuple(t.shape) != ts.shape or dtype_name(t.dtype) != ts.dtype:
                raise ValueError(f"layer {layer} expert {expert}: tensor {ts.name!r} is {tuple(t.shape)} {t.dtype}, "
                                 f"expected {ts.shape} {ts.dtype}")
            raw = t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()
            buf[ts.offset:ts.offset + len(raw)] = raw
        if layer not in self._files:
            f = open(os.path.join(self.dir, m.layer_file(layer)), "wb")
            f.truncate(m.num_experts * m.blob_stride)
            self._files[layer] = f
        f = self._files[layer]
        f.seek(expert * m.blob_stride)
        f.write(buf)
        m.checksums[layer][expert] = zlib.crc32(memoryview(buf)[: m.blob_bytes])

    def close(self) -> Manifest:
        for f in self._files.values():
            f.close()
        missing = [(l, e) for l in range(self.m.num_layers) for e in range(self.m.num_experts)
                   if self.m.checksums[l][e] is None]
        if missing:
            raise ValueError(f"store {self.dir}: {len(missing)} experts were never written (first: layer "
                             f"{missing[0][0]} expert {missing[0][1]})")
        tmp = os.path.join(self.dir, "manifest.json.tmp")
        with open(tmp, "w") as f:
            json.dump(self.m.to_json(), f)
        os.replace(tmp, os.path.join(self.dir, "manifest.json"))
        return self.m
