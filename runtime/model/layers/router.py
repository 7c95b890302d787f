"""Routers: logits -> (expert ids, weights). One function the forward pass and every preview share."""
from __future__ import annotations

import torch

from ..config import MoEConfig


def route(logits: torch.Tensor, cfg: MoEConfig, bias: "torch.Tensor | None" = None,
          bonus: "torch.Tensor | None" = None):
    """Router variants. logits: [tokens, E] -> (ids [tokens, k], weights [tokens, k] float32).
    ``bonus`` ([E], cache-aware routing): added to the logits (to the scores of a sigmoid router)
    for choosing experts only; the weights of the chosen experts come from the unbiased router."""
    k = cfg.top_k
    lf = logits.float()
    if cfg.router == "softmax_topk":        # Mixtral, Qwen-MoE, OLMoE: softmax over all, then top-k
        p = lf.softmax(-1)
        if bonus is None:
            w, ids = p.topk(k, dim=-1)
        else:
            ids = (lf + bonus).topk(k, dim=-1).indices
            w = p.gather(1, ids)
        if cfg.norm_topk_prob:
            w = w / w.sum(-1, keepdim=True)
    elif cfg.router == "topk_softmax":      # top-k of the logits, softmax over the chosen
        ids = (lf if bonus is None else lf + bonus).topk(k, dim=-1).indices
        w = lf.gather(1, ids).softmax(-1)
    else:                                   # DeepSeek-V3 / Kimi K2: sigmoid, bias-corrected group-limited top-k
        s = lf.sigmoid()
        sel = s + (bias.float() if bias is not None else 0.0) + (bonus if bonus is not None else 0.0)
        T, E = sel.shape
        g = sel.view(T, cfg.n_group, E // cfg.n_group)
        group_score = g.topk(min(2, E // cfg.n_group), dim=-1).values.sum(-1)          # [T, n_group]
        keep = torch.zeros_like(group_score).scatter_(1, group_score.topk(cfg.topk_group, dim=-1).indices, 1.0)
        mask = keep.unsqueeze(-1).expand_as(g).reshape(T, E)
        ids = sel.masked_fill(mask == 0, float("-inf")).topk(k, dim=-1).indices
        w = s.gather(1, ids)                # weights from the uncorrected scores
        if cfg.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return ids, (w if cfg.routed_scaling_factor == 1 else w * cfg.routed_scaling_factor)
