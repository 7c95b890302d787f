"""The MoE block in stages (vLLM's modular fused-MoE split): route -> dispatch (tokens sorted by
expert; the store says which experts are on the device, which stream in, which the host computes)
-> experts -> combine (weights, the latent projection back, shared experts).

``ExpertExecutor`` is the one piece every MoE layer shares: the codec that turns a stored blob into
float operands, the expert FFN, and the host worker of hybrid execution."""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ... import kernels
from ...kernels.moe import HostMoE, unsupported
from ...quant import ExpertCodec
from ..config import MoEConfig
from ..convert import correction_bias_name, router_name
from .context import ForwardContext
from .mlp import DenseMLP
from .router import ROUTERS, hash_weights, route
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


class ExpertExecutor:
    """Computes experts from their store tensors. Float operands of an expert come from its blob:
    views for float stores, dequantized into one reused scratch for quantized ones (runtime/quant.py)."""

    def __init__(self, cfg: MoEConfig, store, dtype, device, act_quant: str = "none") -> None:
        self.I, self.clamped = cfg.expert_intermediate, cfg.expert_act == "swiglu_clamp"
        self.silu_limit = cfg.swiglu_limit if cfg.expert_act == "silu_clamp" else 0.0
        self.limit, self.alpha = cfg.swiglu_limit, cfg.swiglu_alpha
        self.dtype = dtype
        self.codec = ExpertCodec(store.m.weights, dtype, device)
        self._host_codec = self._host_pool = None    # hybrid execution with CUDA (see host_job)
        self.host_worker_on_cpu = False   # tests: run the CUDA path's CPU worker on a CPU-only machine too
        # Experts on the CPU: one grouped kernel call per layer over the stored bytes (runtime/kernels);
        # None where the layout or the machine has no kernel (then the reference path below).
        self.kernel, self.kernel_off = host_kernel(cfg, store.m.weights, act_quant)
        # Half-precision experts computed in float32 by the reference path (a CPU): keep converted
        # copies of as many experts as the device tier holds, so an expert is widened once, not at
        # every step. The kernel reads them as stored: no copies.
        if self.codec.widen and (self.kernel is None or self.codec.device.type != "cpu"):
            slots = store.capacity_bytes()["device"] // store.m.blob_stride
            self.codec.cache_bytes = slots * self.codec.operand_bytes

    def ffn(self, t, x: torch.Tensor, out: "torch.Tensor | None" = None) -> torch.Tensor:
        """One expert on its tokens. t: ExpertWeights (compute dtype); x: [n, hidden or latent];
        out: where to write y (same shape as x), else a new tensor. Returns y."""
        I = self.I
        h = torch.mm(x, t.gate_up_t)                                     # h: [n, 2I] = gate | up
        if t.gate_up_bias is not None:
            h += t.gate_up_bias
        if self.clamped:   # gpt-oss: clamped SwiGLU with (up + 1)
            g = h[:, :I].clamp(max=self.limit)
            h = (h[:, I:].clamp(-self.limit, self.limit) + 1) * (g * torch.sigmoid(g * self.alpha))
        elif self.silu_limit:   # DeepSeek-V4: SwiGLU with the gate clamped from above and up to +-limit
            h = F.silu(h[:, :I].clamp(max=self.silu_limit)) * h[:, I:].clamp(-self.silu_limit, self.silu_limit)
        else:
            h = F.silu(h[:, :I]) * h[:, I:]                              # h: [n, I]
        if out is None or out.dtype != h.dtype:   # e.g. float32 experts of a bf16 model: rounded into out
            y = torch.mm(h, t.down_t) if t.down_bias is None else torch.addmm(t.down_bias, h, t.down_t)
            return y if out is None else out.copy_(y)
        if t.down_bias is None:
            return torch.mm(h, t.down_t, out=out)                       # out: [n, hidden or latent]
        return torch.addmm(t.down_bias, h, t.down_t, out=out)

    def host_job(self, fetch, xs: torch.Tensor, off: list):
        """Hybrid execution: experts the store computes on the host, from their host-tier slots
        (``fetch.on_host``). Without CUDA the host is the device: returns None and the wave loop
        computes them from the host views like any other expert (no copy). With CUDA: their token
        rows cross to the CPU once, a CPU worker computes them while the device computes the rest,
        and the returned callable waits and writes their outputs into ``ys`` (one copy back)."""
        store = fetch.store
        if xs.device.type == "cpu" and not self.host_worker_on_cpu:
            return None
        host = [e for e in fetch.experts if e in fetch.host]
        if self._host_codec is None:
            from concurrent.futures import ThreadPoolExecutor
            self._host_codec = ExpertCodec(store.m.weights, self.dtype, "cpu")
            self._host_pool = ThreadPoolExecutor(1, thread_name_prefix="tiered-moe-host-experts")
        spans = [(off[e], off[e + 1]) for e in host]
        idx = torch.cat([torch.arange(a, b) for a, b in spans]).to(xs.device)
        cd = torch.float32 if self.kernel is not None else self._host_codec.compute_dtype
        x_cpu = xs.index_select(0, idx).to("cpu", cd).contiguous()     # x_cpu: [n, hidden or latent]

        def work():
            t0 = time.perf_counter()
            y = torch.empty_like(x_cpu)
            row0 = np.cumsum([0] + [b - a for a, b in spans[:-1]]).tolist()
            self.grouped(self._host_codec, [fetch.tensors(e) for e in host], row0, [b - a for a, b in spans],
                         x_cpu, y)                                    # views of the host slots
            store.record_host_compute(time.perf_counter() - t0)
            return y
        fut = self._host_pool.submit(work)

        def finish(ys: torch.Tensor) -> None:
            ys.index_copy_(0, idx, fut.result().to(ys.device, ys.dtype))
        return finish

    def run(self, m: int, fetch, xs: torch.Tensor, off: list) -> torch.Tensor:
        """Experts of MoE layer ``m`` on their sorted rows xs [T*k, hidden or latent] -> ys. Resident
        experts first while misses stream in; in waves when they do not all fit."""
        codec = self.codec
        if self.kernel is not None and xs.device.type == "cpu" and not self.host_worker_on_cpu:
            return self.run_host(fetch, xs, off)
        ys = torch.empty_like(xs)             # outputs in the model's dtype
        if xs.dtype != codec.compute_dtype:   # e.g. bf16 model, float32 expert matmuls on a CPU
            xs = xs.to(codec.compute_dtype)
        host_job = self.host_job(fetch, xs, off) if fetch.host else None
        for wave in fetch.waves():
            for e in wave:
                on_host = e in fetch.host
                if on_host and host_job is not None:
                    continue                     # on a CPU worker (see host_job)
                t0 = time.perf_counter() if on_host else 0.0
                # Host-computed experts convert into scratch: kept, they would push the device tier's
                # experts out of the converted-operand cache (sized to the device tier).
                t = codec.weights(fetch.tensors(e), None if on_host else (m, e))
                a, b = off[e], off[e + 1]
                self.ffn(t, xs[a:b], ys[a:b])
                if on_host:
                    fetch.store.record_host_compute(time.perf_counter() - t0)
        if host_job is not None:
            host_job(ys)
        return ys

    def grouped(self, codec, views: list, row0: list, rows: list, xs: torch.Tensor, ys: torch.Tensor) -> None:
        """Experts on the CPU: views[j] (blob views) on xs[row0[j] : row0[j] + rows[j]] -> ys (float32,
        contiguous). One kernel call for every expert of decode size; an expert with more rows
        (prefill) through the reference path, whose BLAS matmul wins there."""
        most = self.kernel.max_rows
        small = [j for j, n in enumerate(rows) if 0 < n <= most]
        if small:
            self.kernel.run([views[j] for j in small], [row0[j] for j in small], [rows[j] for j in small], xs, ys)
        for j, n in enumerate(rows):
            if n > most:
                a = row0[j]
                self.ffn(codec.weights(views[j]), xs[a:a + n].to(codec.compute_dtype), ys[a:a + n])

    def run_fused(self, fetch, xin: torch.Tensor, d: "Dispatch", wts: torch.Tensor) -> "torch.Tensor | None":
        """Decode on a CPU: the layer's whole routed part - gather of the token rows, every expert,
        the weighted sum per token - in one kernel call. xin: [T, hidden or latent] float32; wts:
        [T, k]. Returns [T, hidden or latent], or None where the general path must run (waves,
        experts still streaming in, an expert with more rows than the kernel takes, another dtype)."""
        k = self.kernel
        if (k is None or xin.device.type != "cpu" or xin.dtype != torch.float32 or self.host_worker_on_cpu
                or fetch.plan is not None or fetch.pending or max(d.counts, default=0) > k.max_rows):
            return None
        T = wts.shape[0]
        xs = torch.empty(len(d.tok), xin.shape[1])                      # xs: gathered rows [T*k, in] (scratch)
        ys = torch.empty(len(d.tok), k.args.H_out)
        out = torch.empty(T, k.args.H_out)
        t0 = time.perf_counter()
        k.run([fetch.tensors(e) for e in d.used], [d.off[e] for e in d.used], d.counts, xs, ys,
              gather=(xin.contiguous(), d.tok), combine=(d.back, wts.float().contiguous(), out))
        _record_host_share(fetch, d.used, d.counts, t0)
        return out

    def run_host(self, fetch, xs: torch.Tensor, off: list) -> torch.Tensor:
        """``run`` on a CPU: per wave, the experts already in place in one grouped call, then those
        still streaming in (a stand-in device slab) in a second."""
        x32 = xs.float().contiguous()                 # x32: [T*k, hidden or latent]
        ys = torch.empty_like(x32)
        for wave in fetch.waves():
            for group in ([e for e in wave if e not in fetch.pending], [e for e in wave if e in fetch.pending]):
                if not group:
                    continue
                t0 = time.perf_counter()
                rows = [off[e + 1] - off[e] for e in group]
                self.grouped(self.codec, [fetch.tensors(e) for e in group], [off[e] for e in group], rows, x32, ys)
                _record_host_share(fetch, group, rows, t0)
        return ys if xs.dtype == torch.float32 else ys.to(xs.dtype)


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


