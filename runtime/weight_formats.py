"""Expert weight formats: one registry of the dense and quantized formats an expert blob can hold.

Every format describes one logical weight matrix of Hugging Face orientation ``[out, in]`` as the
*parts* stored back to back in the blob (``Part``), how to make them from a float matrix
(``quantize``), and how to turn them back into a float ``[in, out]`` operand for ``x @ w``
(``weight_t``). Quantized formats are dequantized on use into a caller-owned scratch buffer, so
the bytes that sit in the tiers and cross the host->device link are the quantized bytes.

Formats (the definitions the tests re-implement independently):

- ``fp32`` / ``bf16`` / ``fp16``: stored input-major ``[in, out]`` (``x @ w`` over it runs faster
  than ``F.linear`` on CPU at decode's few tokens per expert) - no dequantization, the blob is
  the operand.
- ``mxfp4`` (OCP Microscaling v1.0, as gpt-oss ships it): FP4 E2M1 elements, two per byte, the
  element with the lower index in the low nibble; one E8M0 scale byte per 32 consecutive
  elements of a row (value = 2^(s - 127)). 4.25 bits per parameter.
- ``int4`` (compressed-tensors ``pack-quantized``, symmetric, ``group`` elements per scale, as
  Kimi K2 ships it): q in [-8, 7] stored as q + 8, eight per little-endian int32 with element i
  at bits 4i..4i+3; w = q * scale. With group 32 and bf16 scales: 4.5 bits per parameter.
- ``int8`` (llama.cpp's Q8_0 layout as a format of ours): symmetric, ``group`` elements per scale,
  q in [-127, 127] stored as int8, row-major ``[out, in]``; w = q * scale. With group 32 and
  float16 scales: 8.5 bits per parameter. Also what ``--dense-quant int8`` makes of non-expert
  weights (runtime/model/layers/dense.py).
- ``fp8_e4m3`` (DeepSeek-V3's ``weight_scale_inv``): FP8 E4M3 elements and one float32 scale per
  ``block = (rows, cols)`` tile (128 x 128 in DeepSeek-V3; ``(1, in)`` is per output channel);
  w = fp8 * scale.

Rounding of ``quantize`` (``convert --quantize``):
- mxfp4: scale exponent floor(log2(amax of the block)) - 2 (OCP MX v1.0 section 6.3: the largest
  E2M1 exponent is 2), elements rounded to the nearest E2M1 value, ties to the even code,
  saturated at +-6.
- int4: scale = amax of the group / 7 (no clipping), q = round-half-even(w / scale).
- int8: scale = amax of the group / 127 (rounded to the scale dtype), q = round-half-even(w / scale)
  clamped to +-127.
- fp8_e4m3: scale = amax of the tile / 448, elements cast to E4M3 (round to nearest even).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from cache_policy import cost_model as cm

FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
FLOAT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SCALE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Part:
    suffix: str
    shape: tuple
    dtype: torch.dtype


class WeightFormat:
    """Base of the registry's entries. ``params()`` is what the manifest records besides the name."""

    name = "?"
    quantized = True

    def params(self) -> dict:
        return {}

    def parts(self, shape: tuple) -> list:
        raise NotImplementedError

    def quantize(self, w: torch.Tensor) -> dict:
        raise NotImplementedError

    def dequantize(self, parts: dict, out: torch.Tensor) -> torch.Tensor:
        """parts -> out ([out, in], float32), in place."""
        raise NotImplementedError

    def nbytes(self, shape: tuple) -> int:
        return sum(math.prod(p.shape) * p.dtype.itemsize for p in self.parts(shape))

    def bits_per_param(self, shape: tuple) -> float:
        return 8 * self.nbytes(shape) / math.prod(shape)

    def check(self, name: str, shape: tuple, parts: dict) -> None:
        """Shapes and dtypes of ``parts`` against this format's definition; the error names the tensor."""
        for p in self.parts(shape):
            t = parts.get(p.suffix)
            if t is None:
                raise ValueError(f"{name}: {self.name} part {p.suffix!r} is missing")
            if tuple(t.shape) != tuple(p.shape) or t.dtype != p.dtype:
                raise ValueError(f"{name}: {self.name} part {p.suffix!r} is {tuple(t.shape)} {t.dtype}, expected "
                                 f"{tuple(p.shape)} {p.dtype} for a {tuple(shape)} weight{self._hint()}")

    def _hint(self) -> str:
        return ""

    def axes(self, shape: tuple) -> dict:
        """How each part's dimensions map to the logical [out, in] weight: suffix -> (out axis, logical
        rows per index, in axis or None, logical columns per index). Tensor parallelism slices a
        weight through this (``slice_parts``): a part is cut only on whole indices - a scale block
        or a packed word never straddles two ranks."""
        raise NotImplementedError

    def slice_parts(self, shape: tuple, parts: dict, rows: "list | None" = None,
                    cols: "tuple | None" = None) -> dict:
        """The parts of the sub-weight made of the logical ``rows`` (a list of (a, b) ranges, kept in that
        order) and ``cols`` ((a, b)) of a ``shape`` weight; ValueError where a range cuts a block."""
        O = shape[0]
        I = shape[1] if len(shape) == 2 else None
        out = {}
        for suffix, (oa, ou, ia, iu) in self.axes(shape).items():
            t = parts[suffix]
            if rows is not None:
                t = torch.cat([t.narrow(oa, *_cut(a, b, O, ou, f"rows {a}:{b}", self, shape)) for a, b in rows], oa)
            if cols is not None:
                if ia is None:
                    raise ValueError(f"a {tuple(shape)} weight has no input axis to split")
                t = t.narrow(ia, *_cut(cols[0], cols[1], I, iu, f"columns {cols[0]}:{cols[1]}", self, shape))
            out[suffix] = t
        return out


