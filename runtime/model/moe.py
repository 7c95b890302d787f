"""A decoder-only MoE transformer whose routed experts come from the expert store.

The model runs forward passes and nothing else: it knows no scheduling, no sockets, and no
residency - it asks an expert provider (``ExpertStore``) for a layer's experts and computes the
resident ones first while misses stream in. Dense weights (attention, norms, router, shared
expert, embeddings) stay in memory.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .config import MoEConfig


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in float32 as the reference implementations do, then cast back.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def route(logits: torch.Tensor, cfg: MoEConfig, bias: "torch.Tensor | None" = None):
    """Router variants. logits: [tokens, E] -> (ids [tokens, k], weights [tokens, k] float32)."""
    k = cfg.top_k
    lf = logits.float()
    if cfg.router == "softmax_topk":        # Mixtral, Qwen-MoE, OLMoE: softmax over all, then top-k
        p = lf.softmax(-1)
        w, ids = p.topk(k, dim=-1)
        if cfg.norm_topk_prob:
            w = w / w.sum(-1, keepdim=True)
    elif cfg.router == "topk_softmax":      # top-k of the logits, softmax over the chosen
        top, ids = lf.topk(k, dim=-1)
        w = top.softmax(-1)
    else:                                   # DeepSeek-V3 / Kimi K2: sigmoid, bias-corrected group-limited top-k
        s = lf.sigmoid()
        sel = s + (bias.float() if bias is not None else 0.0)
        T, E = sel.shape
        g = sel.view(T, cfg.n_group, E // cfg.n_group)
        group_score = g.topk(min(2, E // cfg.n_group), dim=-1).values.sum(-1)          # [T, n_group]
        keep = torch.zeros_like(group_score).scatter_(1, group_score.topk(cfg.topk_group, dim=-1).indices, 1.0)
        mask = keep.unsqueeze(-1).expand_as(g).reshape(T, E)
        ids = sel.masked_fill(mask == 0, float("-inf")).topk(k, dim=-1).indices
        w = s.gather(1, ids)                # weights from the uncorrected scores
        if cfg.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return ids, w * cfg.routed_scaling_factor


@dataclass
class Sequence:
    """One sequence's KV cache: per layer k, v as [kv_heads, tokens, head_dim]."""

    kv: list = field(default_factory=list)
    length: int = 0