def weighted_sum(ys: torch.Tensor, back: torch.Tensor, wts: torch.Tensor) -> torch.Tensor:
    """The expert outputs ys [T*k, out] (sorted rows) back in (token, slot) order, each token's k summed
    by its weights wts [T, k] (cheaper than index_add_ on CPU) -> [T, out]."""
    T, k = wts.shape
    return (ys[back].view(T, k, -1) * wts[:, :, None].to(ys.dtype)).sum(1)


def _record_host_share(fetch, experts: list, rows: list, t0: float) -> None:
    """Hybrid execution's host compute time: a grouped call's time since ``t0``, by the share of its
    rows that host-tier experts had (device and host experts run in the same call on a CPU)."""
    host_rows = sum(n for e, n in zip(experts, rows) if e in fetch.host) if fetch.host else 0
    if host_rows:
        fetch.store.record_host_compute((time.perf_counter() - t0) * host_rows / max(1, sum(rows)))


def host_kernel(cfg: MoEConfig, weights: list, act_quant: str = "none"):
    """(HostMoE or None, why not): the grouped CPU kernel for this expert layout."""
    if kernels.lib() is None:
        kernels.warn_once()
        return None, kernels.unavailable()
    why = unsupported(weights, cfg.expert_in, cfg.expert_intermediate)
    if why is not None:
        return None, why
    act = {"swiglu_clamp": "swiglu_clamp", "silu_clamp": "silu_clamp"}.get(cfg.expert_act, "swiglu")
    H_out = next(w.shape[0] for w in weights if w.name == "down")
    return HostMoE(weights, cfg.expert_in, cfg.expert_intermediate, H_out, act, cfg.swiglu_limit, cfg.swiglu_alpha,
                   act_quant), None


