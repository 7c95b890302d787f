"""Softmax self-attention layers over the shared cache (layers/cache.py): GQA / MHA on paged
blocks or a sliding-window ring, with the per-architecture parts chosen once at build time (qkv
bias, q/k RMSNorm over each head or over the whole projection, partial RoPE, attention sinks,
Qwen3-Next's sigmoid output gate, Llama 4's chunked local attention on the ring and its
position-dependent q scale)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ... import kernels
from ..config import MoEConfig
from .cache import TokenCacheSpec, WindowCacheSpec
from .context import ForwardContext
from .norm import RMSNorm
from .protocol import HeadSplit, Sublayer, cols, rows
from .rope import rotate_half_roll
from .dense import Linear
from .weights import compute_dtype, layer_prefix, linear_opts, take, take_opt, take_raw


class Attention(Sublayer):
    """GQA attention of layer ``i``: paged, or, a sliding-window layer, a ring of the last W keys per
    sequence (its cache: ``kv[i]``, as ``cache_spec`` declares it)."""
    reads_rope_heads = True
    fused_part = "gqa"        # the fused decode's tm_attn_block (layers/fused.py GQAPart)

    def __init__(self, cfg: MoEConfig, i: int, w: dict) -> None:
        p = layer_prefix(i) + "self_attn."
        self.i, self.eps = i, cfg.rms_norm_eps
        self.nh, self.nkv, self.hd = cfg.num_heads, cfg.kv_heads_of(i), cfg.head_dim
        self.vd = cfg.attn_v_dim                     # values' head dim (MiMo-V2-Flash: below q/k's)
        self.own_kv = self.nkv != cfg.num_kv_heads   # MiMo-V2-Flash's sliding layers: KV heads of their own
        self.windowed, self.window = i in cfg.window_layers, cfg.sliding_window
        # Llama 4's chunked local attention: the ring of W holds the query's chunk of W positions, which is all it reads
        self.chunked = self.windowed and cfg.chunked_windows
        self.rotary_dim = cfg.rotary_dim
        self.no_rope = i in cfg.nope_layers          # no RoPE on this layer (positions only through the mask)
        # a sliding-window layer of a model with a RoPE per layer type (Mellum) reads the window layers' tables
        self.own_rope = self.windowed and bool(cfg.sliding_rope_theta)
        self._heads = (lambda ctx: ctx.window_rope_heads) if self.own_rope else (lambda ctx: ctx.rope_heads)
        nh, hd = self.nh, self.hd
        suffixes = ("weight", "bias") if cfg.qkv_bias else ("weight",)
        if cfg.attn_output_gate:
            # q_proj gives [q | gate] per head; its rows regrouped once to q (all heads) then gate (all
            # heads), and the gate moved after v: the projection is [q | k | v | gate].
            for suffix in suffixes:
                t = take_raw(w, f"{p}q_proj.{suffix}")
                t = t.reshape(nh, 2, hd, *t.shape[1:])
                w[f"{p}q_proj.{suffix}"] = t[:, 0].reshape(nh * hd, *t.shape[3:])
                w[f"{p}g_proj.{suffix}"] = t[:, 1].reshape(nh * hd, *t.shape[3:])
        parts = "qkvg" if cfg.attn_output_gate else "qkv"
        self.gated = cfg.attn_output_gate
        # One concatenated copy replaces q, k, v (one product; layers/dense.py keeps it bf16 where that pays).
        qkv = torch.cat([take_raw(w, f"{p}{n}_proj.weight") for n in parts])
        dt = compute_dtype(w, qkv)
        self.qkv = Linear(qkv, torch.cat([take_raw(w, f"{p}{n}_proj.bias") for n in parts]) if cfg.qkv_bias else None, dt,
                          **linear_opts(w))
        self.o = Linear(take_raw(w, p + "o_proj.weight"), take_opt(w, p + "o_proj.bias"), dt, **linear_opts(w))
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm == "weightless_rope":
            # Llama 4: a per-head RMSNorm without a weight where RoPE turns q and k, none elsewhere. transformers
            # norms after RoPE; a rotation of channel pairs keeps each head's RMS, so before it (Qwen3's place,
            # a weight of ones) is the same norm
            self.qk_norm = "none" if self.no_rope else "head"
            self.qk_w = None if self.no_rope else RMSNorm(torch.ones(nh + self.nkv, hd, dtype=dt, device=qkv.device),
                                                          self.eps)
        elif cfg.qk_norm == "full":       # over the whole q / k projection (OLMoE, MiniMax-M2)
            self.q_norm, self.k_norm = (RMSNorm(take(w, p + "q_norm.weight"), self.eps),
                                        RMSNorm(take(w, p + "k_norm.weight"), self.eps))
        elif cfg.qk_norm in ("head", "head_post_rope"):   # per head: q and k weights stacked, one joint norm [heads + kv, hd]
            q, k = take(w, p + "q_norm.weight"), take(w, p + "k_norm.weight")
            self.qk_w = RMSNorm(torch.cat([q.expand(nh, -1), k.expand(self.nkv, -1)]), self.eps)
        self.sinks = take(w, p + "sinks") if cfg.sinks_on(i) else None
        # The per-architecture parts, once (no flag is tested in the forward): paged or ring, q/k norm,
        # partial RoPE, sinks, the output gate.
        self._attend = self._ring if self.windowed else self._paged
        self._qk = {"full": self._qk_full, "head": self._qk_head}.get(self.qk_norm, self._qk_plain)
        self._rotate = (self._rotate_none if self.no_rope else
                        self._rotate_partial if self.rotary_dim else self._rotate_full)
        if self.qk_norm == "head_post_rope":          # Hunyuan: the per-head norm after RoPE (they do not commute)
            rotate = self._rotate
            self._rotate = lambda qk, cos, sin: self.qk_w(rotate(qk, cos, sin))
        # Llama 4's attention temperature (its NoPE layers): q scaled by its position before attention
        self.q_scale = (cfg.q_scale_beta, cfg.q_scale_len, cfg.q_scale_offset) if i in cfg.q_scale_layers else None
        if self.q_scale is not None:
            attend = self._attend
            self._attend = lambda qk, v, ctx: attend(self._q_scaled(qk, ctx), v, ctx)
        self._sdpa = self._sdpa_plain if self.sinks is None else self._sdpa_sinks
        self._out = self._out_gated if self.gated else self._out_plain
        # The decode backend, once: the host kernel (RoPE, cache writes and attention of every sequence in
        # one call, sinks included) on a CPU with the kernels, float32; else the torch ops.
        # (The kernel rotates q and k itself: a norm after RoPE takes the torch ops.)
        self._decode = self._decode_host if (kernels.lib() is not None and qkv.device.type == "cpu"
                                             and dt == torch.float32 and self.qk_norm != "head_post_rope"
                                             and self.vd == hd and (self.rotary_dim or hd) <= 1024) \
            else self._decode_torch
        self._sinks32 = None if self.sinks is None else self.sinks.float().contiguous()   # [nh], the kernel's

    def fused_refusal(self) -> "str | None":
        """The fused CPU decode (layers/fused.py) takes paged or window-ring attention with full or partial
        RoPE, sinks or none (gpt-oss), the output gate or none (Qwen3-Next), chunked rings (Llama 4: ring_addressing)
        - on the step's one RoPE table and without a q scale."""
        if self.q_scale is not None:
            return "a position-dependent q scale (Llama 4's attention temperature)"
        if self.vd != self.hd or self.own_kv:
            return "a value head dim unlike the keys' or key-value heads of its own (MiMo-V2-Flash)"
        return "a RoPE of its own (the sliding layers' theta)" if self.own_rope else None

    @classmethod
    def head_split(cls, cfg: MoEConfig, shard) -> HeadSplit:
        """q heads split into equal parts; kv heads split with them, or - fewer kv heads than ranks - each rank
        keeps the one its q heads read (replicated, as vLLM does)."""
        N, r = shard.world, shard.rank
        if cfg.window_kv_heads or cfg.attn_v_head_dim:
            return HeadSplit(why="key-value heads or value dims of their own per layer kind (MiMo-V2-Flash)")
        if cfg.qk_norm == "full":
            return HeadSplit(why="its q/k RMSNorm spans every head")
        if cfg.num_heads % N:
            return HeadSplit(why=f"{cfg.num_heads} heads do not split over {N} ranks")
        nkv = cfg.num_kv_heads
        if nkv % N and N % nkv:
            return HeadSplit(why=f"{nkv} kv heads neither split over nor replicate evenly onto {N} ranks")
        kv = tuple(range(*shard.part(nkv))) if nkv % N == 0 else ((r * nkv) // N,)
        return HeadSplit(changes={"num_heads": cfg.num_heads // N, "num_kv_heads": len(kv)}, kv_heads=kv)

    @staticmethod
    def shard_tensors(cfg: MoEConfig, i: int, out: dict, plan) -> None:
        """q / k / v (and their biases, sinks) by rows of the rank's heads, o by the same columns; o's bias added
        once (rank 0's)."""
        p = layer_prefix(i) + "self_attn."
        r = plan.shard.rank
        nh, hd = cfg.num_heads, cfg.head_dim
        qh = plan.shard.part(nh)
        per = hd * (2 if cfg.attn_output_gate else 1)       # Qwen3-Next: [q | gate] per head, whole heads move
        for sfx in ("weight", "bias"):
            if p + "q_proj." + sfx in out:
                out[p + "q_proj." + sfx] = rows(out[p + "q_proj." + sfx], qh[0] * per, qh[1] * per)
            for n in ("k_proj.", "v_proj."):
                if p + n + sfx in out:
                    t = out[p + n + sfx]
                    out[p + n + sfx] = torch.cat([t[h * hd:(h + 1) * hd] for h in plan.kv_heads]).contiguous()
        out[p + "o_proj.weight"] = cols(out[p + "o_proj.weight"], qh[0] * hd, qh[1] * hd)
        if p + "o_proj.bias" in out and r:
            out[p + "o_proj.bias"] = torch.zeros_like(out[p + "o_proj.bias"])   # added once: by rank 0
        if p + "sinks" in out:
            out[p + "sinks"] = out[p + "sinks"][qh[0]:qh[1]].contiguous()

    @staticmethod
    def cache_spec(cfg: MoEConfig, i: int):
        """What the layer caches: k and v per token, or, sliding-window, a ring of its window."""
        v = cfg.attn_v_head_dim if cfg.attn_v_dim != cfg.head_dim else 0
        if i in cfg.window_layers:
            return WindowCacheSpec(cfg.kv_heads_of(i), cfg.head_dim, cfg.sliding_window, v_dim=v)
        return TokenCacheSpec(cfg.kv_heads_of(i), cfg.head_dim, v_dim=v)

    @staticmethod
    def tensors(cfg: MoEConfig, i: int) -> dict:
        """The checkpoint tensors this layer takes -> shape (convert's table is built from these)."""
        p, H = layer_prefix(i), cfg.hidden_size
        q, nkv = cfg.num_heads * cfg.head_dim, cfg.kv_heads_of(i)
        qo = q * (2 if cfg.attn_output_gate else 1)      # gated attention: [q | gate] per head
        return {p + "self_attn.q_proj.weight": (qo, H), p + "self_attn.k_proj.weight": (nkv * cfg.head_dim, H),
                p + "self_attn.v_proj.weight": (nkv * cfg.attn_v_dim, H),
                p + "self_attn.o_proj.weight": (H, cfg.num_heads * cfg.attn_v_dim), **attention_extras(cfg, p, i)}

    # -- pieces ----------------------------------------------------------------------------------
    @staticmethod
    def _rotate_none(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """A NoPE layer: q and k as they are."""
        return qk

    def _rotate_full(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE on q and k heads (cos and the signed sin broadcast over heads)."""
        return qk * cos + rotate_half_roll(qk) * sin

    def _rotate_partial(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """A rotary dim below the head dim (Qwen3-Next: a quarter): only the first rotary_dim channels turn."""
        r = qk[..., :self.rotary_dim]
        return torch.cat([r * cos + rotate_half_roll(r) * sin, qk[..., self.rotary_dim:]], dim=-1)

    def _out_plain(self, out: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        """Output projection. out: [tokens, heads * hd]."""
        return self.o(out)

    def _out_gated(self, out: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        """Output projection after the sigmoid gate that follows q | k | v in qkv (Qwen3-Next)."""
        return self.o(out * torch.sigmoid(qkv[:, (self.nh + self.nkv) * self.hd + self.nkv * self.vd:]))

    def _sdpa_plain(self, q, k, v, mask) -> torch.Tensor:
        """q: [B, heads, Tq, hd]; k, v: [B, kv_heads, n, hd]; mask: bool, broadcast to [B, heads, Tq, n]."""
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    def _sdpa_sinks(self, q, k, v, mask) -> torch.Tensor:
        """``_sdpa_plain`` with attention sinks (gpt-oss): each head's softmax also takes a learned logit
        that has no value - softmax over [scores, sink], the sink's share dropped. As torch's fused kernel
        takes it: one more key and value of zeros, whose score (0) the additive mask sets to the sink - no
        [heads, Tq, n] scores tensor of ours (pp512 of the gpt-oss shape: 13 vs 35 ms a layer, 1 thread)."""
        B, nh, Tq, hd = q.shape
        n = k.shape[2]
        z, zv = k.new_zeros(B, k.shape[1], 1, hd), v.new_zeros(B, v.shape[1], 1, v.shape[-1])
        bias = torch.zeros(B, nh, Tq, n + 1, dtype=q.dtype)              # bias: [B, heads, Tq, n + 1]
        bias[..., :n].masked_fill_(~mask, float("-inf"))
        bias[..., n] = self.sinks.view(1, nh, 1).to(q.dtype)
        return F.scaled_dot_product_attention(q, torch.cat([k, z], 2), torch.cat([v, zv], 2), attn_mask=bias,
                                              enable_gqa=True)

    def _q_scaled(self, qk: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """q x its token's temperature (k as it is): qk [tokens, heads + kv, hd] -> the same. Scaling q commutes with
        RoPE and follows the q/k norm, as in transformers."""
        s = q_temperature(ctx, *self.q_scale).to(qk.device)[:, None, None]     # s: [tokens, 1, 1] float32
        return torch.cat([(qk[:, :self.nh] * s).to(qk.dtype), qk[:, self.nh:]], 1)

    def _qkv(self, x: torch.Tensor):
        """One matmul for q, k and v (their weights concatenated at build); q and k then stay one
        tensor through their norm and RoPE (per-head ops: the same numbers, half the ops).
        Returns qkv [tokens, ...], qk [tokens, heads + kv, hd], v [tokens, kv, vd]."""
        nkv, hd, vd = self.nkv, self.hd, self.vd
        nq = self.nh + nkv
        qkv = self.qkv(x)
        v = qkv[:, nq * hd:nq * hd + nkv * vd].view(-1, nkv, vd)
        return qkv, self._qk(qkv), v

    def _qk_plain(self, qkv: torch.Tensor) -> torch.Tensor:
        """q | k of qkv [tokens, ...] as heads [tokens, heads + kv, hd]."""
        return qkv[:, :(self.nh + self.nkv) * self.hd].view(-1, self.nh + self.nkv, self.hd)

    def _qk_head(self, qkv: torch.Tensor) -> torch.Tensor:
        """q / k RMSNorm over each head (Qwen3): one joint norm of the stacked weights."""
        return self.qk_w(self._qk_plain(qkv))

    def _qk_full(self, qkv: torch.Tensor) -> torch.Tensor:
        """q / k RMSNorm over the whole projection (OLMoE, MiniMax-M2)."""
        nh, hd = self.nh, self.hd
        q = self.q_norm(qkv[:, :nh * hd])
        k = self.k_norm(qkv[:, nh * hd:(nh + self.nkv) * hd])
        return torch.cat([q, k], -1).view(-1, nh + self.nkv, hd)

    # -- forward ---------------------------------------------------------------------------------
    def __call__(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """x: [tokens, hidden], tokens of several sequences back to back (ctx.spans)."""
        qkv, qk, v = self._qkv(x)
        return self._out(self._attend(qk, v, ctx), qkv)

    def _paged(self, qk: torch.Tensor, v: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """A layer of the paged KV cache. qk: [tokens, heads + kv, hd] before RoPE; v: [tokens, kv, hd].
        Returns the attention output [tokens, heads * hd]."""
        nh, hd = self.nh, self.hd
        cache = ctx.kv[self.i]
        K, V = cache.k, cache.v                                          # [token slots, kv, hd]
        if ctx.decode:
            return self._decode(qk, v, ctx, K, V)
        dev = qk.device
        out = torch.empty(qk.shape[0], nh, self.vd, dtype=qk.dtype, device=dev)
        for s, (a, b), (w_idx, r_idx), (cos, sin) in zip(ctx.seqs, ctx.spans, ctx.prefill, self._heads(ctx)):
            p0, n_new = s.length, b - a
            qks = self._rotate(qk[a:b], cos, sin)                        # qks: [new, heads + kv, hd]
            K[w_idx] = qks[:, nh:]                                       # ks: [new, kv, hd]
            V[w_idx] = v[a:b]
            n_ctx = p0 + n_new
            kk, vv = K[r_idx].transpose(0, 1), V[r_idx].transpose(0, 1)  # [kv, ctx, hd]
            qpos = torch.arange(n_new, device=dev)[:, None] + p0
            causal = torch.arange(n_ctx, device=dev)[None, :] <= qpos
            o = self._sdpa(qks[:, :nh].transpose(0, 1)[None], kk[None], vv[None], causal)   # o: [1, heads, new, hd]
            out[a:b] = o[0].transpose(0, 1)
        return out.reshape(-1, nh * self.vd)

    def _decode_torch(self, qk, v, ctx: ForwardContext, K, V) -> torch.Tensor:
        """One token per sequence: one write and one batched product for all of them. qk: [B, heads + kv,
        hd] before RoPE; v: [B, kv, hd]; K, V: the layer's cache [token slots, kv, hd]. -> [B, heads * hd]."""
        nh, B = self.nh, len(ctx.seqs)
        cos, sin = self._heads(ctx)                                      # [B, 1, rotary dim]
        qk = self._rotate(qk, cos, sin)
        K[ctx.write] = qk[:, nh:]                                        # k: [B, kv, hd]
        V[ctx.write] = v
        kk, vv = K[ctx.read].transpose(1, 2), V[ctx.read].transpose(1, 2)   # [B, kv, n, hd]
        return self._sdpa(qk[:, :nh, None], kk, vv, decode_mask(ctx)).reshape(B, nh * self.vd)

    def _decode_host(self, qk, v, ctx: ForwardContext, K, V, at: "tuple | None" = None) -> torch.Tensor:
        """Decode on a CPU in one host-kernel call (runtime/kernels: RoPE, the k / v writes and the
        attention of every sequence and head, sinks included), in place of ~10 torch ops of a few rows each.
        ``at``: (write [B], read [B, n], pos [B]) rows of K / V [rows, kv, hd] - the paged cache's by default,
        a window ring's (ring_addressing) for a sliding-window layer. The torch path where this step's
        tensors are laid out otherwise than the kernel reads them."""
        lib = kernels.lib()
        cos, ssin = self._heads(ctx)
        rd = self.rotary_dim or self.hd
        write, read, pos = at or (ctx.write, ctx.read, ctx.pos)
        if (qk.stride(2) != 1 or qk.stride(1) != self.hd or v.stride(2) != 1 or v.stride(1) != self.hd
                or not (K.is_contiguous() and V.is_contiguous() and cos.is_contiguous() and ssin.is_contiguous())
                or (cos.shape[-1] != rd and not self.no_rope) or read.dtype != torch.int64):
            return None if at is not None else self._decode_torch(qk, v, ctx, K, V)
        B, n = read.shape
        out = torch.empty(B, self.nh * self.hd)
        scratch = torch.empty(B * self.nh * n)
        rows = K.numel() // (self.nkv * self.hd)                         # K / V: [rows, kv, hd] as the kernel reads
        lib.tm_gqa_decode(qk.data_ptr(), qk.stride(0), v.data_ptr(), v.stride(0), None if self.no_rope else cos.data_ptr(),
                          None if self.no_rope else ssin.data_ptr(), 0 if self.no_rope else rd,
                          K.data_ptr(), V.data_ptr(), rows, write.data_ptr(), read.data_ptr(), n,
                          pos.data_ptr(), B, self.nh, self.nkv, self.hd, self.hd ** -0.5,
                          None if self._sinks32 is None else self._sinks32.data_ptr(), out.data_ptr(),
                          scratch.data_ptr(), kernels.threads())
        return out

    def _ring(self, qk: torch.Tensor, v: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """A sliding-window layer: each sequence's slot holds a ring of its last W keys and values
        (position p at p % W), so the layer's cache never grows. qk: [tokens, heads + kv, hd] before
        RoPE; v: [tokens, kv, hd]. Returns the attention output [tokens, heads * hd]."""
        nh, hd, W = self.nh, self.hd, self.window
        cache = ctx.kv[self.i]
        RK, RV = cache.k, cache.v                                        # [slots, W, kv, hd]
        if ctx.decode and self._decode == self._decode_host:
            # the host kernel over the ring as rows [slots * W, kv, hd] (softmax does not care about order)
            out = self._decode_host(qk, v, ctx, RK, RV, ring_addressing(ctx, W, self.chunked))
            if out is not None:
                return out
        if ctx.decode:
            B = len(ctx.seqs)
            slots = ctx.state
            cos, sin = self._heads(ctx)
            qk = self._rotate(qk, cos, sin)
            at = ctx.pos % W
            RK[slots, at] = qk[:, nh:]
            RV[slots, at] = v
            kk, vv = RK[slots].transpose(1, 2), RV[slots].transpose(1, 2)   # [B, kv, W, hd]
            return self._sdpa(qk[:, :nh, None], kk, vv, ring_mask(ctx, W, self.chunked)).reshape(B, nh * self.vd)
        out = torch.empty(qk.shape[0], nh, self.vd, dtype=qk.dtype, device=qk.device)
        for s, (a, b), (cos, sin) in zip(ctx.seqs, ctx.spans, self._heads(ctx)):
            p0, n = s.length, b - a
            qks = self._rotate(qk[a:b], cos, sin)                        # qks: [n, heads + kv, hd]
            ring = torch.arange(W, device=qk.device)
            held = (p0 - 1) - (p0 - 1 - ring) % W                        # the ring's positions before this chunk
            new = torch.arange(p0, p0 + n, device=qk.device)
            kpos = torch.cat([held, new])                                # kpos: [W + n]
            kk = torch.cat([RK[s.state], qks[:, nh:]]).transpose(0, 1)   # [kv, W + n, hd]
            vv = torch.cat([RV[s.state], v[a:b]]).transpose(0, 1)
            q = new[:, None]
            mask = (kpos[None, :] <= q) & (kpos[None, :] > q - W) & (kpos[None, :] >= 0)   # [n, W + n]
            if self.chunked:
                mask &= kpos[None, :] // W == q // W                     # the query's own chunk only
            o = self._sdpa(qks[:, :nh].transpose(0, 1)[None], kk[None], vv[None], mask)
            out[a:b] = o[0].transpose(0, 1)
            m = min(n, W)                                                # the last W tokens stay in the ring
            RK[s.state, (new[n - m:] % W)] = qks[n - m:, nh:]
            RV[s.state, (new[n - m:] % W)] = v[b - m:b]
        return out.reshape(-1, nh * self.vd)


def attention_extras(cfg: MoEConfig, p: str, i: "int | None" = None) -> dict:
    """Biases, sinks and q/k norms of attention layer ``i`` (None: an MLA layer) whose tensors start with ``p``."""
    H, hd = cfg.hidden_size, cfg.head_dim
    nkv = cfg.num_kv_heads if i is None else cfg.kv_heads_of(i)
    q, kv = cfg.num_heads * hd, nkv * hd
    out = {}
    if cfg.qkv_bias:
        out.update({p + "self_attn.q_proj.bias": (q * (2 if cfg.attn_output_gate else 1),),
                    p + "self_attn.k_proj.bias": (kv,), p + "self_attn.v_proj.bias": (nkv * cfg.attn_v_dim,)})
    if cfg.o_bias:
        out[p + "self_attn.o_proj.bias"] = (H,)
    if cfg.attn_sinks if i is None else cfg.sinks_on(i):
        out[p + "self_attn.sinks"] = (cfg.num_heads,)
    if cfg.qk_norm in ("head", "head_post_rope"):
        out.update({p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})
    elif cfg.qk_norm == "full":
        out.update({p + "self_attn.q_norm.weight": (q,), p + "self_attn.k_norm.weight": (kv,)})
    return out


def decode_mask(ctx: ForwardContext) -> torch.Tensor:
    """Keys each decoding sequence attends to in a paged layer: [B, 1, 1, n] bool, made once per
    forward and shared by every paged layer of the step."""
    mask = ctx.masks.get("full")
    if mask is None:
        keys = torch.arange(ctx.read.shape[1], device=ctx.pos.device)[None, :]
        mask = ctx.masks["full"] = (keys <= ctx.pos[:, None])[:, None, None, :]   # mask: [B, 1, 1, n]
    return mask


def ring_addressing(ctx: ForwardContext, W: int, chunked: bool = False) -> tuple:
    """A decode step's rows of the window rings, viewed as one [slots * W, kv, hd] table per layer, for the host
    kernel: (write [B]: slot * W + pos % W, read [B, W]: the slot's W entries, pos [B]: the last entry to read,
    min(pos, W - 1) - entries past a young sequence's position are stale). Position p sits at p % W; attention
    over the entries read is the window (the new token's entry overwrites the one W back). ``chunked`` (Llama 4):
    the chunk of p starts at entry 0, so its positions so far are entries 0..p % W, the last to read. The same
    for every window layer of the step: made once per forward."""
    key = "chunk_at" if chunked else "ring_at"
    r = ctx.masks.get(key)
    if r is None:
        slots = ctx.state.to(torch.int64)
        last = ctx.pos % W if chunked else ctx.pos.clamp(max=W - 1)
        r = ctx.masks[key] = ((slots * W + ctx.pos % W).contiguous(),
                              (slots[:, None] * W + torch.arange(W, device=slots.device)[None, :]).contiguous(),
                              last.contiguous())
    return r


def ring_mask(ctx: ForwardContext, W: int, chunked: bool = False) -> torch.Tensor:
    """Ring entries each decoding sequence may attend to: those holding a position >= 0 (the rest
    is stale from an earlier occupant of the slot); ``chunked`` (Llama 4): entries 0..pos % W, its chunk's
    positions so far. The same for every window layer of the step: made once per forward. [B, 1, 1, W] bool."""
    key = "chunk" if chunked else "ring"
    mask = ctx.masks.get(key)
    if mask is None:
        ring = torch.arange(W, device=ctx.pos.device)
        if chunked:
            mask = ring[None, :] <= (ctx.pos % W)[:, None]                 # [B, W]
        else:
            held = ctx.pos[:, None] - (ctx.pos[:, None] - ring[None, :]) % W   # position in each ring entry: [B, W]
            mask = held >= 0
        mask = ctx.masks[key] = mask[:, None, None, :]
    return mask


def q_temperature(ctx: ForwardContext, beta: float, length: int, offset: int = 0,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Llama 4's attention temperature (its GQA NoPE layers; Mistral 4's MLA q scale) of each token of the forward,
    1 + beta ln(1 + floor((pos + offset) / length)), in ``dtype`` as each family's transformers code computes it
    (Llama 4: float32, counting from 1; Mistral 4: float64, from 0) -> [tokens] (1 below length - offset). Made once
    per forward."""
    key = ("q_temperature", dtype)
    t = ctx.masks.get(key)
    if t is None:
        pos = ctx.pos if ctx.decode else torch.cat([torch.arange(s.length, s.length + b - a)
                                                    for s, (a, b) in zip(ctx.seqs, ctx.spans)])
        t = ctx.masks[key] = torch.log1p(torch.floor((pos.to(dtype) + offset) / length)) * beta + 1.0
    return t