class MoEModel:
    def __init__(self, cfg: MoEConfig, dense: dict, experts, *, device: str = "cpu", dtype=torch.float32) -> None:
        self.cfg, self.experts, self.device, self.dtype = cfg, experts, device, dtype
        self.w = {k: v.to(device=device, dtype=dtype) for k, v in dense.items()}
        hd = cfg.head_dim
        self.inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float().to(device) / hd))
        self.moe_index = {layer: i for i, layer in enumerate(cfg.moe_layers)}
        self.step = 0                     # placement time; the engine advances it once per step
        self.record = None                # callable(moe_idx, ids [tokens, k]) when the engine records routing
        self.prefetch_hook = None         # callable(moe_idx, ids, hidden) after each MoE layer

    # -- names of the dense tensors -----------------------------------------------------------
    def _p(self, i: int, name: str) -> str:
        return f"model.layers.{i}.{name}"

    def _router_name(self, i: int) -> str:
        return self._p(i, "block_sparse_moe.gate.weight" if self.cfg.model_type == "mixtral" else "mlp.gate.weight")

    # -- blocks --------------------------------------------------------------------------------
    def _rope(self, pos: torch.Tensor):
        freqs = pos.float()[:, None] * self.inv_freq[None, :]           # freqs: [tokens, hd/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    def _attention(self, i: int, x: torch.Tensor, seqs: list, spans: list) -> torch.Tensor:
        """x: [tokens, hidden], tokens of several sequences back to back (spans: (start, end))."""
        cfg, w = self.cfg, self.w
        hd, nh, nkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        q = F.linear(x, w[self._p(i, "self_attn.q_proj.weight")], w.get(self._p(i, "self_attn.q_proj.bias")))
        k = F.linear(x, w[self._p(i, "self_attn.k_proj.weight")], w.get(self._p(i, "self_attn.k_proj.bias")))
        v = F.linear(x, w[self._p(i, "self_attn.v_proj.weight")], w.get(self._p(i, "self_attn.v_proj.bias")))
        if cfg.qk_norm == "full":
            q = rms_norm(q, w[self._p(i, "self_attn.q_norm.weight")], cfg.rms_norm_eps)
            k = rms_norm(k, w[self._p(i, "self_attn.k_norm.weight")], cfg.rms_norm_eps)
        q = q.view(-1, nh, hd)                                          # q: [tokens, heads, hd]
        k = k.view(-1, nkv, hd)
        v = v.view(-1, nkv, hd)
        if cfg.qk_norm == "head":
            q = rms_norm(q, w[self._p(i, "self_attn.q_norm.weight")], cfg.rms_norm_eps)
            k = rms_norm(k, w[self._p(i, "self_attn.k_norm.weight")], cfg.rms_norm_eps)
        out = torch.empty_like(q)
        for s, (a, b) in zip(seqs, spans):
            pos = torch.arange(s.length, s.length + (b - a), device=x.device)
            cos, sin = self._rope(pos)
            qs = q[a:b] * cos[:, None] + rotate_half(q[a:b]) * sin[:, None]
            ks = k[a:b] * cos[:, None] + rotate_half(k[a:b]) * sin[:, None]
            ks, vs = ks.transpose(0, 1), v[a:b].transpose(0, 1)           # [kv_heads, new, hd]
            if len(s.kv) > i:
                pk, pv = s.kv[i]
                ks, vs = torch.cat([pk, ks], 1), torch.cat([pv, vs], 1)
                s.kv[i] = (ks, vs)
            else:
                s.kv.append((ks, vs))
            rep = nh // nkv
            kk = ks.repeat_interleave(rep, 0)                            # kk: [heads, ctx, hd]
            vv = vs.repeat_interleave(rep, 0)
            qq = qs.transpose(0, 1)                                      # qq: [heads, new, hd]
            att = (qq @ kk.transpose(1, 2)) / math.sqrt(hd)              # att: [heads, new, ctx]
            n_new, ctx = b - a, kk.shape[1]
            causal = torch.arange(ctx, device=x.device)[None, :] <= (torch.arange(n_new, device=x.device)[:, None] + ctx - n_new)
            att = att.masked_fill(~causal, float("-inf")).float().softmax(-1).to(self.dtype)
            out[a:b] = (att @ vv).transpose(0, 1)
        return F.linear(out.reshape(-1, nh * hd), w[self._p(i, "self_attn.o_proj.weight")])

    def _mlp(self, prefix: str, x: torch.Tensor) -> torch.Tensor:
        w = self.w
        return F.linear(F.silu(F.linear(x, w[prefix + "gate_proj.weight"])) * F.linear(x, w[prefix + "up_proj.weight"]),
                        w[prefix + "down_proj.weight"])

    def _moe(self, i: int, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        m = self.moe_index[i]
        logits = F.linear(x, self.w[self._router_name(i)])              # logits: [tokens, E]
        ids, wts = route(logits, cfg, self.w.get(self._p(i, "mlp.gate.e_score_correction_bias")))
        if self.record is not None:
            self.record(m, ids)
        wts = wts.to(self.dtype)
        used = torch.unique(ids).tolist()
        fetch = self.experts.request(m, used, self.step)
        xin = x
        if cfg.latent_dim:   # LatentMoE: experts run in a smaller latent space
            xin = F.linear(x, self.w[self._p(i, "block_sparse_moe.latent_down.weight")])   # xin: [tokens, latent]
        out = torch.zeros_like(xin)
        # Resident experts first while misses stream in; in waves when they do not all fit.
        for wave in fetch.waves():
            for e in wave:
                t = fetch.tensors(e)
                tok, slot = (ids == e).nonzero(as_tuple=True)           # tokens routed to e
                xe = xin[tok]                                            # xe: [n, hidden or latent]
                h = F.silu(F.linear(xe, t["gate"])) * F.linear(xe, t["up"])
                out.index_add_(0, tok, F.linear(h, t["down"]) * wts[tok, slot, None])
        if cfg.latent_dim:
            out = F.linear(out, self.w[self._p(i, "block_sparse_moe.latent_up.weight")])
        if cfg.shared_intermediate:
            sh = self._mlp(self._p(i, "mlp.shared_expert."), x)
            if cfg.shared_expert_gate:
                sh = sh * torch.sigmoid(F.linear(x, self.w[self._p(i, "mlp.shared_expert_gate.weight")]))
            out = out + sh
        if self.prefetch_hook is not None:
            self.prefetch_hook(m, used, x)
        return out

    @torch.inference_mode()
    def forward(self, seqs: list, chunks: list) -> torch.Tensor:
        """Run new tokens of several sequences. chunks[j]: token ids of seqs[j] (prefill chunk or one
        decode token). Returns logits of each chunk's last token: [len(seqs), vocab]."""
        cfg, w = self.cfg, self.w
        flat = [t for c in chunks for t in c]
        spans, a = [], 0
        for c in chunks:
            spans.append((a, a + len(c)))
            a += len(c)
        x = w["model.embed_tokens.weight"][torch.tensor(flat, device=self.device)]  # x: [tokens, hidden]
        for i in range(cfg.num_layers):
            h = rms_norm(x, w[self._p(i, "input_layernorm.weight")], cfg.rms_norm_eps)
            x = x + self._attention(i, h, seqs, spans)
            h = rms_norm(x, w[self._p(i, "post_attention_layernorm.weight")], cfg.rms_norm_eps)
            x = x + (self._moe(i, h) if i in self.moe_index else self._mlp(self._p(i, "mlp."), h))
        for s, c in zip(seqs, chunks):
            s.length += len(c)
        last = torch.tensor([b - 1 for _, b in spans], device=self.device)
        h = rms_norm(x[last], w["model.norm.weight"], cfg.rms_norm_eps)
        head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
        return F.linear(h, head).float()