_NO_HOOKS = ForwardContext(seqs=[], spans=[], decode=False, kv=None)


class MoEBlock:
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
        self.shared = DenseMLP(w, layer_prefix(i) + cfg.shared_prefix,
                               limit=cfg.swiglu_limit if cfg.expert_act == "silu_clamp" else 0.0) \
            if cfg.shared_intermediate else None
        self.shared_gate = Linear(take_raw(w, layer_prefix(i) + "mlp.shared_expert_gate.weight"), None, dt) \
            if cfg.shared_expert_gate else None

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
        elif cfg.router in ("sigmoid_group", "sqrtsoftplus"):
            out[correction_bias_name(cfg, i)] = (E,)
        elif cfg.router == "softmax_bias":   # ERNIE 4.5 stores it [1, E] (one group of experts)
            out[correction_bias_name(cfg, i)] = (1, E)
        if cfg.shared_intermediate:
            out.update(DenseMLP.tensors(p + cfg.shared_prefix, cfg.shared_intermediate, H))
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

    def route_preview(self, x: torch.Tensor, tokens: "torch.Tensor | None" = None) -> torch.Tensor:
        """The experts this block would route ``x`` to, by the code its forward runs (lookahead prefetch)."""
        return self.route(x, tokens=tokens)[0]

    def _bonus(self, ctx: ForwardContext, device) -> "torch.Tensor | None":
        # Cache-aware routing: resident experts look better by cache_bonus (off by default: it
        # changes the model's outputs; bench/exp_cache_routing.py measures by how much).
        if not ctx.cache_bonus:
            return None
        res = self.store.resident(self.moe_idx)
        if not res:
            return None
        bonus = torch.zeros(self.cfg.num_experts, device=device)
        bonus[res] = ctx.cache_bonus
        return bonus

    def combine(self, ys: torch.Tensor, d: Dispatch, wts: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Back to (token, slot) order, then each token's k expert outputs summed by weight
        (cheaper than index_add_ on CPU); then ``finish``."""
        return self.finish(weighted_sum(ys, d.back, wts), x)

    def finish(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The routed sum ``out`` [T, hidden or latent] -> the block's output: the latent projection
        back and the shared experts."""
        if self.latent_up is not None:
            out = F.linear(out, self.latent_up)
        if self.shared is not None:
            sh = self.shared(x)
            if self.shared_gate is not None:
                sh = sh * torch.sigmoid(self.shared_gate(x))
            out = out + sh
        return out

    def __call__(self, x: torch.Tensor, ctx: "ForwardContext | None" = None) -> torch.Tensor:
        """x: [tokens, hidden] -> [tokens, hidden]. Without a context: step 0, no hooks, no bonus."""
        ctx = ctx or _NO_HOOKS
        m = self.moe_idx
        ids, wts = self.route(x, self._bonus(ctx, x.device), ctx.tokens)
        if ctx.record is not None:
            ctx.record(m, ids)
        wts = wts.to(self.executor.dtype)
        d = dispatch(ids, self.cfg.num_experts, x.device)
        fetch = self.store.request(m, d.used, ctx.step, d.counts)       # tokens per expert: hybrid decisions weigh them
        xin = x if self.latent_down is None else F.linear(x, self.latent_down)   # xin: [tokens, hidden or latent]
        out = self.executor.run_fused(fetch, xin, d, wts)
        if out is not None:
            out = self.finish(out.to(x.dtype), x)
        else:
            ys = self.executor.run(m, fetch, xin[d.tok], d.off)         # rows: [T*k, hidden or latent]
            out = self.combine(ys, d, wts, x)
        if ctx.after_moe is not None:
            ctx.after_moe(m, d.used, x)
        return out
