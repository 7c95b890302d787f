"""``Linear``: y = x W^T (+ b) for the dense (non-expert) weights of attention, dense MLPs, shared
experts, routers and the head.

On a CPU with the host kernels (runtime/kernels), a bf16 checkpoint's weights stay bf16 in memory and
products of a few rows (decode) run the kernel's bf16 GEMV with float32 accumulation: a decode step
reads half the bytes a float32 copy would, and CPU decode is bound by the bytes it reads. Larger
products (prefill) widen the weight for one BLAS call. Otherwise the weight is held in the model's
dtype, input-major, for ``torch.mm`` (at decode's few rows the faster CPU kernel: 200 vs 330 us for
[1, 512] x [512, 1024] on this project's 2-core machine).

``--dense-quant int8 | int4`` (``quant``): the weight is quantized once, at load, to the int8 / int4
expert formats (runtime/quant.py: group 32; int8 with float16 scales as llama.cpp's Q8_0, int4 with
bf16 scales as the int4 experts) and every product runs the experts' row kernels over those codes -
a quarter / an eighth of a float32 weight's bytes, which is what bounds CPU decode (llama.cpp's Q4_0
and MXFP4_MOE files quantize attention and the head too). With ``act_quant`` q8 the rows of x are
rounded to 8 bits per 32 first and the dots are integer ones (as llama.cpp computes them); otherwise
each weight is decoded to its exact value and dotted with float32 x. Needs the host kernels and an
input size that is a multiple of 32; elsewhere the weight stays as it is (``quant`` then reads
"none")."""
from __future__ import annotations

import ctypes

import torch

from ... import kernels
from ...quant import get_format

# Rows up to which the GEMV is used; past them the weight is widened for one BLAS call (prefill).
GEMV_ROWS = 16
DENSE_QUANT = ("none", "int8", "int4")
# "auto" (the runtime's default): as the store says - ``convert --dense-quant`` records its choice in the manifest's
# extra, as a GGUF file carries its tensors' types; a store without one keeps the checkpoint's dtype ("none")
DENSE_QUANT_CHOICES = ("auto",) + DENSE_QUANT


def resolve_dense_quant(value: str, extra: dict) -> str:
    """``--dense-quant`` ``value`` for a store whose manifest extra is ``extra``: "auto" -> the store's recorded choice
    (else "none"); an explicit value wins. ValueError naming the flag for a value not in DENSE_QUANT_CHOICES."""
    if value not in DENSE_QUANT_CHOICES:
        raise ValueError(f"--dense-quant {value!r}: use {', '.join(DENSE_QUANT_CHOICES)}")
    if value != "auto":
        return value
    stored = extra.get("dense_quant", "none")
    if stored not in DENSE_QUANT:
        raise ValueError(f"the store's manifest records dense_quant {stored!r}, not one of {', '.join(DENSE_QUANT)}: "
                         f"convert again, or give --dense-quant none|int8|int4")
    return stored
# --dense-quant name -> (format, params) of runtime/quant.py
_QUANT_FORMATS = {"int8": ("int8", {"group": 32, "scale_dtype": "float16"}),
                  "int4": ("int4", {"group": 32, "scale_dtype": "bfloat16"})}
_PARTS = {"int8": ("weight", "scale"), "int4": ("packed", "scale")}