def _cut(a: int, b: int, n: int, unit: int, what: str, fmt: "WeightFormat", shape: tuple) -> tuple:
    """(start, length) in part indices of the logical range a:b of an axis of n with ``unit`` logical
    elements per index; the range must start on a unit and end on one (or at the axis's end)."""
    if a % unit or (b % unit and b != n):
        raise ValueError(f"{fmt.name}{fmt._hint()}: {what} of a {tuple(shape)} weight cut its blocks of {unit} "
                         f"elements")
    return a // unit, -(-b // unit) - a // unit


class Dense(WeightFormat):
    quantized = False

    def __init__(self, name: str) -> None:
        self.name, self.dtype = name, FLOAT_DTYPES[name]

    def parts(self, shape):
        # 2-D weights input-major ([in, out]); 1-D (biases) as they are.
        return [Part("t", tuple(reversed(shape)) if len(shape) == 2 else tuple(shape), self.dtype)]

    def quantize(self, w):
        return {"t": (w.t() if w.dim() == 2 else w).contiguous().to(self.dtype)}

    def dequantize(self, parts, out):
        t = parts["t"]
        out.copy_(t.t() if t.dim() == 2 else t)
        return out

    def axes(self, shape):
        return {"t": (1, 1, 0, 1) if len(shape) == 2 else (0, 1, None, 1)}


def _split_cols(shape: tuple, group: int, what: str) -> None:
    if len(shape) != 2 or shape[1] % group:
        raise ValueError(f"{what} needs a 2-D weight whose input size is a multiple of {group}, got {tuple(shape)}")


class _Lut16(WeightFormat):
    """Formats whose elements are decoded by table: the stored codes are read two bytes at a time
    (a uint16) and looked up in a 65536-row table of the 2 (8-bit codes) or 4 (4-bit codes) float32
    values those bytes hold, written straight into the scratch in element order; then one
    multiply by the scales. On CPU a gather costs per row, not per byte, so 16-bit rows halve
    the cost of byte rows (bench/results/quantized.md); on a GPU it is one kernel."""

    per16 = 4            # elements per uint16 of codes

    def __init__(self) -> None:
        self.table = self._make_table()                                  # table: [65536, per16] float32
        self._on: dict = {}
        self._np = None

    def _make_table(self) -> torch.Tensor:
        raise NotImplementedError

    def _table(self, device) -> torch.Tensor:
        t = self._on.get(device)
        if t is None:
            t = self._on[device] = self.table.to(device)
        return t

    def codes(self, parts: dict) -> torch.Tensor:
        raise NotImplementedError

    def apply_scales(self, parts: dict, out: torch.Tensor) -> None:
        raise NotImplementedError

    def dequantize(self, parts, out, idx: "torch.Tensor | None" = None):
        codes = self.codes(parts)
        if out.device.type == "cpu" and out.is_contiguous() and codes.is_contiguous():
            # numpy's take gathers 16-byte rows ~2x faster than torch's index_select on CPU
            # (202 vs 377 us for 2^18 elements, 1 thread) and indexes by uint16 directly.
            if self._np is None:
                self._np = self.table.numpy()
            np.take(self._np, codes.numpy().reshape(-1).view(np.uint16), axis=0, out=out.numpy().reshape(-1, self.per16))
            self.apply_scales(parts, out)
            return out
        c16 = codes.reshape(-1).view(torch.int16)                        # c16: [O*I/per16]
        n = c16.numel()
        idx = torch.empty(n, dtype=torch.int32, device=out.device) if idx is None or idx.numel() < n else idx[:n]
        idx.copy_(c16)
        idx.bitwise_and_(0xFFFF)                                         # int16 is signed: back to 0..65535
        torch.index_select(self._table(out.device), 0, idx, out=out.view(-1, self.per16))
        self.apply_scales(parts, out)
        return out


