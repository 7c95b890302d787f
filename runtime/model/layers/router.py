"""Routers: logits -> (expert ids, weights). One function the forward pass and every preview share."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..config import MoEConfig


def _group_mask(sel: torch.Tensor, n_group: int, topk_group: int, group_score) -> torch.Tensor:
    """Keep only the experts of each token's best ``topk_group`` of ``n_group`` groups; the rest -inf.
    sel: [T, E]; group_score(g [T, n_group, E/n_group]) -> [T, n_group]."""
    T, E = sel.shape
    g = sel.view(T, n_group, E // n_group)
    score = group_score(g)                                                         # [T, n_group]
    keep = torch.zeros_like(score).scatter_(1, score.topk(topk_group, dim=-1).indices, 1.0)
    mask = keep.unsqueeze(-1).expand_as(g).reshape(T, E)
    return sel.masked_fill(mask == 0, float("-inf"))


def softmax_topk(lf, cfg, bias, bonus):
    """Mixtral, Qwen-MoE, OLMoE: softmax over all, then top-k (renormalised with norm_topk_prob)."""
    k = cfg.top_k
    p = lf.softmax(-1)
    if bonus is None:
        w, ids = p.topk(k, dim=-1)
    else:
        ids = (lf + bonus).topk(k, dim=-1).indices
        w = p.gather(1, ids)
    if cfg.norm_topk_prob:
        w = w / w.sum(-1, keepdim=True)
    return ids, w


def topk_softmax(lf, cfg, bias, bonus):
    """gpt-oss: top-k of the logits, softmax over the chosen."""
    ids = (lf if bonus is None else lf + bonus).topk(cfg.top_k, dim=-1).indices
    return ids, lf.gather(1, ids).softmax(-1)


def softmax_group(lf, cfg, bias, bonus):
    """DeepSeek-V2 group_limited_greedy: softmax, the best topk_group groups by their best expert,
    top-k within them (softmax is monotone: the same choice with the bonus on the logits)."""
    p = lf.softmax(-1)
    sel = p if bonus is None else lf + bonus
    ids = _group_mask(sel, cfg.n_group, cfg.topk_group, lambda g: g.max(dim=-1).values).topk(cfg.top_k, dim=-1).indices
    w = p.gather(1, ids)
    if cfg.norm_topk_prob:
        w = w / w.sum(-1, keepdim=True)
    return ids, w


def softmax_bias(lf, cfg, bias, bonus):
    """ERNIE 4.5: softmax, top-k of probabilities + correction bias, the chosen probabilities
    renormalised (floor 1e-12: transformers' moe_norm_min)."""
    p = lf.softmax(-1)
    sel = p + (bias.float().reshape(-1) if bias is not None else 0.0) + (bonus if bonus is not None else 0.0)
    ids = sel.topk(cfg.top_k, dim=-1).indices
    w = p.gather(1, ids)
    return ids, w / w.sum(-1, keepdim=True).clamp_min(1e-12)


def sigmoid_group(lf, cfg, bias, bonus):
    """DeepSeek-V3 / Kimi K2: sigmoid, bias-corrected group-limited top-k (groups scored by their two
    best experts); weights from the uncorrected scores."""
    s = lf.sigmoid()
    sel = s + (bias.float() if bias is not None else 0.0) + (bonus if bonus is not None else 0.0)
    E = sel.shape[1]
    two = min(2, E // cfg.n_group)
    ids = _group_mask(sel, cfg.n_group, cfg.topk_group,
                      lambda g: g.topk(two, dim=-1).values.sum(-1)).topk(cfg.top_k, dim=-1).indices
    w = s.gather(1, ids)
    if cfg.norm_topk_prob:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return ids, w


def sqrtsoftplus(lf, cfg, bias, bonus):
    """DeepSeek-V4: scores sqrt(softplus(logit)); top-k of the scores + correction bias; weights the chosen
    scores renormalised (floor 1e-20), whatever norm_topk_prob says (as the reference does)."""
    s = F.softplus(lf).sqrt()
    sel = s + (bias.float() if bias is not None else 0.0) + (bonus if bonus is not None else 0.0)
    ids = sel.topk(cfg.top_k, dim=-1).indices
    w = s.gather(1, ids)
    return ids, w / (w.sum(-1, keepdim=True) + 1e-20)


def logit_bias(lf, cfg, bias, bonus):
    """Kolibri: top-k of the logits + correction bias (the bias on the logits' scale, not the scores'); weights the
    chosen logits' sigmoid, renormalised with norm_topk_prob. Llama 4: the same without a bias or renormalisation."""
    sel = lf + (bias.float() if bias is not None else 0.0) + (bonus if bonus is not None else 0.0)
    ids = sel.topk(cfg.top_k, dim=-1).indices
    w = lf.gather(1, ids).sigmoid()
    return ids, (w / w.sum(-1, keepdim=True) if cfg.norm_topk_prob else w)


def hash_weights(logits: torch.Tensor, ids: torch.Tensor, cfg) -> torch.Tensor:
    """DeepSeek-V4's hash-routed layers: the experts come from the token's row of the table (``ids``
    [tokens, k]); their weights are sqrtsoftplus's, renormalised and scaled. -> [tokens, k] float32."""
    w = F.softplus(logits.float()).sqrt().gather(1, ids)
    w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w if cfg.routed_scaling_factor == 1 else w * cfg.routed_scaling_factor


# The registry: a router is one function here (MoEConfig.router names it; a MoE block picks it once).
ROUTERS = {f.__name__: f for f in (softmax_topk, topk_softmax, sigmoid_group, softmax_group, softmax_bias,
                                   sqrtsoftplus, logit_bias)}


# Routers that choose with a selection-only correction bias -> the shape the checkpoint stores it in, from the
# number of experts (ERNIE 4.5: [1, E], one group of experts).
CORRECTION_BIAS = {"sigmoid_group": lambda E: (E,), "sqrtsoftplus": lambda E: (E,), "softmax_bias": lambda E: (1, E),
                   "logit_bias": lambda E: (E,)}


def route(logits: torch.Tensor, cfg: "MoEConfig", bias: "torch.Tensor | None" = None,
          bonus: "torch.Tensor | None" = None, fn=None):
    """Router variants. logits: [tokens, E] -> (ids [tokens, k], weights [tokens, k] float32).
    ``bonus`` ([E], cache-aware routing): added to the logits (to the scores of a sigmoid router, to
    the probabilities of ERNIE's bias-corrected one) for choosing experts only; the weights of the
    chosen experts come from the unbiased router. ``bias``: the selection-only correction bias of
    the sigmoid and ERNIE routers ([E], or ERNIE's stored [1, E]). ``fn``: the router function
    (default: the config's, from ROUTERS)."""
    ids, w = (fn or ROUTERS[cfg.router])(logits.float(), cfg, bias, bonus)
    return ids, (w if cfg.routed_scaling_factor == 1 else w * cfg.routed_scaling_factor)
