"""``Linear``: y = x W^T (+ b) for the dense (non-expert) weights of attention, dense MLPs, shared
experts, routers and the head.

On a CPU with the host kernels (runtime/kernels), a bf16 checkpoint's weights stay bf16 in memory and
products of a few rows (decode) run the kernel's bf16 GEMV with float32 accumulation: a decode step
reads half the bytes a float32 copy would, and CPU decode is bound by the bytes it reads. Larger
products (prefill) widen the weight for one BLAS call. Otherwise the weight is held in the model's
dtype, input-major, for ``torch.mm`` (at decode's few rows the faster CPU kernel: 200 vs 330 us for
[1, 512] x [512, 1024] on this project's 2-core machine)."""
from __future__ import annotations

import torch

from ... import kernels

# Rows up to which the GEMV is used; past them the weight is widened for one BLAS call (prefill).
GEMV_ROWS = 16


class Linear:
    """w: [out, in] as the checkpoint stores it (on the model's device); b: [out] or None; dtype:
    the model's compute dtype."""

    def __init__(self, w: torch.Tensor, b: "torch.Tensor | None", dtype: torch.dtype) -> None:
        self.out_features, self.in_features = w.shape
        self.kept = (w.dtype == torch.bfloat16 and dtype == torch.float32 and w.device.type == "cpu"
                     and kernels.lib() is not None)
        self.b = None if b is None else b.to(dtype)
        self.dtype = dtype
        if self.kept:
            self.w = w.contiguous()                                      # w: [out, in] bf16
            self.wt = None
        else:
            self.w = None
            self.wt = w.to(dtype).t().contiguous()                       # wt: [in, out]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [n, in] -> [n, out]."""
        if not self.kept:
            return torch.mm(x, self.wt) if self.b is None else torch.addmm(self.b, x, self.wt)
        if x.shape[0] > GEMV_ROWS or x.dtype != torch.float32:
            return torch.nn.functional.linear(x, self.w.to(x.dtype), self.b)
        x = x.contiguous()
        y = torch.empty(x.shape[0], self.out_features)
        kernels.lib().tm_linear_bf16(x.data_ptr(), x.shape[0], self.in_features, self.w.data_ptr(),
                                     self.out_features, y.data_ptr(), kernels.threads())
        return y if self.b is None else y.add_(self.b)
