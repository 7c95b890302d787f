"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2, Kimi-Linear's full layers). The cache holds,
per token, the normalised KV latent and the shared rotary key; prefill expands keys and values
from it through kv_b_proj, decode attends in the latent space (weight absorption)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..config import MoEConfig
from .attention import attention_extras, q_temperature
from .cache import TokenCacheSpec
from .context import ForwardContext
from .norm import RMSNorm
from .rope import _no_rotation, _rotate, mla_softmax_scale, rope_interleaved
from .dense import Linear
from .weights import compute_dtype, layer_prefix, linear_opts, take, take_raw
from .protocol import HeadSplit, Sublayer, cols, rows


# The latent norms (q_a_layernorm, kv_a_layernorm) use 1e-6 whatever the model's rms_norm_eps: so
# do DeepSeek's reference code and transformers' MLA for every architecture that has it (DeepSeek-V2/V3,
# Kimi-Linear, GLM-4.7-Flash), which ship rms_norm_eps 1e-6 or 1e-5.
LATENT_NORM_EPS = 1e-6


class MLAttention(Sublayer):
    reads_rope_heads = True    # the fused decode (layers/fused.py MLAPart) reads the step's cos / signed sin
    fused_part = "mla"

    def __init__(self, cfg: MoEConfig, i: int, w: dict) -> None:
        p = layer_prefix(i) + "self_attn."
        self.i, self.eps, m = i, LATENT_NORM_EPS, cfg.mla
        self.nh, self.nope, self.rope, self.vd, self.lat = (cfg.num_heads, m.qk_nope_head_dim, m.qk_rope_head_dim,
                                                            m.v_head_dim, m.kv_lora_rank)
        self.scale = mla_softmax_scale(cfg)
        # The projections as dense.py's Linear (``projection``); kv_b stays a tensor: decode absorbs it into the
        # query and the output (einsums over its halves).
        def lin(name: str) -> Linear:
            return projection(w, p + name + ".weight")
        if m.q_lora_rank:
            self.q_a, self.q_a_norm, self.q_b = (lin("q_a_proj"), RMSNorm(take(w, p + "q_a_layernorm.weight"), self.eps),
                                                 lin("q_b_proj"))
            self._q = self._q_lora            # DeepSeek-V2 / V3: q through its low-rank projection
            self.q_lora = m.q_lora_rank
        else:
            self.q_lora = 0
            self.q = lin("q_proj")
            self._q = self._q_full            # DeepSeek-V2-Lite: one q projection
        self.kv_a = lin("kv_a_proj_with_mqa")
        self.kv_a_norm = RMSNorm(take(w, p + "kv_a_layernorm.weight"), self.eps)
        self.kv_b = take(w, p + "kv_b_proj.weight")
        self.o = lin("o_proj")
        # Kimi-Linear: no positional rotation in MLA at all; DeepSeek: interleaved rotary pairs.
        self.rotation = "none" if not m.rope else "interleaved" if m.rope_interleave else "half"
        self.rot = {"none": _no_rotation, "interleaved": rope_interleaved, "half": _rotate}[self.rotation]
        self.q_scale = (cfg.q_scale_beta, cfg.q_scale_len) if cfg.q_scale_beta else None
        self._scale_q = self._q_scaled if self.q_scale is not None else (lambda q, ctx: q)   # chosen once

    def fused_refusal(self) -> "str | None":
        """The fused CPU decode (layers/fused.py MLAPart) takes every MLA layer: q through q_lora or one
        projection, each rotation (none, rotate-half, interleaved) - but Llama 4's position-dependent q scale."""
        return "a position-dependent q scale (Llama 4's)" if self.q_scale is not None else None

    @classmethod
    def head_split(cls, cfg: MoEConfig, shard) -> HeadSplit:
        """Heads split; the latent projections and the latent cache are replicated (the cache has no heads)."""
        N = shard.world
        if cfg.num_heads % N:
            return HeadSplit(why=f"{cfg.num_heads} heads do not split over {N} ranks")
        # no kv heads (one latent per token): the field only has to stay consistent
        return HeadSplit(changes={"num_heads": cfg.num_heads // N,
                                  "num_kv_heads": math.gcd(cfg.num_kv_heads, cfg.num_heads // N)})

    @staticmethod
    def shard_tensors(cfg: MoEConfig, i: int, out: dict, plan) -> None:
        """q (or q_b) and kv_b by rows of the rank's heads, o by the same columns."""
        p = layer_prefix(i) + "self_attn."
        a, b = plan.shard.part(cfg.num_heads)
        m = cfg.mla
        qk, kvw, vd = m.qk_nope_head_dim + m.qk_rope_head_dim, m.qk_nope_head_dim + m.v_head_dim, m.v_head_dim
        q = p + ("q_b_proj.weight" if m.q_lora_rank else "q_proj.weight")
        out[q] = rows(out[q], a * qk, b * qk)
        out[p + "kv_b_proj.weight"] = rows(out[p + "kv_b_proj.weight"], a * kvw, b * kvw)
        out[p + "o_proj.weight"] = cols(out[p + "o_proj.weight"], a * vd, b * vd)

    @staticmethod
    def cache_spec(cfg: MoEConfig, i: int) -> TokenCacheSpec:
        """Per token one "head": the normalised KV latent and the shared rotary key, no v."""
        m = cfg.mla
        return TokenCacheSpec(1, m.kv_lora_rank + m.qk_rope_head_dim, with_v=False)

    @staticmethod
    def tensors(cfg: MoEConfig, i: int) -> dict:
        """The checkpoint tensors this layer takes -> shape (convert's table is built from these)."""
        if cfg.qkv_bias:
            raise ValueError(f"{cfg.source}: attention_bias with MLA is not supported yet")
        p, H = layer_prefix(i) + "self_attn.", cfg.hidden_size
        m = cfg.mla
        nh, qk, lat = cfg.num_heads, m.qk_nope_head_dim + m.qk_rope_head_dim, m.kv_lora_rank
        if m.q_lora_rank:
            out = {p + "q_a_proj.weight": (m.q_lora_rank, H), p + "q_a_layernorm.weight": (m.q_lora_rank,),
                   p + "q_b_proj.weight": (nh * qk, m.q_lora_rank)}
        else:
            out = {p + "q_proj.weight": (nh * qk, H)}
        out.update({p + "kv_a_proj_with_mqa.weight": (lat + m.qk_rope_head_dim, H),
                    p + "kv_a_layernorm.weight": (lat,),
                    p + "kv_b_proj.weight": (nh * (m.qk_nope_head_dim + m.v_head_dim), lat),
                    p + "o_proj.weight": (H, nh * m.v_head_dim)})
        return {**out, **attention_extras(cfg, layer_prefix(i))}

    def _q_lora(self, x: torch.Tensor) -> torch.Tensor:
        return self.q_b(self.q_a_norm(self.q_a(x)))

    def _q_full(self, x: torch.Tensor) -> torch.Tensor:
        return self.q(x)

    def _q_scaled(self, q: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Llama 4's position-dependent query scale (Mistral 4). q: [tokens, heads, nope+rope]."""
        return q * q_temperature(ctx, *self.q_scale, 0, torch.float64).to(q.device, q.dtype)[:, None, None]

    def __call__(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        q = self._q(x).view(-1, self.nh, self.nope + self.rope)          # q: [tokens, heads, nope+rope]
        return self._attend(x, self._scale_q(q, ctx), ctx)

    def _attend(self, x: torch.Tensor, q: torch.Tensor, ctx: ForwardContext, keep=None) -> torch.Tensor:
        """Attention of the queries q [tokens, heads, nope+rope] of x's tokens over their sequences' cached
        latents, x's written first. ``keep``: the keys each query may attend to besides causality (DeepSeek sparse
        attention's pick, layers/dsa.py) - decode [B, n] over ``ctx.read``, prefill one [new, ctx] per sequence;
        None: every key before it."""
        nh, nope, rope, vd, lat = self.nh, self.nope, self.rope, self.vd, self.lat
        ckv = self.kv_a(x)                                               # ckv: [tokens, lat+rope]
        latent = self.kv_a_norm(ckv[:, :lat])
        k_rot = ckv[:, lat:]
        rot = self.rot
        K = ctx.kv[self.i].k                                             # K: [token slots, 1, lat+rope]
        if ctx.decode:
            return self._decode(q, latent, k_rot, ctx, K, keep)
        out = torch.empty(x.shape[0], nh, vd, dtype=x.dtype, device=x.device)
        for j, (s, (a, b), (w_idx, r_idx), (cos, sin)) in enumerate(zip(ctx.seqs, ctx.spans, ctx.prefill, ctx.rope)):
            p0, n_new = s.length, b - a                                  # cos, sin: [new, rope]
            qr = torch.cat([q[a:b, :, :nope], rot(q[a:b, :, nope:], cos[:, None], sin[:, None])], dim=-1)
            K[w_idx, 0] = torch.cat([latent[a:b], rot(k_rot[a:b], cos, sin)], dim=-1)
            n_ctx = p0 + n_new
            cache = K[r_idx, 0]                                          # [ctx, lat+rope]
            kv = F.linear(cache[:, :lat], self.kv_b).view(n_ctx, nh, nope + vd)
            k = torch.cat([kv[..., :nope], cache[:, None, lat:].expand(n_ctx, nh, rope)], dim=-1)   # [ctx, heads, qk]
            causal = torch.arange(n_ctx, device=x.device)[None, :] <= (torch.arange(n_new, device=x.device)[:, None] + p0)
            if keep is not None:
                causal = causal & keep[j]                                # causal: [new, ctx]
            o = F.scaled_dot_product_attention(qr.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                               kv[..., nope:].transpose(0, 1)[None], attn_mask=causal,
                                               scale=self.scale)          # o: [1, heads, new, v]
            out[a:b] = o[0].transpose(0, 1)
        return self.o(out.reshape(-1, nh * vd))

    def _decode(self, q, latent, k_rot, ctx: ForwardContext, K, keep=None) -> torch.Tensor:
        """One token per sequence, all sequences at once, attending in the latent space: kv_b's key
        half is absorbed into the query and its value half applied after the weighted sum, so the
        cached latents are never expanded to per-head keys and values (DeepSeek's weight absorption).
        ``keep`` [B, n]: the keys each sequence's query may attend to (None: all up to its position)."""
        nh, nope, vd, lat = self.nh, self.nope, self.vd, self.lat
        B = len(ctx.seqs)
        rot = self.rot
        cos, sin = ctx.rope                                              # [B, rope]
        q_rope = rot(q[:, :, nope:], cos[:, None], sin[:, None])         # [B, heads, rope]
        K[ctx.write, 0] = torch.cat([latent, rot(k_rot, cos, sin)], dim=-1)
        n = ctx.read.shape[1]
        cache = K[ctx.read, 0]                                           # cache: [B, n, lat+rope]
        wkv = self.kv_b.view(nh, nope + vd, lat)
        q_lat = torch.einsum("bhd,hdl->bhl", q[:, :, :nope], wkv[:, :nope])          # [B, heads, lat]
        scores = (torch.einsum("bhl,bnl->bhn", q_lat, cache[..., :lat]) +
                  torch.einsum("bhr,bnr->bhn", q_rope, cache[..., lat:])) * self.scale
        mask = torch.arange(n, device=q.device)[None, :] <= ctx.pos[:, None]         # mask: [B, n]
        if keep is not None:
            mask = mask & keep
        p = scores.float().masked_fill(~mask[:, None, :], float("-inf")).softmax(-1).to(q.dtype)
        lctx = torch.einsum("bhn,bnl->bhl", p, cache[..., :lat])                      # [B, heads, lat]
        out = torch.einsum("bhl,hvl->bhv", lctx, wkv[:, nope:])                       # [B, heads, v]
        return self.o(out.reshape(B, nh * vd))


def projection(w: dict, name: str) -> Linear:
    """Weight ``name`` as dense.py's Linear: on a CPU the host kernels' bf16 GEMV over the checkpoint's bf16 weights
    (half the bytes a float32 copy reads) or --dense-quant's codes; torch.mm elsewhere."""
    t = take_raw(w, name)
    return Linear(t, None, compute_dtype(w, t), **linear_opts(w))


