"""DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5; transformers' ``DeepseekV32Indexer`` / ``GlmMoeDsaIndexer``):
MLA (layers/mla.py) in which each query attends only to the ``index_topk`` cached keys a lightning indexer picks.

The indexer of a layer has its own projections. For each token t of a sequence it keeps a key
k_t = RoPE(LayerNorm(W_k x_t)) of ``index_head_dim`` channels (a LayerNorm with weight and bias, eps 1e-6; RoPE
on the first ``qk_rope_head_dim`` channels at t's position - rotate-half in DeepSeek-V3.2, interleaved pairs in
GLM-5 - the rest as they are) in the sequence's cache. A query at position s has ``index_n_heads`` heads
q_{s,h} = RoPE(W_qb r_s), from MLA's q LoRA residual r_s = q_a_layernorm(q_a_proj(x_s)), and weights
w_{s,h} = (W_w x_s)_h / sqrt(index_n_heads) (float32). Key t scores

    I(s, t) = sum_h w_{s,h} ReLU(q_{s,h} . k_t / sqrt(index_head_dim))        (float32)

and the query keeps the ``index_topk`` best of the keys it may see (t <= s): every one of them while there are
no more than that. MLA then attends to the kept keys only. GLM-5's "shared" layers have no indexer: they
attend to the keys the layer before them kept (its pick, which a shared layer passes on in turn).

What a layer with an indexer caches (``IndexedCacheSpec``): per token MLA's latent and rotary key and the
indexer's key, both rows of the sequence's KV blocks, so chunked prefill, batched decode and the prefix cache's
shared blocks hold them alike. The fused CPU decode has no indexer: these layers decode composed."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..config import MoEConfig
from .cache import CacheTensor
from .context import ForwardContext
from .mla import MLAttention, projection
from .rope import _rotate, rope_interleaved
from .weights import layer_prefix, take, take_raw

INDEX_NORM_EPS = 1e-6          # transformers' indexer k_norm: nn.LayerNorm(index_head_dim, eps=1e-6)
PICK = "dsa_pick"              # ForwardContext.masks key of the last indexer's pick (a shared layer's)
# float32 scores [rows, heads, keys] computed at once: bounds the indexer's memory on a long context
SCORE_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class IndexedCacheSpec:
    """What an MLA layer with an indexer caches per token: one "head" of ``dim`` (latent + rotary key, as
    MLA's ``TokenCacheSpec``) and the indexer's key of ``index_dim``."""
    dim: int
    index_dim: int

    def bytes_per_token(self, dtype) -> int:
        return (self.dim + self.index_dim) * torch.tensor([], dtype=dtype).element_size()

    def cache_tensors(self) -> dict:
        """k: [token slots, 1, dim] (MLA's), ik: [token slots, index_dim] - a row per position in the blocks."""
        return {"k": CacheTensor((1, self.dim), "block"), "ik": CacheTensor((self.index_dim,), "block")}


class Indexer:
    """The lightning indexer of layer ``i``: its keys into the layer's cache (``ik``), and each query's pick."""

    def __init__(self, cfg: MoEConfig, i: int, w: dict) -> None:
        p = layer_prefix(i) + "self_attn.indexer."
        d = cfg.dsa
        self.i, self.nh, self.dim, self.rd, self.topk = i, d.n_heads, d.head_dim, d.rope_head_dim, d.topk
        self.rot = rope_interleaved if d.rope_interleave else _rotate
        self.wq_b, self.wk = projection(w, p + "wq_b.weight"), projection(w, p + "wk.weight")
        self.k_norm = (take(w, p + "k_norm.weight"), take(w, p + "k_norm.bias"))
        self.w_heads = take_raw(w, p + "weights_proj.weight").float()   # float32, as transformers keeps it

    @staticmethod
    def tensors(cfg: MoEConfig, i: int) -> dict:
        p, d = layer_prefix(i) + "self_attn.indexer.", cfg.dsa
        return {p + "wq_b.weight": (d.n_heads * d.head_dim, cfg.q_lora_rank),
                p + "wk.weight": (d.head_dim, cfg.hidden_size), p + "k_norm.weight": (d.head_dim,),
                p + "k_norm.bias": (d.head_dim,), p + "weights_proj.weight": (d.n_heads, cfg.hidden_size)}

    def _rope(self, t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE on the first ``rd`` channels of t [..., dim]; cos, sin broadcast over t's [..., rd]."""
        return torch.cat([self.rot(t[..., :self.rd], cos, sin), t[..., self.rd:]], dim=-1)

    def keys(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [n, hidden] at the positions of cos, sin [n, rope] -> their keys [n, dim]."""
        return self._rope(F.layer_norm(self.wk(x), (self.dim,), *self.k_norm, eps=INDEX_NORM_EPS), cos, sin)

    def queries(self, q_res: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """q_res: [n, q_lora] -> the queries [n, heads, dim]."""
        return self._rope(self.wq_b(q_res).view(-1, self.nh, self.dim), cos[:, None], sin[:, None])

    def _pick_block(self, x, q, keys, visible) -> torch.Tensor:
        """x [B, S, hidden], q [B, S, heads, dim], keys [B, T, dim], visible [B, S, T] -> [B, S, T] bool: each
        query's top-k of the keys it may see, in transformers' order of operations (its float32 scores, its shapes),
        so a near tie falls the same way."""
        kt = keys.float().transpose(-1, -2).unsqueeze(1)                 # kt: [B, 1, dim, T]
        s = F.relu(torch.matmul(q.float(), kt) * self.dim ** -0.5)       # s: [B, S, heads, T]
        w = F.linear(x.float(), self.w_heads) * self.nh ** -0.5          # w: [B, S, heads]
        score = torch.matmul(w.unsqueeze(-2), s).squeeze(-2)             # score: [B, S, T]
        score = score.masked_fill(~visible, float("-inf"))
        top = score.topk(min(self.topk, score.shape[-1]), dim=-1).indices   # top: [B, S, k]
        return torch.zeros_like(visible).scatter_(-1, top, True) & visible

    def pick(self, x, q, keys, visible) -> torch.Tensor:
        """``_pick_block`` over blocks of rows (S of one sequence's prefill, else B), SCORE_ELEMENTS scores at most."""
        B, S, T = visible.shape
        step = max(1, SCORE_ELEMENTS // (self.nh * T))
        if B * S <= step:
            return self._pick_block(x, q, keys, visible)
        if S == 1:
            return torch.cat([self._pick_block(x[a:a + step], q[a:a + step], keys[a:a + step], visible[a:a + step])
                              for a in range(0, B, step)])
        return torch.cat([self._pick_block(x[:, a:a + step], q[:, a:a + step], keys, visible[:, a:a + step])
                          for a in range(0, S, step)], 1)

    def __call__(self, x: torch.Tensor, q_res: torch.Tensor, ctx: ForwardContext):
        """The new tokens' keys into the cache, then what their queries keep: decode [B, n] over ``ctx.read``;
        prefill one [new, ctx] per sequence (``MLAttention._attend``'s ``keep``)."""
        ik = ctx.kv[self.i].ik                                           # ik: [token slots, dim]
        dev = x.device
        if ctx.decode:
            cos, sin = ctx.rope                                          # cos, sin: [B, rope]
            ik[ctx.write] = self.keys(x, cos, sin)
            n = ctx.read.shape[1]
            visible = torch.arange(n, device=dev)[None, :] <= ctx.pos[:, None]          # visible: [B, n]
            q = self.queries(q_res, cos, sin)                            # q: [B, heads, dim]
            return self.pick(x[:, None], q[:, None], ik[ctx.read], visible[:, None])[:, 0]
        out = []
        for s, (a, b), (w_idx, r_idx), (cos, sin) in zip(ctx.seqs, ctx.spans, ctx.prefill, ctx.rope):
            ik[w_idx] = self.keys(x[a:b], cos, sin)                      # cos, sin: [new, rope]
            pos = torch.arange(s.length, s.length + b - a, device=dev)
            visible = torch.arange(r_idx.shape[0], device=dev)[None, :] <= pos[:, None]   # visible: [new, ctx]
            q = self.queries(q_res[a:b], cos, sin)                       # q: [new, heads, dim]
            out.append(self.pick(x[None, a:b], q[None], ik[r_idx][None], visible[None])[0])
        return out


class DSAttention(MLAttention):
    """MLA of layer ``i`` attending to its indexer's pick (or, on a shared layer, the layer before's)."""
    fused_part = None
    reads_rope_heads = False   # (MLA's fused decode reads them; this layer decodes composed, from ctx.rope)

    def __init__(self, cfg: MoEConfig, i: int, w: dict) -> None:
        super().__init__(cfg, i, w)
        self.indexer = None if i in cfg.dsa.shared else Indexer(cfg, i, w)

    def fused_refusal(self) -> str:
        return "DeepSeek sparse attention (the fused MLA decode attends to every cached key; no indexer)"

    @staticmethod
    def cache_spec(cfg: MoEConfig, i: int):
        """MLA's per-token latent, with the indexer's key on a layer that has one."""
        if i in cfg.dsa.shared:
            return MLAttention.cache_spec(cfg, i)
        m = cfg.mla
        return IndexedCacheSpec(m.kv_lora_rank + m.qk_rope_head_dim, cfg.dsa.head_dim)

    @staticmethod
    def tensors(cfg: MoEConfig, i: int) -> dict:
        out = MLAttention.tensors(cfg, i)
        if i not in cfg.dsa.shared:
            out.update(Indexer.tensors(cfg, i))
        return out

    def __call__(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        q_res = self.q_a_norm(self.q_a(x))                               # q_res: [tokens, q_lora]
        q = self._scale_q(self.q_b(q_res).view(-1, self.nh, self.nope + self.rope), ctx)   # q: [tokens, heads, qk]
        if self.indexer is not None:
            ctx.masks[PICK] = self.indexer(x, q_res, ctx)
        elif PICK not in ctx.masks:
            raise ValueError(f"layer {self.i} reuses the top-k of the layer before it, which did not run in this "
                             f"forward (a pipeline stage cannot start at a shared DSA layer)")
        return self._attend(x, q, ctx, ctx.masks[PICK])
