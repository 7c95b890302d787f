"""Manifold-constrained hyper-connections (DeepSeek-V4's residual stream; transformers'
``DeepseekV4HyperConnection`` / ``DeepseekV4HyperHead``).

The residual is ``hc_mult`` (N) parallel streams per token, [tokens, N, hidden]; the embedding starts
as N copies. Around each sublayer f (attention, MoE) one ``HyperConnection`` reads the streams, RMS-
normed together (no weight) and projected by ``fn`` [(2 + N) N, N hidden] + ``base`` with ``scale``
[3], into three sets of weights per token:

* pre [N] = sigmoid(.) + eps: the sublayer's input is the pre-weighted sum of the streams;
* post [N] = 2 sigmoid(.): how much of the sublayer's output each stream receives;
* comb [N, N] = softmax(.) + eps, made doubly stochastic by ``hc_sinkhorn_iters`` Sinkhorn passes
  (columns first): stream k becomes post_k f(x) + sum_j comb[j, k] stream_j.

After the last layer ``HyperHead`` collapses the streams with its own sigmoid weights (no Sinkhorn)
into the hidden state the final norm and the head read. Everything here runs in float32, as the
reference keeps these modules; it adds nothing to the caches (it mixes within a token)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .config import MoEConfig
from .layers.weights import take


def _unweighted_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class HyperConnection:
    def __init__(self, cfg: MoEConfig, w: dict, p: str) -> None:
        hc = cfg.hyper
        self.N, self.iters, self.eps, self.norm_eps = hc.mult, hc.sinkhorn_iters, hc.eps, cfg.rms_norm_eps
        self.fn, self.base, self.scale = take(w, p + "fn").float(), take(w, p + "base").float(), take(w, p + "scale").float()

    @staticmethod
    def tensors(cfg: MoEConfig, p: str) -> dict:
        N = cfg.hyper.mult
        return {p + "fn": ((2 + N) * N, N * cfg.hidden_size), p + "base": ((2 + N) * N,), p + "scale": (3,)}

    def weights(self, h: torch.Tensor):
        """h: [tokens, N, hidden] -> (pre [tokens, N], post [tokens, N], comb [tokens, N, N])."""
        N = self.N
        mix = F.linear(_unweighted_rms(h.reshape(h.shape[0], -1).float(), self.norm_eps), self.fn)   # [tokens, (2 + N) N]
        pre_w, post_w, comb_w = mix.split([N, N, N * N], -1)
        pre_b, post_b, comb_b = self.base.split([N, N, N * N])
        pre = torch.sigmoid(pre_w * self.scale[0] + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * self.scale[1] + post_b)
        comb = torch.softmax(comb_w.view(-1, N, N) * self.scale[2] + comb_b.view(N, N), dim=-1) + self.eps
        comb = comb / (comb.sum(-2, keepdim=True) + self.eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(-1, keepdim=True) + self.eps)
            comb = comb / (comb.sum(-2, keepdim=True) + self.eps)
        return pre, post, comb

    def mix(self, h: torch.Tensor, sublayer) -> torch.Tensor:
        """One sublayer on the streams h [tokens, N, hidden]: its input the pre-weighted sum, its output
        spread by post, the streams mixed by comb. Returns the new streams."""
        pre, post, comb = self.weights(h)
        x = (pre.unsqueeze(-1) * h).sum(1).to(h.dtype)                  # x: [tokens, hidden]
        y = sublayer(x)
        return post.to(h.dtype).unsqueeze(-1) * y.unsqueeze(1) + torch.matmul(comb.to(h.dtype).transpose(-1, -2), h)


class HyperHead:
    def __init__(self, cfg: MoEConfig, w: dict) -> None:
        self.eps, self.norm_eps = cfg.hyper.eps, cfg.rms_norm_eps
        self.fn, self.base = take(w, "model.hc_head.hc_fn").float(), take(w, "model.hc_head.hc_base").float()
        self.scale = take(w, "model.hc_head.hc_scale").float()

    @staticmethod
    def tensors(cfg: MoEConfig) -> dict:
        N = cfg.hyper.mult
        return {"model.hc_head.hc_fn": (N, N * cfg.hidden_size), "model.hc_head.hc_base": (N,),
                "model.hc_head.hc_scale": (1,)}

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """h: [tokens, N, hidden] -> [tokens, hidden]."""
        mixes = F.linear(_unweighted_rms(h.reshape(h.shape[0], -1).float(), self.norm_eps), self.fn)
        pre = torch.sigmoid(mixes * self.scale + self.base) + self.eps
        return (pre.unsqueeze(-1) * h).sum(1).to(h.dtype)
