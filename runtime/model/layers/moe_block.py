"""The MoE block in stages (vLLM's modular fused-MoE split): route -> dispatch (tokens sorted by
expert) -> request (the store says which experts are on the device, which stream in, which the host
computes; the step's hooks hear of the routing here) -> experts (layers/experts.py) -> combine (weights,
the latent projection back, shared experts). The fused CPU decode (layers/fused.py) runs the same
``request`` and ``shared_out`` stages around its kernel calls."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ..config import MoEConfig
from ..names import correction_bias_name, router_name
from .context import ForwardContext
from .experts import ExpertExecutor, weighted_sum
from .mlp import mlp_kind
from .protocol import Sublayer
from .router import CORRECTION_BIAS, ROUTERS, hash_weights, route
from .dense import Linear
from .weights import compute_dtype, layer_prefix, take, take_opt, take_raw


@dataclass(frozen=True)
class Dispatch:
    """A layer's (token, slot) pairs sorted by expert, so each expert reads a contiguous slice."""
    used: list             # experts with at least one token, ascending
    counts: list           # tokens of each used expert
    off: list              # off[e]:off[e + 1] - expert e's rows in the sorted order
    tok: torch.Tensor      # token of each sorted row [T*k]
    back: torch.Tensor     # sorted row of each (token, slot) [T*k]


