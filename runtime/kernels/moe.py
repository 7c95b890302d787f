"""``HostMoE``: one grouped call of the C kernel (moe_cpu.c ``tm_moe``) for a layer's experts, reading
their blobs where they lie (the device slab of a CPU-only machine, or host-tier slots)."""
from __future__ import annotations

import ctypes

import numpy as np
import torch

from . import FMT_CODES, SCALE_CODES, MoEArgs, lib, scratch, threads as kernel_threads

# Per format: the blob tensors (suffixes) holding each part's codes and scales.
_CODES = {"mxfp4": ("blocks", "scales"), "int4": ("packed", "scale"), "fp8_e4m3": ("weight", "scale_inv"),
          "int8": ("weight", "scale")}
Q8_FORMATS = ("mxfp4", "int4", "int8")   # formats --host-act-quant q8 computes with 8-bit activations
# Tokens per expert above which the reference path (dequantize or widen into scratch, then one BLAS
# matmul) beats the kernel's GEMV (prefill; bench/host_kernels.py's second table): about 32-64 for
# bf16 experts, past 64 for quantized ones, whose reference pays a dequantization per call.
# With 8-bit activations (q8) the integer kernel tiles a few weight rows against a few token rows, so it
# wins at every row count measured: pp512 of the mid int4 store at prefill chunk 512, 1590 vs 1039 prompt
# tokens/s at 1 thread and 2373 vs 1079 at 2 with the reference path past 64 rows (AVX512-VNNI EPYC).
MAX_ROWS = {"dense": 32, "quantized": 64, "q8": 1 << 30}
ACT_QUANT = ("none", "q8")
ACTS = {"swiglu": 0, "swiglu_clamp": 1, "silu_clamp": 2}   # the kernel's activations (moe_cpu.c's act codes)


def unsupported(weights: list, H_in: int, I: int) -> "str | None":
    """Why the kernel cannot compute experts of these blob weights (None: it can)."""
    by = {w.name: w for w in weights}
    if "gate_up" not in by and "gate" not in by:
        return "experts without a gate projection (up and down only: relu^2) have no host kernel"
    mats = [by[n] for n in ("gate_up", "gate", "up", "down") if n in by]
    fmts = {(w.format, tuple(sorted((k, str(v)) for k, v in w.params.items()))) for w in mats}
    if len(fmts) != 1:
        return f"expert matrices in several formats {sorted(f for f, _ in fmts)}"
    w = mats[0]
    if w.format not in FMT_CODES:
        return f"format {w.format} has no host kernel"
    quant = w.format in _CODES
    if quant and (H_in % 32 or I % 32):
        return f"{w.format} kernel needs in and intermediate sizes that are multiples of 32 (got {H_in}, {I})"
    if w.format in ("int4", "int8") and (int(w.params.get("group", 32)) % 32
                                          or w.params.get("scale_dtype", "bfloat16") not in SCALE_CODES):
        return f"{w.format} with group {w.params.get('group')} (the kernel takes multiples of 32)"
    if w.format == "fp8_e4m3" and (int(list(w.params.get("block", (128, 128)))[1]) % 8 or H_in % 8 or I % 8):
        return "fp8 scale tiles or sizes that are not multiples of 8"
    for b in ("gate_up_bias", "down_bias"):
        if b in by and by[b].format not in ("fp32", "bf16", "fp16"):
            return f"{b} in {by[b].format}"
    return None


