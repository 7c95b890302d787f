"""RMSNorm as the reference implementations compute it; ``RMSNorm`` picks its backend once, at build."""
from __future__ import annotations

import torch

from ... import kernels


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """The torch ops: normalise in float32 as the reference implementations do, then cast back. w: [D],
    or [G, D] for x [..., G, D] (one weight row per group, e.g. q and k heads stacked)."""
    if x.dtype == torch.float32:   # the same ops without the two no-op casts
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


class RMSNorm:
    """A norm's weight w [D] or [G, D] and eps. On a CPU with the host kernels and a float32 weight, one
    kernel call instead of five ops: a decode step's norms are [1-8, 512] rows, where each torch op costs
    3-12 us (mean alone 12) and the whole norm ~1 us of work. Elsewhere the torch ops (``rms_norm``)."""

    def __init__(self, w: torch.Tensor, eps: float) -> None:
        self.weight, self.eps = w.contiguous(), eps
        self._fwd = self._host if (w.device.type == "cpu" and w.dtype == torch.float32
                                   and kernels.lib() is not None) else self._torch

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._fwd(x)

    def _torch(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def _host(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        # x of the model's dtype (float32 here) and laid out as the kernel reads it; a view that is not
        # (a strided slice) or a grouped weight that does not match takes the torch ops
        if x.dtype != torch.float32 or not x.is_contiguous() or \
                (w.dim() == 2 and (x.dim() < 2 or x.shape[-2] != w.shape[0])):
            return rms_norm(x, w, self.eps)
        D = x.shape[-1]
        out = torch.empty_like(x)
        kernels.lib().tm_rms_norm(x.data_ptr(), x.numel() // D if D else 0, D, w.data_ptr(),
                                  w.shape[0] if w.dim() == 2 else 1, self.eps, out.data_ptr())
        return out