def dispatch(ids: torch.Tensor, num_experts: int, device) -> Dispatch:
    """ids: [T, k]. The store needs the experts on the host anyway: one copy of the ids there, and
    the bookkeeping in numpy (a few us per call where each torch op of a tiny tensor costs 5-10 us)."""
    k = ids.shape[1]
    flat = ids.cpu().numpy().reshape(-1)                                 # flat: [T*k]
    order = np.argsort(flat, kind="stable")                              # the same permutation as torch's stable sort
    counts = np.bincount(flat, minlength=num_experts)
    used = np.flatnonzero(counts).tolist()
    back = np.empty_like(order)
    back[order] = np.arange(order.size)                                  # sorted position of each (token, slot)
    return Dispatch(used=used, counts=counts[used].tolist(), off=[0] + np.cumsum(counts).tolist(),
                    tok=torch.from_numpy(order // k).to(device), back=torch.from_numpy(back).to(device))


def check_hash_table(t: torch.Tensor, cfg: MoEConfig, name: str) -> None:
    """A token -> experts table [vocab, top_k]: experts in range and distinct per token (a token's k
    experts are k different ones in routing, traces and replay); else an error naming the tensor."""
    if tuple(t.shape) != (cfg.vocab_size, cfg.top_k):
        raise ValueError(f"{cfg.source}: {name} has shape {tuple(t.shape)}, expected ({cfg.vocab_size}, {cfg.top_k})")
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= cfg.num_experts):
        raise ValueError(f"{cfg.source}: {name} names experts outside [0, {cfg.num_experts})")
    s = t.sort(1).values
    dup = (s[:, 1:] == s[:, :-1]).any(1).nonzero()
    if len(dup):
        r = int(dup[0])
        raise ValueError(f"{cfg.source}: {name} row {r} (token {r}) names expert(s) {t[r].tolist()}: the same expert "
                         f"twice for one token, which tiered-moe does not route")


_NO_CONTEXT = ForwardContext(seqs=[], spans=[], decode=False, kv=None)   # a block called alone: no hooks


class MoEBlock(Sublayer):
    """The routed experts of layer ``i`` (MoE layer ``moe_idx``), with its router, optional latent
    projection (Kimi K3's LatentMoE) and shared experts."""

    def __init__(self, cfg: MoEConfig, i: int, moe_idx: int, w: dict, store, executor: ExpertExecutor) -> None:
        self.cfg, self.i, self.moe_idx = cfg, i, moe_idx
        self.store, self.executor = store, executor
        rn = router_name(cfg, i)
        self.router_fn = ROUTERS[cfg.router]                             # chosen once, here
        rw = take_raw(w, rn)
        dt = compute_dtype(w, rw)
        self.router = Linear(rw, take_opt(w, rn[:-len("weight")] + "bias"), dt)   # gpt-oss: a bias
        self.correction = take_opt(w, correction_bias_name(cfg, i))      # sigmoid routers' selection bias
        # DeepSeek-V4's hash-routed layers: a token id -> experts table [vocab, top_k] picks the experts
        self.hash = take_raw(w, layer_prefix(i) + cfg.mlp_prefix + "gate.tid2eid").long() if i in cfg.hash_layers else None
        if self.hash is not None:
            check_hash_table(self.hash, cfg, f"{layer_prefix(i) + cfg.mlp_prefix}gate.tid2eid")
        p = layer_prefix(i) + cfg.mlp_prefix
        self.latent_down = take(w, p + "latent_down.weight") if cfg.latent_dim else None
        self.latent_up = take(w, p + "latent_up.weight") if cfg.latent_dim else None
        self.shared = mlp_kind(cfg)(w, layer_prefix(i) + cfg.shared_prefix,
                                    limit=cfg.swiglu_limit if cfg.expert_act == "silu_clamp" else 0.0) \
            if cfg.shared_intermediate else None
        self.shared_gate = Linear(take_raw(w, layer_prefix(i) + "mlp.shared_expert_gate.weight"), None, dt) \
            if cfg.shared_expert_gate else None

    def fused_refusal(self) -> "str | None":
        """The fused CPU decode (layers/fused.py) routes in its kernel and computes the experts there: it
        takes a block without a latent projection or a hash table whose experts have the one-call path."""
        if self.latent_down is not None or self.hash is not None:
            return "LatentMoE or hash routing"
        if self.cfg.router_scales_input:
            return "router-scaled expert input (Llama 4)"
        if not self.executor.backend.fused:
            return "experts without a host kernel, or not float32"
        return None

    @staticmethod
    def tensors(cfg: MoEConfig, i: int) -> dict:
        """The dense checkpoint tensors this block takes -> shape (its experts go to the store)."""
        H, E, p = cfg.hidden_size, cfg.num_experts, layer_prefix(i)
        out = {router_name(cfg, i): (E, H)}
        if cfg.router_bias:
            out[router_name(cfg, i).replace(".weight", ".bias")] = (E,)
        if cfg.latent_dim:
            out[p + cfg.mlp_prefix + "latent_down.weight"] = (cfg.latent_dim, H)
            out[p + cfg.mlp_prefix + "latent_up.weight"] = (H, cfg.latent_dim)
        if i in cfg.hash_layers:
            out[p + cfg.mlp_prefix + "gate.tid2eid"] = (cfg.vocab_size, cfg.top_k)
        elif cfg.router in CORRECTION_BIAS and cfg.correction_bias_tensor:    # "": a router without one (Flint)
            out[correction_bias_name(cfg, i)] = CORRECTION_BIAS[cfg.router](E)
        if cfg.shared_intermediate:
            out.update(mlp_kind(cfg).tensors(p + cfg.shared_prefix, cfg.shared_intermediate, H))
            if cfg.shared_expert_gate:
                out[p + "mlp.shared_expert_gate.weight"] = (1, H)
        return out

    # -- stages ----------------------------------------------------------------------------------
    def route(self, x: torch.Tensor, bonus: "torch.Tensor | None" = None, tokens: "torch.Tensor | None" = None):
        """x: [tokens, hidden] -> (ids [tokens, k], weights [tokens, k] float32). A hash-routed layer takes
        its experts from the table's rows of ``tokens`` (their ids [tokens]) and ignores the bonus."""
        logits = self.router(x)                                          # logits: [tokens, E]
        if self.hash is not None:
            if tokens is None or tokens.shape[0] != x.shape[0]:
                raise ValueError(f"layer {self.i} is hash-routed: it needs the token id of every row")
            ids = self.hash[tokens]
            return ids, hash_weights(logits, ids, self.cfg)
        return route(logits, self.cfg, self.correction, bonus, self.router_fn)

    @property
    def routes_by_token(self) -> bool:
        """Whether the token ids alone decide this block's experts (a hash table): known before the forward."""
        return self.hash is not None

    def known_experts(self, tokens: torch.Tensor) -> list:
        """The sorted experts a hash-routed block uses for ``tokens`` (ids [n])."""
        return torch.unique(self.hash[tokens]).tolist()

    def route_preview(self, x: torch.Tensor, tokens: "torch.Tensor | None" = None) -> torch.Tensor:
        """The experts this block would route ``x`` to, by the code its forward runs (lookahead prefetch)."""
        return self.route(x, tokens=tokens)[0]

    def _bonus(self, ctx: ForwardContext, device) -> "torch.Tensor | None":
        # Cache-aware routing: resident experts look better by cache_bonus (off by default: it
        # changes the model's outputs; bench/exp_cache_routing.py measures by how much).
        if not ctx.hooks.cache_bonus:
            return None
        res = self.store.resident(self.moe_idx)
        if not res:
            return None
        bonus = torch.zeros(self.cfg.num_experts, device=device)
        bonus[res] = ctx.hooks.cache_bonus
        return bonus

    def combine(self, ys: torch.Tensor, d: Dispatch, wts: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Back to (token, slot) order, then each token's k expert outputs summed by weight
        (cheaper than index_add_ on CPU); then ``finish``."""
        return self.finish(weighted_sum(ys, d.back, wts), x)

    def shared_out(self, x: torch.Tensor) -> "torch.Tensor | None":
        """The shared experts on x [tokens, hidden] (gated where the family gates them), or None."""
        if self.shared is None:
            return None
        sh = self.shared(x)
        if self.shared_gate is not None:
            sh = sh * torch.sigmoid(self.shared_gate(x))
        return sh

    def finish(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The routed sum ``out`` [T, hidden or latent] -> the block's output: the latent projection
        back and the shared experts."""
        if self.latent_up is not None:
            out = F.linear(out, self.latent_up)
        sh = self.shared_out(x)
        return out if sh is None else out + sh

    def request(self, ctx: ForwardContext, ids: torch.Tensor, used: list, counts: list, x: torch.Tensor):
        """After routing (ids [tokens, k]; ``used`` experts with ``counts`` tokens each): the routing is
        recorded, the store asked for the experts (misses start streaming in; tokens per expert weigh the
        hybrid decisions), and the step's ``routed`` hook told - before the experts compute, so the next
        layer's prefetch overlaps them. x: this block's input [tokens, hidden] (lookahead predicts from it)."""
        hooks, m = ctx.hooks, self.moe_idx
        if hooks.record is not None:
            hooks.record(m, ids)
        fetch = self.store.request(m, used, hooks.step, counts)
        if hooks.routed is not None:
            hooks.routed(m, used, x)
        return fetch

    def __call__(self, x: torch.Tensor, ctx: "ForwardContext | None" = None) -> torch.Tensor:
        """x: [tokens, hidden] -> [tokens, hidden]. Without a context: step 0, no hooks, no bonus."""
        ctx = ctx or _NO_CONTEXT
        ids, wts = self.route(x, self._bonus(ctx, x.device), ctx.tokens)
        wts = wts.to(self.executor.dtype)
        d = dispatch(ids, self.cfg.num_experts, x.device)
        fetch = self.request(ctx, ids, d.used, d.counts, x)
        xin = x if self.latent_down is None else F.linear(x, self.latent_down)   # xin: [tokens, hidden or latent]
        if self.cfg.router_scales_input:
            return self.finish(self._scaled_input(fetch, xin, d, wts), x)
        out = self.executor.run_fused(fetch, xin, d, wts)
        if out is not None:
            return self.finish(out.to(x.dtype), x)
        ys = self.executor.run(self.moe_idx, fetch, xin[d.tok], d.off)  # rows: [T*k, hidden or latent]
        return self.combine(ys, d, wts, x)

    def _scaled_input(self, fetch, xin: torch.Tensor, d: Dispatch, wts: torch.Tensor) -> torch.Tensor:
        """Llama 4's experts: each reads its token's row times the router weight (a SwiGLU expert is not linear: not
        the weight on its output), and a token's k outputs add up unweighted. xin: [T, in]; wts: [T, k] -> [T, out]."""
        T, k = wts.shape
        if k == 1:      # the released top-1: the rows scaled before the gather, the one-call path with weight 1
            out = self.executor.run_fused(fetch, xin * wts.to(xin.dtype), d, torch.ones_like(wts))
            if out is not None:
                return out.to(xin.dtype)
        w = torch.empty(T * k, dtype=xin.dtype, device=xin.device)
        w[d.back] = wts.reshape(-1).to(xin.dtype)                        # w: [T*k], each sorted row's weight
        ys = self.executor.run(self.moe_idx, fetch, xin[d.tok] * w[:, None], d.off)   # ys: [T*k, out] sorted
        return ys[d.back].view(T, k, -1).sum(1)
