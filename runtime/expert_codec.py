"""One expert blob: its logical weights (``WeightSpec``, the formats of runtime/weight_formats.py), how to
encode them, and ``ExpertCodec``, which turns a stored blob into the float operands the expert
matmuls read (views for float stores, dequantized into a reused scratch for quantized ones)."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from .weight_formats import WeightFormat, _Lut16, dense_format_of, get_format

# -- one expert: its logical weights and how the model gets float operands from a blob ------------
@dataclass(frozen=True)
class WeightSpec:
    """One logical weight of an expert blob: name (gate_up, gate, up, down, gate_up_bias, down_bias),
    Hugging Face shape [out, in] (or [n] for a bias), and its format."""
    name: str
    shape: tuple
    format: str
    params: dict = field(default_factory=dict)

    @property
    def fmt(self) -> WeightFormat:
        return get_format(self.format, **self.params)

    def to_json(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "format": self.format, "params": dict(self.params)}

    @staticmethod
    def from_json(d: dict) -> "WeightSpec":
        return WeightSpec(d["name"], tuple(int(x) for x in d["shape"]), d["format"], dict(d.get("params") or {}))


def expert_weight_specs(H: int, I: int, fmt: WeightFormat, bias_dtype: "torch.dtype | None" = None,
                        gated: bool = True) -> list:
    """The logical weights of one SwiGLU expert (gate and up [I, H], down [H, I]). Dense experts
    keep gate and up fused ([2I, H]: one matmul); quantized ones keep them apart, since a scale
    tile must not straddle them (fp8's 128-row tiles) - they are dequantized into the two halves
    of one scratch, so the matmul is still one. ``gated`` False (Nemotron-H's relu^2 experts): up and
    down only, in any format."""
    p = fmt.params()
    if not gated:
        if bias_dtype is not None:
            raise ValueError("expert biases are read for gated experts only (gpt-oss's gate_up / down biases)")
        out = [WeightSpec("up", (I, H), fmt.name, p), WeightSpec("down", (H, I), fmt.name, p)]
    elif fmt.quantized:
        out = [WeightSpec("gate", (I, H), fmt.name, p), WeightSpec("up", (I, H), fmt.name, p),
               WeightSpec("down", (H, I), fmt.name, p)]
    else:
        out = [WeightSpec("gate_up", (2 * I, H), fmt.name, p), WeightSpec("down", (H, I), fmt.name, p)]
    if bias_dtype is not None:
        b = dense_format_of(bias_dtype).name
        out += [WeightSpec("gate_up_bias", (2 * I,), b), WeightSpec("down_bias", (H,), b)]
    for w in out:
        try:
            w.fmt.parts(w.shape)
        except ValueError as e:
            raise ValueError(f"expert weight {w.name} {tuple(w.shape)} cannot be stored as {w.format}: {e}") from None
    return out


def blob_tensor_specs(weights: list) -> list:
    """The store's raw tensors for these logical weights: (name.suffix, shape, dtype)."""
    return [(f"{w.name}.{p.suffix}", p.shape, p.dtype) for w in weights for p in w.fmt.parts(w.shape)]


def encode_expert(weights: list, tensors: dict) -> dict:
    """Logical float tensors (gate/up/down [out, in], biases) -> the blob's raw tensors; tensors
    already in a spec's format may be given as {suffix: part} dicts (bytes as shipped)."""
    out = {}
    for w in weights:
        t = tensors.get(w.name)
        if t is None:
            raise ValueError(f"weight {w.name!r} is missing")
        fmt = w.fmt
        parts = t if isinstance(t, dict) else fmt.quantize(t)
        fmt.check(w.name, w.shape, parts)
        out.update({f"{w.name}.{k}": v for k, v in parts.items()})
    return out


@dataclass
class ExpertWeights:
    """Float operands of one expert for ``x @ w``: gate_up_t [in, 2I] (gate | up; an ungated expert's: up alone,
    [in, I]), down_t [I, out]."""
    gate_up_t: torch.Tensor
    down_t: torch.Tensor
    gate_up_bias: "torch.Tensor | None" = None
    down_bias: "torch.Tensor | None" = None


class ExpertCodec:
    """Turns a blob's tensor views into ``ExpertWeights``. Float blobs are the operands (views, no
    copy); quantized ones are dequantized into scratch buffers owned here and reused for every
    expert (the model computes one expert at a time), so no call allocates a weight-sized tensor.
    Dequantization runs in float32 (one rounding, as the formats define it).

    ``compute_dtype``: the dtype of the expert matmuls. Default: the model's dtype on a GPU; on a
    CPU float32 whenever the blob is quantized or half precision - CPUs without bf16 matrix units
    run a [1, 512] x [512, 1024] bf16 matmul ~20x slower than the float32 one (1.5 ms vs 66 us on
    this project's machines), so half-precision experts are widened into the scratch instead."""

    def __init__(self, weights: list, dtype: torch.dtype, device, compute_dtype: "torch.dtype | None" = None,
                 cache_bytes: int = 0) -> None:
        self.specs = {w.name: w for w in weights}
        self.dtype, self.device = dtype, torch.device(device)
        self.fmts = {w.name: w.fmt for w in weights}
        self._keys = {w.name: [(p.suffix, f"{w.name}.{p.suffix}") for p in w.fmt.parts(w.shape)] for w in weights}
        self.quantized = any(f.quantized for f in self.fmts.values())
        self.fused = "gate_up" in self.specs
        # an ungated expert (Nemotron-H's relu^2): up and down only; its operand is up's rows where gate | up's are
        self.gated = self.fused or "gate" in self.specs
        if not self.fused and "up" not in self.specs:
            raise ValueError(f"expert blob has weights {sorted(self.specs)}: expected gate_up, gate + up or up, and down")
        if "down" not in self.specs:
            raise ValueError(f"expert blob has weights {sorted(self.specs)}: no down projection")
        H_out, I = self.specs["down"].shape
        H_in = self.specs["gate_up" if self.fused else "up"].shape[1]
        self.shapes = (H_in, I, H_out)
        R = self.rows = 2 * I if self.gated else I                      # rows of the [gate |] up operand
        half = any(not f.quantized and f.dtype in (torch.bfloat16, torch.float16) for f in self.fmts.values())
        if compute_dtype is None:
            compute_dtype = torch.float32 if self.device.type == "cpu" and (self.quantized or half) else dtype
        self.compute_dtype = compute_dtype
        self.widen = not self.quantized and compute_dtype != self.fmts["down"].dtype
        self._idx = None
        f32 = dict(dtype=torch.float32, device=self.device)
        if self.quantized:
            self._gu = torch.empty(R, H_in, **f32)                       # [2I, in]: gate rows | up rows (or up's)
            self._dn = torch.empty(H_out, I, **f32)
            same = compute_dtype == torch.float32
            self._gu_c = self._gu if same else torch.empty(R, H_in, dtype=compute_dtype, device=self.device)
            self._dn_c = self._dn if same else torch.empty(H_out, I, dtype=compute_dtype, device=self.device)
            self._idx = torch.empty(max(R * H_in, H_out * I) // 2, dtype=torch.int32, device=self.device)
        elif self.widen:   # input-major like the blob: one contiguous copy each
            self._gu_c = torch.empty(H_in, R, dtype=compute_dtype, device=self.device)
            self._dn_c = torch.empty(I, H_out, dtype=compute_dtype, device=self.device)
        # Converted operands kept per expert key, least recently used dropped first: widening a bf16
        # expert costs as much as its matmuls at decode's few tokens (a third of a CPU decode step),
        # and experts are read-only, so one conversion serves every later step. Only results that
        # are not views of the blob are kept (a float blob in the compute dtype needs no copy).
        self.cache_bytes = int(cache_bytes) if (self.quantized or self.widen) else 0
        self._cache: "OrderedDict" = OrderedDict()
        self.cached_bytes = 0

    @property
    def operand_bytes(self) -> int:
        """Bytes of one expert's float operands in the compute dtype (one cache entry)."""
        H_in, I, H_out = self.shapes
        n = self.rows * H_in + I * H_out + (2 * I + H_out if "down_bias" in self.specs else 0)
        return n * self.compute_dtype.itemsize

    @property
    def scratch_bytes(self) -> int:
        ts = {id(t): t for t in (getattr(self, n, None) for n in ("_gu", "_dn", "_gu_c", "_dn_c", "_idx")) if t is not None}
        return sum(t.numel() * t.element_size() for t in ts.values())

    def _deq(self, name: str, views: dict, out: torch.Tensor) -> None:
        fmt = self.fmts[name]
        parts = {suffix: views[key] for suffix, key in self._keys[name]}
        if isinstance(fmt, _Lut16) and self._idx is not None:
            fmt.dequantize(parts, out, self._idx)
        else:
            fmt.dequantize(parts, out)

    def weights(self, views: dict, key=None) -> ExpertWeights:
        """views: the blob's raw tensors by name (``name.suffix``), as the store returns them.
        ``key``: the expert's identity (e.g. (layer, expert)); with a cache budget, its converted
        operands are kept and later calls with the key skip the conversion. Without a key the
        result lives in scratch reused by the next call."""
        if key is not None and self.cache_bytes:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
            return self._keep(key, self._convert(views))
        return self._convert(views)

    def _keep(self, key, t: ExpertWeights) -> ExpertWeights:
        """Copy scratch results ``t`` into the cache under ``key``; the least recently used entry
        makes room, its buffers reused (no allocation per miss once the cache is full)."""
        size = self.operand_bytes
        if size > self.cache_bytes:
            return t
        buf = None
        while self.cached_bytes + size > self.cache_bytes:
            _, buf = self._cache.popitem(last=False)
            self.cached_bytes -= size
        if buf is None:
            own = [None if x is None else torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)
                   for x in (t.gate_up_t, t.down_t, t.gate_up_bias, t.down_bias)]
            buf = ExpertWeights(*own)
        for dst, src in ((buf.gate_up_t, t.gate_up_t), (buf.down_t, t.down_t), (buf.gate_up_bias, t.gate_up_bias),
                         (buf.down_bias, t.down_bias)):
            if dst is not None:
                dst.copy_(src)
        self._cache[key] = buf
        self.cached_bytes += size
        return buf

    def drop(self, key=None) -> None:
        """Forget the cached operands of ``key`` (None: of every expert)."""
        if key is None:
            self._cache.clear()
            self.cached_bytes = 0
        elif self._cache.pop(key, None) is not None:
            self.cached_bytes -= self.operand_bytes

    def _convert(self, views: dict) -> ExpertWeights:
        cd = self.compute_dtype
        bias = tuple(None if b is None else b.to(cd) for b in (views.get("gate_up_bias.t"), views.get("down_bias.t")))
        gu = "gate_up.t" if self.gated else "up.t"
        if not self.quantized:
            if not self.widen:
                return ExpertWeights(views[gu], views["down.t"], *bias)
            self._gu_c.copy_(views[gu])
            self._dn_c.copy_(views["down.t"])
            return ExpertWeights(self._gu_c, self._dn_c, *bias)
        I = self.shapes[1]
        if self.fused:
            self._deq("gate_up", views, self._gu)
        elif not self.gated:
            self._deq("up", views, self._gu)
        else:
            self._deq("gate", views, self._gu[:I])
            self._deq("up", views, self._gu[I:])
        self._deq("down", views, self._dn)
        if self._gu_c is not self._gu:
            self._gu_c.copy_(self._gu)
            self._dn_c.copy_(self._dn)
        return ExpertWeights(self._gu_c.t(), self._dn_c.t(), *bias)

    def dequantize_all(self, views: dict) -> dict:
        """Float [out, in] copies of every logical weight (conversion reports, tests)."""
        out = {}
        for name, spec in self.specs.items():
            buf = torch.empty(spec.shape, dtype=torch.float32, device=self.device)
            self._deq(name, views, buf)
            out[name] = buf
        return out