class _Nibbles(_Lut16):
    """Two 4-bit codes per byte, the lower-index element in the low nibble; one scale per
    ``group`` elements of a row."""

    group = 32
    values: tuple = ()   # the 16 codes' values

    def _make_table(self):
        v = torch.tensor(self.values, dtype=torch.float32)
        u = torch.arange(65536)
        return torch.stack([v[(u >> s) & 15] for s in (0, 4, 8, 12)], 1)   # little-endian byte order

    def scales(self, parts: dict) -> torch.Tensor:
        raise NotImplementedError

    def apply_scales(self, parts, out):
        O, I = out.shape
        out.view(O, I // self.group, self.group).mul_(self.scales(parts).unsqueeze(-1))

    @staticmethod
    def pack(codes: torch.Tensor) -> torch.Tensor:
        """codes: [O, I] in 0..15 -> [O, I/2] uint8, element 2j in the low nibble of byte j."""
        c = codes.to(torch.uint8)
        return c[:, 0::2] | (c[:, 1::2] << 4)


class MXFP4(_Nibbles):
    name = "mxfp4"
    values = FP4_E2M1

    def parts(self, shape):
        _split_cols(shape, 32, "mxfp4")
        O, I = shape
        return [Part("blocks", (O, I // 2), torch.uint8), Part("scales", (O, I // 32), torch.uint8)]

    def codes(self, parts):
        return parts["blocks"]

    def axes(self, shape):
        return {"blocks": (0, 1, 1, 2), "scales": (0, 1, 1, 32)}

    # E8M0 byte -> 2^(s - 127) (s = 0: 2^-127, a float32 subnormal; s = 255: NaN), by table.
    E8M0 = torch.tensor([2.0 ** (i - 127) for i in range(255)] + [float("nan")], dtype=torch.float64).float()

    def scales(self, parts):
        s = parts["scales"]
        t = self._on.get(("e8m0", s.device))
        if t is None:
            t = self._on[("e8m0", s.device)] = self.E8M0.to(s.device)
        return t[s.long()]

    def quantize(self, w):
        O, I = w.shape
        g = w.float().reshape(O, I // 32, 32)
        amax = g.abs().amax(-1)                                          # amax: [O, I/32]
        e = torch.floor(torch.log2(amax.clamp_min(2.0 ** -127))) - 2
        e = e.clamp(-127, 127)
        x = g / torch.exp2(e).unsqueeze(-1)                              # in [-8, 8): exact (power of 2)
        a = x.abs().contiguous()
        mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])          # halfway between E2M1 magnitudes
        code = torch.searchsorted(mids, a)                               # nearest; exactly halfway -> the lower code
        at_mid = a == mids[code.clamp(max=6)]
        code = code + (at_mid & (code % 2 == 1)).long()                  # ties -> the even code
        code = code + 8 * (x < 0)                                        # sign bit 3
        return {"blocks": self.pack(code.reshape(O, I)), "scales": (e + 127).to(torch.uint8)}


def _group_scales(fmt: str, group: int, scale_dtype: str) -> tuple:
    """(group, scale dtype) of a group-scaled integer format, checked."""
    if group < 8 or group % 8:
        raise ValueError(f"{fmt} group size must be a positive multiple of 8, got {group}")
    if scale_dtype not in SCALE_DTYPES:
        raise ValueError(f"{fmt} scale dtype {scale_dtype!r} is not supported; use one of {', '.join(SCALE_DTYPES)}")
    return int(group), scale_dtype


class INT4(_Nibbles):
    name = "int4"
    values = tuple(float(v - 8) for v in range(16))

    def __init__(self, group: int = 32, scale_dtype: str = "bfloat16") -> None:
        self.group, self.scale_dtype = _group_scales(self.name, group, scale_dtype)
        super().__init__()

    def params(self):
        return {"group": self.group, "scale_dtype": self.scale_dtype}

    def parts(self, shape):
        _split_cols(shape, self.group, f"int4 with group {self.group}")
        O, I = shape
        return [Part("packed", (O, I // 8), torch.int32), Part("scale", (O, I // self.group), SCALE_DTYPES[self.scale_dtype])]

    def axes(self, shape):
        return {"packed": (0, 1, 1, 8), "scale": (0, 1, 1, self.group)}

    def codes(self, parts):
        # The int32 words' bytes in memory order (little-endian): nibble i of a word is element i.
        return parts["packed"].view(torch.uint8)

    def scales(self, parts):
        return parts["scale"].float()

    def quantize(self, w):
        O, I = w.shape
        g = w.float().reshape(O, I // self.group, self.group)
        scale = (g.abs().amax(-1) / 7).to(SCALE_DTYPES[self.scale_dtype])   # rounded once, used as stored
        s = scale.float().unsqueeze(-1)
        q = torch.where(s > 0, torch.round(g / torch.where(s > 0, s, 1.0)), 0.0).clamp(-8, 7)
        packed = self.pack((q + 8).reshape(O, I)).view(torch.int32)        # [O, I/8]
        return {"packed": packed, "scale": scale}

    def _hint(self):
        return f" (int4, group {self.group}, {self.scale_dtype} scales)"


class INT8(WeightFormat):
    name = "int8"

    def __init__(self, group: int = 32, scale_dtype: str = "float16") -> None:
        self.group, self.scale_dtype = _group_scales(self.name, group, scale_dtype)

    def params(self):
        return {"group": self.group, "scale_dtype": self.scale_dtype}

    def parts(self, shape):
        _split_cols(shape, self.group, f"int8 with group {self.group}")
        O, I = shape
        return [Part("weight", (O, I), torch.int8), Part("scale", (O, I // self.group), SCALE_DTYPES[self.scale_dtype])]

    def quantize(self, w):
        O, I = w.shape
        g = w.float().reshape(O, I // self.group, self.group)
        scale = (g.abs().amax(-1) / 127).to(SCALE_DTYPES[self.scale_dtype])   # rounded once, used as stored
        s = scale.float().unsqueeze(-1)
        q = torch.where(s > 0, torch.round(g / torch.where(s > 0, s, 1.0)), 0.0).clamp(-127, 127)
        return {"weight": q.reshape(O, I).to(torch.int8), "scale": scale}

    def axes(self, shape):
        return {"weight": (0, 1, 1, 1), "scale": (0, 1, 1, self.group)}

    def dequantize(self, parts, out):
        O, I = out.shape
        out.copy_(parts["weight"])
        out.view(O, I // self.group, self.group).mul_(parts["scale"].float().unsqueeze(-1))
        return out

    def _hint(self):
        return f" (int8, group {self.group}, {self.scale_dtype} scales)"


class FP8(_Lut16):
    name = "fp8_e4m3"
    per16 = 2

    def __init__(self, block=(128, 128)) -> None:
        b = tuple(int(x) for x in block)
        if len(b) != 2 or min(b) < 1:
            raise ValueError(f"fp8_e4m3 block must be two positive sizes (rows, cols), got {block!r}")
        self.block = b
        super().__init__()

    def _make_table(self):
        v = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
        u = torch.arange(65536)
        return torch.stack([v[u & 255], v[u >> 8]], 1)

    def params(self):
        return {"block": list(self.block)}

    def parts(self, shape):
        if len(shape) != 2:
            raise ValueError(f"fp8_e4m3 needs a 2-D weight, got {tuple(shape)}")
        O, I = shape
        bo, bi = self.block
        return [Part("weight", (O, I), torch.float8_e4m3fn), Part("scale_inv", (-(-O // bo), -(-I // bi)), torch.float32)]

    def codes(self, parts):
        return parts["weight"].view(torch.uint8)

    def axes(self, shape):
        return {"weight": (0, 1, 1, 1), "scale_inv": (0, self.block[0], 1, self.block[1])}

    def _expand(self, s: torch.Tensor, O: int, I: int) -> torch.Tensor:
        bo, bi = self.block
        return s.repeat_interleave(bo, 0)[:O].repeat_interleave(bi, 1)[:, :I]

    def dequantize(self, parts, out, idx=None):
        if out.numel() % 2:       # an odd element count has no whole uint16 rows: plain conversion
            out.copy_(parts["weight"])
            self.apply_scales(parts, out)
            return out
        return super().dequantize(parts, out, idx)

    def apply_scales(self, parts, out):
        O, I = out.shape
        bo, bi = self.block
        s = parts["scale_inv"]
        if O % bo == 0 and I % bi == 0:
            out.view(O // bo, bo, I // bi, bi).mul_(s[:, None, :, None])
        else:   # ragged edge tiles (not in released checkpoints, whose sizes are multiples of 128)
            out.mul_(self._expand(s, O, I))

    def quantize(self, w):
        O, I = w.shape
        bo, bi = self.block
        wf = w.float()
        gO, gI = -(-O // bo), -(-I // bi)
        pad = torch.zeros(gO * bo, gI * bi)
        pad[:O, :I] = wf.abs()
        amax = pad.view(gO, bo, gI, bi).amax((1, 3))
        scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
        q = (wf / self._expand(scale, O, I)).clamp(-448, 448).to(torch.float8_e4m3fn)
        return {"weight": q, "scale_inv": scale}

    def _hint(self):
        return f" (fp8_e4m3, {self.block[0]}x{self.block[1]} scale tiles)"


@dataclass(frozen=True)
class FormatSpec:
    """One entry of the format registry: how to build the format, what the cost model calls its
    dtype and how many bits a weight costs there (scales included), and the ``convert --quantize``
    name that makes it from float weights (None: read as shipped only)."""
    make: "object"            # callable(**params) -> WeightFormat
    cost_dtype: str
    bits: float
    quantize: "str | None" = None


# The registry: a format is one entry here (or one register_format call).
FORMATS = {
    "fp32": FormatSpec(lambda **kw: Dense("fp32"), "fp32", 32.0),
    "bf16": FormatSpec(lambda **kw: Dense("bf16"), "bf16", 16.0),
    "fp16": FormatSpec(lambda **kw: Dense("fp16"), "fp16", 16.0),
    "mxfp4": FormatSpec(lambda **kw: MXFP4(), "mxfp4", 4.25, quantize="mxfp4"),
    "int4": FormatSpec(lambda group=32, scale_dtype="bfloat16", **kw: INT4(group, scale_dtype), "int4", 4.5,
                       quantize="int4"),
    "fp8_e4m3": FormatSpec(lambda block=(128, 128), **kw: FP8(block), "fp8", 8.0, quantize="fp8"),
    "int8": FormatSpec(lambda group=32, scale_dtype="float16", **kw: INT8(group, scale_dtype), "int8", 8.5,
                       quantize="int8"),
}


def register_format(name: str, spec: FormatSpec) -> None:
    """Add a format: the store, conversion (``--quantize``), the CLI and the cost model see it."""
    FORMATS[name] = spec
    cm.DTYPE_BITS.setdefault(spec.cost_dtype, spec.bits)


def cost_dtype(fmt: "str | None") -> "str | None":
    """Store format -> the cost model's dtype name (cache_policy.cost_model.DTYPE_BITS): replaying a
    store's trace sizes its experts from the manifest's real blob bytes and this."""
    spec = FORMATS.get(fmt) if fmt else None
    return spec.cost_dtype if spec else None


def quantize_choices() -> dict:
    """``convert --quantize NAME`` -> format name."""
    return {s.quantize: n for n, s in FORMATS.items() if s.quantize}


_INSTANCES: dict = {}


def get_format(name: str, **params) -> WeightFormat:
    """The format ``name`` with ``params``. Formats hold no per-call state, so one instance serves
    every caller: building a lookup table takes ~1 ms, and conversion asks for a format per tensor."""
    key = (name, tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in params.items())))
    fmt = _INSTANCES.get(key)
    if fmt is None:
        f = FORMATS.get(name)
        if f is None:
            raise ValueError(f"weight format {name!r} is not supported; supported: {', '.join(FORMATS)}")
        fmt = _INSTANCES[key] = f.make(**params)
    return fmt


def dense_format_of(dtype: torch.dtype) -> WeightFormat:
    for name, dt in FLOAT_DTYPES.items():
        if dt == dtype:
            return Dense(name)
    raise ValueError(f"expert weights of dtype {dtype} are neither a float format ({', '.join(FLOAT_DTYPES)}) nor a "
                     f"recognised quantized layout")