class HostMoE:
    """Grouped expert compute on the CPU for one expert layout. ``run`` takes the experts' blob views
    (``name.suffix`` -> tensor, as the store returns them) and their rows of ``xs``; writes ``ys``.

    ``args`` is a template (the layout's fields): each call fills its own copy, with scratch from the
    calling thread's pool, so threads may share one instance (measured: the copy adds ~0.3 us a call)."""

    def __init__(self, weights: list, H_in: int, I: int, H_out: int, act: str = "swiglu",
                 limit: float = 0.0, alpha: float = 0.0, act_quant: str = "none") -> None:
        if act_quant not in ACT_QUANT:
            raise ValueError(f"host activation quantization {act_quant!r} is not one of {', '.join(ACT_QUANT)}")
        why = unsupported(weights, H_in, I)
        if why is not None:
            raise ValueError(why)
        self.lib = lib()
        if self.lib is None:
            raise RuntimeError("host kernels are not available")
        by = {w.name: w for w in weights}
        w = by["down"]
        self.format = w.format
        self.max_rows = MAX_ROWS["q8" if act_quant == "q8" and w.format in Q8_FORMATS else
                                 "quantized" if w.format in _CODES else "dense"]
        a = self.args = MoEArgs()
        a.fmt = FMT_CODES[w.format]
        a.sfmt = SCALE_CODES.get(w.params.get("scale_dtype", "float32" if w.format != "int8" else "float16"), 0)
        a.group = int(w.params.get("group", 32))
        block = list(w.params.get("block", (1, 1)))
        a.bo, a.bi = int(block[0]), int(block[1])
        bias = by.get("gate_up_bias")
        a.bias_fmt = FMT_CODES[bias.format] if bias is not None else -1
        if act not in ACTS:
            raise ValueError(f"expert activation {act!r} has no host kernel (it has {', '.join(ACTS)})")
        a.act = ACTS[act]
        a.limit, a.alpha = float(limit or 0.0), float(alpha or 0.0)
        a.H_in, a.I, a.H_out = int(H_in), int(I), int(H_out)
        if w.format in _CODES:
            c, s = _CODES[w.format]
            self._keys = [f"gate.{c}", f"gate.{s}", f"up.{c}", f"up.{s}", f"down.{c}", f"down.{s}"]
        else:
            self._keys = ["gate_up.t", None, "gate_up.t", None, "down.t", None]
        self._keys += ["gate_up_bias.t", "down_bias.t"] if bias is not None else [None, None]
        # q8: mxfp4 / int4 / int8 experts dot 8-bit activations (one scale per 32) with integer products, as
        # llama.cpp does; not exact (README: tolerance), so off unless asked for.
        a.q8 = int(act_quant == "q8" and w.format in Q8_FORMATS)
        self.act_quant = "q8" if a.q8 else "none"
        self._ldq = max(a.H_in, a.I)
        self._ldd = self.lib.tm_q8_ldd(self._ldq)       # q8 scales per row: the build's layout
        self._ptrs: dict = {}

    def _row(self, views: dict) -> np.ndarray:
        hit = self._ptrs.get(id(views))
        if hit is None or hit[0] is not views:
            ptrs = np.array([0 if k is None else views[k].data_ptr() for k in self._keys], dtype=np.int64)
            hit = self._ptrs[id(views)] = (views, ptrs)   # the store keeps one views dict per slot
        return hit[1]

    def _call(self, n_rows: int) -> MoEArgs:
        """This call's arguments: the template's copy, with scratch for n_rows rows from this thread's pool."""
        a = MoEArgs.from_buffer_copy(self.args)
        a.h = scratch("moe.h", n_rows * 2 * a.I)
        if a.q8:
            a.xq = scratch("q8.xq", n_rows * self._ldq, torch.int8)
            a.xd = scratch("q8.xd", n_rows * self._ldd)
        a.n_rows = a.scratch_rows = n_rows
        return a

    def run_step(self, views: list, row0: np.ndarray, rows: np.ndarray, xs: int, ys: int, n_rows: int, xin: int,
                 tok: int, back: int, wts: int, out: int, T: int, k: int) -> None:
        """Decode's call from layers/fused.py, on buffers it owns and checked: addresses of the gathered
        rows xs / ys [n_rows, ...] (scratch), the layer input xin [T, H_in], the sorted rows' tokens
        tok, each (token, slot)'s row back and weight wts [T, k], and out [T, H_out], which the
        weighted sum is added into; row0 / rows: int64 arrays of the experts' first rows and counts (at
        least len(views) each). The C checks every row, token and back index against n_rows and T."""
        if len(row0) < len(views) or len(rows) < len(views) or row0.dtype != np.int64 or rows.dtype != np.int64:
            raise ValueError("row0 / rows must be int64 arrays with an entry per expert")
        a = self._call(n_rows)
        ptrs = np.concatenate([self._row(v) for v in views])
        a.n_exp, a.nthreads = len(views), kernel_threads()
        a.row0, a.rows, a.ptrs = row0.ctypes.data, rows.ctypes.data, ptrs.ctypes.data
        a.x, a.y, a.xin, a.tok, a.back, a.wts, a.out = xs, ys, xin, tok, back, wts, out
        a.T, a.k, a.out_add, a.n_in = T, k, 1, T
        self.lib.tm_moe(ctypes.byref(a))            # raises KernelError on a refusal (kernels._refused)

    def run(self, views: list, row0, rows, xs: torch.Tensor, ys: torch.Tensor,
            threads: "int | None" = None, gather=None, combine=None, out_add: bool = False) -> None:
        """views[j]: expert j's blob views; its rows are xs[row0[j] : row0[j] + rows[j]].
        xs: [n, H_in] float32 contiguous; ys: [n, H_out] float32 contiguous (written).
        gather: (xin [T, H_in], tok [n] int64): xs's rows are first gathered as xin[tok] (xs is then
        scratch). combine: (back [T*k] int64, wts [T, k] float32, out [T, H_out]): out = the k rows of
        each token summed by weight (decode: the layer's routed part in one call); ``out_add``: added
        into out (the residual stream) instead. The shapes are checked here, every index the call
        follows (row0 / rows, tok, back) in the C against them: a bad one raises KernelError."""
        tmpl = self.args
        if xs.dtype != torch.float32 or ys.dtype != torch.float32 or not (xs.is_contiguous() and ys.is_contiguous()):
            raise ValueError("host kernel rows must be contiguous float32")
        if xs.dim() != 2 or ys.dim() != 2 or xs.shape[1] != tmpl.H_in or ys.shape[1] != tmpl.H_out:
            raise ValueError(f"rows must be [n, {tmpl.H_in}] in and [n, {tmpl.H_out}] out "
                             f"(got {tuple(xs.shape)}, {tuple(ys.shape)})")
        n = len(views)
        r0 = np.ascontiguousarray(row0, dtype=np.int64)
        rc = np.ascontiguousarray(rows, dtype=np.int64)
        if r0.shape != (n,) or rc.shape != (n,):
            raise ValueError(f"row0 and rows need one entry per expert ({n}; got {r0.shape}, {rc.shape})")
        n_rows = min(xs.shape[0], ys.shape[0])
        a = self._call(n_rows)
        a.out_add = int(out_add)
        if gather is not None:
            xin, tok = gather
            if xin.dtype != torch.float32 or not xin.is_contiguous() or tok.dtype != torch.int64 or \
                    not tok.is_contiguous() or xin.dim() != 2 or xin.shape[1] != tmpl.H_in:
                raise ValueError(f"gathered rows must be contiguous float32 [T, {tmpl.H_in}] with contiguous "
                                 "int64 token indices")
            a.xin, a.tok, a.n_in = xin.data_ptr(), tok.data_ptr(), xin.shape[0]
            a.n_rows = min(n_rows, tok.numel())      # tok: one entry per sorted row
        if combine is not None:
            back, wts, out = combine
            if wts.dtype != torch.float32 or out.dtype != torch.float32 or back.dtype != torch.int64 or \
                    not (wts.is_contiguous() and out.is_contiguous() and back.is_contiguous()):
                raise ValueError("combine needs int64 rows, float32 weights and a contiguous float32 output")
            if wts.dim() != 2 or back.numel() != wts.numel() or out.dim() != 2 or out.shape[0] != wts.shape[0] \
                    or out.shape[1] != tmpl.H_out:
                raise ValueError(f"combine needs back [T*k], wts [T, k] and out [T, {tmpl.H_out}] "
                                 f"(got {tuple(back.shape)}, {tuple(wts.shape)}, {tuple(out.shape)})")
            a.back, a.wts, a.out = back.data_ptr(), wts.data_ptr(), out.data_ptr()
            a.T, a.k = wts.shape
        ptrs = np.concatenate([self._row(v) for v in views]) if views else np.zeros(0, np.int64)
        a.n_exp = n
        a.nthreads = threads or kernel_threads()
        a.row0, a.rows, a.ptrs = r0.ctypes.data, rc.ctypes.data, ptrs.ctypes.data
        a.x, a.y = xs.data_ptr(), ys.data_ptr()
        self.lib.tm_moe(ctypes.byref(a))            # raises KernelError on a refusal (kernels._refused)