class Linear:
    """w: [out, in] as the checkpoint stores it (on the model's device); b: [out] or None; dtype:
    the model's compute dtype; quant: a ``DENSE_QUANT`` name; act_quant: none | q8 (with quant)."""

    def __init__(self, w: torch.Tensor, b: "torch.Tensor | None", dtype: torch.dtype, quant: str = "none",
                 act_quant: str = "none") -> None:
        if quant not in DENSE_QUANT:
            raise ValueError(f"dense quantization {quant!r} is not one of {', '.join(DENSE_QUANT)}")
        self.out_features, self.in_features = w.shape
        self.b = None if b is None else b.to(dtype)
        self.dtype = dtype
        self.quant = quant if (quant != "none" and w.device.type == "cpu" and dtype == torch.float32
                               and self.in_features % 32 == 0 and kernels.lib() is not None) else "none"
        self.kept = (self.quant == "none" and w.dtype == torch.bfloat16 and dtype == torch.float32
                     and w.device.type == "cpu" and kernels.lib() is not None)
        self.w = self.wt = None
        # The backend, once: the quantized kernels, the bf16 GEMV over the kept weight, or torch.mm.
        if self.quant != "none":
            self._quantize(w, act_quant)
            self._fwd = self._quantized
        elif self.kept:
            self.w = w.contiguous()                                      # w: [out, in] bf16
            # past the GEMV's rows, bf16 activations with act_quant q8 (llama.cpp's default for BF16
            # weights; bench/results/prefill_chunk.md), else the weight widened (exact)
            self.bf16_acts = act_quant == "q8"
            self._wide = self._wide_bf16 if self.bf16_acts else self._wide_f32      # chosen once
            self._fwd = self._bf16
        else:
            self.wt = w.to(dtype).t().contiguous()                       # wt: [in, out]
            self._fwd = self._mm

    def _quantize(self, w: torch.Tensor, act_quant: str) -> None:
        name, params = _QUANT_FORMATS[self.quant]
        parts = get_format(name, **params).quantize(w.float())
        c, s = _PARTS[self.quant]
        self.codes, self.scales = parts[c].contiguous(), parts[s].contiguous()   # [out, in or in/2], [out, in/32]
        self.bias32 = None if self.b is None else self.b.float().contiguous()
        a = self._args = kernels.LinArgs()
        a.fmt = kernels.FMT_CODES[name]
        a.sfmt = kernels.SCALE_CODES[params["scale_dtype"]]
        a.group = params["group"]
        a.q8 = int(act_quant == "q8")
        a.K, a.N = self.in_features, self.out_features
        self._ldd = kernels.lib().tm_q8_ldd(self.in_features)           # q8 scales per row: the build's layout

    @property
    def args(self):
        """The C arguments' template (quantized weights), pointed at the codes, scales and bias where they are now:
        runtime/kernels/hugepages.py moves them after construction, so no address is kept from then."""
        a = self._args
        a.W, a.S = self.codes.data_ptr(), self.scales.data_ptr()
        a.bias = self.bias32.data_ptr() if self.bias32 is not None else None
        return a

    @property
    def nbytes(self) -> int:
        """Bytes of the weight as held (codes and scales, or the bf16 / compute-dtype copy)."""
        if self.quant != "none":
            return self.codes.nbytes + self.scales.nbytes
        return (self.w if self.kept else self.wt).nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [n, in] -> [n, out]."""
        return self._fwd(x)

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        return torch.mm(x, self.wt) if self.b is None else torch.addmm(self.b, x, self.wt)

    def _bf16(self, x: torch.Tensor) -> torch.Tensor:
        """The kept bf16 weight: the kernel's GEMV for a few float32 rows (decode); past them (prefill) one
        BLAS call, on bf16-rounded rows with ``bf16_acts``, else on the weight widened to float32."""
        if x.dtype != torch.float32:
            return torch.nn.functional.linear(x, self.w.to(x.dtype), self.b)
        if x.shape[0] > GEMV_ROWS:
            return self._wide(x)
        x = x.contiguous()
        y = torch.empty(x.shape[0], self.out_features)
        kernels.lib().tm_linear_bf16(x.data_ptr(), x.shape[0], self.in_features, self.w.data_ptr(),
                                     self.out_features, y.data_ptr(), kernels.threads())
        return y if self.b is None else y.add_(self.b)

    def _wide_f32(self, x: torch.Tensor) -> torch.Tensor:
        """Prefill rows, exact: the weight widened to float32 for one BLAS call."""
        return torch.nn.functional.linear(x, self.w.to(x.dtype), self.b)

    def _wide_bf16(self, x: torch.Tensor) -> torch.Tensor:
        """Prefill rows with bf16 activations: x rounded to bf16, one bf16 matmul, float32 out. x: [n, in]."""
        y = torch.nn.functional.linear(x.to(torch.bfloat16), self.w).float()        # y: [n, out]
        return y if self.b is None else y.add_(self.b)

    def _quantized(self, x: torch.Tensor) -> torch.Tensor:
        lib = kernels.lib()
        x = x.float().contiguous()                                       # x: [n, in]
        n = x.shape[0]
        y = torch.empty(n, self.out_features)
        # this call's own arguments (self.args is the template) and q8 scratch from this thread's pool:
        # threads may share a Linear
        a = kernels.LinArgs.from_buffer_copy(self.args)
        if a.q8:
            a.xq = kernels.scratch("q8.xq", n * self.in_features, torch.int8)
            a.xd = kernels.scratch("q8.xd", n * self._ldd)
            a.xq_rows = n
        a.n, a.nthreads = n, kernels.threads()
        a.x, a.y = x.data_ptr(), y.data_ptr()
        lib.tm_linear_q(ctypes.byref(a))              # raises KernelError on a refusal (kernels._refused)
        return y
