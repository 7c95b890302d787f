"""A decoder-only MoE transformer whose routed experts come from the expert store.

The model runs forward passes and nothing else: it knows no scheduling, no sockets, and no
residency - it asks an expert provider (``ExpertStore``) for a layer's experts and computes the
resident ones first while misses stream in. Dense weights (attention, norms, router, shared
expert, embeddings) stay in memory.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from ..quant import ExpertCodec
from .attn_res import BlockAttnRes
from .config import MoEConfig
from .convert import correction_bias_name, linear_names, router_name
from .layers.cache import (KVFull, PagedKV, Sequence, StateCacheSpec, TokenCacheSpec, WindowCacheSpec, cache_specs,
                           kv_bytes_per_token, kv_shape, state_bytes_per_sequence)
from .layers.norm import rms_norm
from .layers.rope import (_no_rotation, _rotate, mla_softmax_scale, rope_frequencies, rotate_half, rotate_half_roll,
                          signed_sin)
from .layers.router import route
from .linear_attention import (GatedDeltaNet, GatedDeltaNetConfig, KDAConfig, KimiDeltaAttention, LinearAttentionState,
                               RECURRENT_DTYPE)


class MoEModel:
    def __init__(self, cfg: MoEConfig, dense: dict, experts, *, device: str = "cpu", dtype=torch.float32,
                 kv_bytes: "int | None" = None) -> None:
        self.cfg, self.experts, self.device, self.dtype = cfg, experts, device, dtype
        self.cache_bonus = 0.0   # cache-aware routing: added to resident experts' router logits
        if cfg.norm_offset:   # Qwen3-Next / Qwen3.5 RMSNorms scale by (1 + weight): folded in once here
            for k in list(dense):
                if k.endswith(("layernorm.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight")) or k == "model.norm.weight":
                    dense[k] = dense[k].float() + cfg.norm_offset
        # Takes ownership of `dense` (converted in place) so replaced tensors are freed at once.
        for k in list(dense):
            dense[k] = dense[k].to(device=device, dtype=dtype)
        self.w = dense
        inv_freq, self.rope_factor = rope_frequencies(cfg)
        self.inv_freq = inv_freq.to(device)
        self.moe_index = {layer: i for i, layer in enumerate(cfg.moe_layers)}
        self.step = 0                     # placement time; the engine advances it once per step
        self.record = None                # callable(moe_idx, ids [tokens, k]) when the engine records routing
        self.prefetch_hook = None         # callable(moe_idx, ids, hidden) after each MoE layer
        self.tokens_per_thread = 128      # intra-op threads of a forward: one per this many tokens (see forward)
        # Float operands of an expert from its blob: views for float stores, dequantized into one
        # reused scratch for quantized ones (runtime/quant.py).
        self.codec = ExpertCodec(experts.m.weights, dtype, device)
        self._host_codec = self._host_pool = None    # hybrid execution with CUDA (see _host_experts)
        self.host_worker_on_cpu = False   # tests: run the CUDA path's CPU worker on a CPU-only machine too
        # Half-precision experts computed in float32 (a CPU): keep converted copies of as many
        # experts as the device tier holds, so an expert is widened once, not at every step.
        if self.codec.widen:
            slots = experts.capacity_bytes()["device"] // experts.m.blob_stride
            self.codec.cache_bytes = slots * self.codec.operand_bytes
        w = self.w
        # An untied lm_head input-major ([hidden, vocab]), as the attention weights below.
        self.head_t = w.pop("lm_head.weight").t().contiguous() if "lm_head.weight" in w else None
        self.qkv_w, self.qkv_b = [], []
        self._qk_w: dict = {}     # layer -> joint q/k norm weight (see _qk_norm_w)
        self.kv = None            # PagedKV, made by init_kv (the engine sizes it; else on first use)
        self.kv_bytes = kv_bytes
        # Per-token layers index the paged KV cache, linear-attention layers the state arena,
        # sliding-window layers the rings.
        self.kv_layer = {layer: j for j, layer in enumerate(cfg.paged_layers)}
        self.win_layer = {layer: j for j, layer in enumerate(cfg.window_layers)}
        self.state_layer = {layer: j for j, layer in enumerate(cfg.linear_layers)}
        self.linear: dict = {}    # layer -> KimiDeltaAttention / GatedDeltaNet
        if cfg.linear_layers:
            if cfg.linear_kind == "kda":
                kind = KimiDeltaAttention
                lc = KDAConfig(hidden_size=cfg.hidden_size, num_heads=cfg.linear_num_heads, head_dim=cfg.linear_head_dim,
                               conv_kernel_size=cfg.linear_conv_kernel, rms_norm_eps=cfg.rms_norm_eps)
            else:
                kind = GatedDeltaNet
                lc = GatedDeltaNetConfig(hidden_size=cfg.hidden_size, num_k_heads=cfg.linear_num_heads,
                                         num_v_heads=cfg.linear_num_v_heads, head_k_dim=cfg.linear_head_dim,
                                         head_v_dim=cfg.linear_value_head_dim, conv_kernel_size=cfg.linear_conv_kernel,
                                         rms_norm_eps=cfg.rms_norm_eps)
            for i in cfg.linear_layers:
                p = self._p(i, cfg.linear_prefix)
                self.linear[i] = kind(lc, {n[len(p):]: w.pop(n) for n in linear_names(cfg, i)}, name=f"layer {i}")
        if cfg.attention == "mla":
            return

        # Concatenated copies replace q, k, v: one copy in memory, input-major ([in, out]) like the
        # experts: at decode's few rows, x @ w over it is a faster CPU kernel than F.linear's
        # (200 vs 330 us for [1, 512] x [512, 1024] on this project's 2-core machine).
        self.qkv_w, self.qkv_b = [None] * cfg.num_layers, [None] * cfg.num_layers
        if cfg.attn_output_gate:
            # q_proj gives [q | gate] per head; its rows regrouped once to q (all heads) then gate (all
            # heads), and the gate moved after v: the projection is [q | k | v | gate].
            nh, hd = cfg.num_heads, cfg.head_dim
            for i in cfg.attention_layers:
                for suffix in ("weight", "bias") if cfg.qkv_bias else ("weight",):
                    t = w.pop(self._p(i, f"self_attn.q_proj.{suffix}"))
                    t = t.reshape(nh, 2, hd, *t.shape[1:])
                    w[self._p(i, f"self_attn.q_proj.{suffix}")] = t[:, 0].reshape(nh * hd, *t.shape[3:])
                    w[self._p(i, f"self_attn.g_proj.{suffix}")] = t[:, 1].reshape(nh * hd, *t.shape[3:])
        parts = "qkvg" if cfg.attn_output_gate else "qkv"
        for i in cfg.attention_layers:
            self.qkv_w[i] = (torch.cat([w.pop(self._p(i, f"self_attn.{n}_proj.weight")) for n in parts]).t().contiguous())
            self.qkv_b[i] = (torch.cat([w.pop(self._p(i, f"self_attn.{n}_proj.bias")) for n in parts])
                             if cfg.qkv_bias else None)

    # -- the KV cache ----------------------------------------------------------------------------
    def kv_shape(self) -> tuple:
        return kv_shape(self.cfg)

    def cache_specs(self) -> dict:
        return cache_specs(self.cfg)

    def kv_bytes_per_token(self) -> int:
        """Bytes one more token of context adds to a sequence's cache (per-token layers only)."""
        return kv_bytes_per_token(self.cfg, self.dtype)

    def state_bytes_per_sequence(self) -> int:
        """Bytes of fixed per-sequence state (linear-attention layers), whatever the context length."""
        return state_bytes_per_sequence(self.cfg, self.dtype)

    def cache_bytes(self, tokens: int) -> int:
        """A sequence's whole cache at ``tokens`` tokens of context."""
        return tokens * self.kv_bytes_per_token() + self.state_bytes_per_sequence()

    def init_kv(self, nbytes: "int | None" = None, block_size: int = 16, max_seqs: "int | None" = None) -> PagedKV:
        """Preallocate the cache from one budget: ``nbytes`` (else the model's kv_bytes, else room for
        16 sequences of up to 4096 tokens). With linear-attention layers ``max_seqs`` (default 16)
        state slots come out of it first; the rest is KV blocks of ``block_size`` tokens."""
        per_tok, per_seq = self.kv_bytes_per_token(), self.state_bytes_per_sequence()
        seqs = (max_seqs or 16) if per_seq else 0
        nbytes = nbytes or self.kv_bytes or 16 * (min(self.cfg.max_position_embeddings, 4096) * per_tok + per_seq)
        if per_tok:
            blocks = int((nbytes - seqs * per_seq) // (per_tok * block_size))
        else:   # no layer caches per token (every one sliding or linear): blocks only number positions
            blocks = seqs * -(-self.cfg.max_position_embeddings // block_size) if nbytes >= seqs * per_seq else 0
        if blocks < 1:
            need = seqs * per_seq + per_tok * block_size
            raise ValueError(f"KV cache budget {nbytes:,} bytes is smaller than "
                             + (f"the recurrent state of {seqs} sequences ({seqs * per_seq:,} bytes) + " if seqs else "")
                             + f"one block of {block_size} tokens ({per_tok * block_size:,} bytes): the minimum is "
                             f"{need:,} bytes")
        h, d, v = self.kv_shape()
        specs = [s for s in self.cache_specs().values() if isinstance(s, StateCacheSpec)]
        wins = [s for s in self.cache_specs().values() if isinstance(s, WindowCacheSpec)]
        self.kv = PagedKV(len(self.cfg.paged_layers), h, d, self.dtype, self.device, num_blocks=blocks,
                          block_size=block_size, with_v=v, state=specs[0] if specs else None,
                          state_layers=len(specs), state_slots=seqs, window=wins[0] if wins else None,
                          window_layers=len(wins))
        return self.kv

    def release(self, seq: Sequence) -> None:
        """Free a finished sequence's KV blocks and state slot."""
        if (seq.blocks or seq.state is not None) and self.kv is not None:
            self.kv.release(seq)

    # -- names of the dense tensors -----------------------------------------------------------
    def _p(self, i: int, name: str) -> str:
        return f"model.layers.{i}.{name}"

    def _router_name(self, i: int) -> str:
        return router_name(self.cfg, i)

    # -- blocks --------------------------------------------------------------------------------
    def _rope(self, pos: torch.Tensor):
        freqs = pos.float()[:, None] * self.inv_freq[None, :]           # freqs: [tokens, hd/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.rope_factor).to(self.dtype), (emb.sin() * self.rope_factor).to(self.dtype)

    def _rope_interleaved(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """DeepSeek's layout: rotary pairs (x0, x1), (x2, x3), ... each rotated by one frequency."""
        c, s_ = cos[..., : cos.shape[-1] // 2], sin[..., : sin.shape[-1] // 2]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.cat([x1 * c - x2 * s_, x2 * c + x1 * s_], dim=-1)

    def _mla(self, i: int, x: torch.Tensor, seqs: list, spans: list) -> torch.Tensor:
        """Multi-head latent attention. The cache holds, per token, the normalised latent and the
        rotary key; keys and values are expanded from it through kv_b_proj when attending."""
        cfg, w = self.cfg, self.w
        nh, nope, rope, vd, lat = (cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                                   cfg.kv_lora_rank)
        if cfg.q_lora_rank:
            q = F.linear(rms_norm(F.linear(x, w[self._p(i, "self_attn.q_a_proj.weight")]),
                                  w[self._p(i, "self_attn.q_a_layernorm.weight")], cfg.rms_norm_eps),
                         w[self._p(i, "self_attn.q_b_proj.weight")])
        else:
            q = F.linear(x, w[self._p(i, "self_attn.q_proj.weight")])
        q = q.view(-1, nh, nope + rope)                                  # q: [tokens, heads, nope+rope]
        ckv = F.linear(x, w[self._p(i, "self_attn.kv_a_proj_with_mqa.weight")])   # [tokens, lat+rope]
        latent = rms_norm(ckv[:, :lat], w[self._p(i, "self_attn.kv_a_layernorm.weight")], cfg.rms_norm_eps)
        k_rot = ckv[:, lat:]
        if not cfg.mla_rope:      # Kimi-Linear: no positional rotation in MLA at all
            rot = _no_rotation
        elif cfg.rope_interleave:
            rot = self._rope_interleaved
        else:
            rot = _rotate
        K = self.kv.k[self.kv_layer[i]]                                  # K: [token slots, 1, lat+rope]
        kv_b = w[self._p(i, "self_attn.kv_b_proj.weight")]
        if all(b - a == 1 for a, b in spans):
            return self._mla_decode(i, q, latent, k_rot, seqs, rot, K, kv_b)
        slots = self._ctx["prefill"]
        out = torch.empty(x.shape[0], nh, vd, dtype=x.dtype, device=x.device)
        for s, (a, b), (w_idx, r_idx), (cos, sin) in zip(seqs, spans, slots, self._ctx["rope"]):
            p0, n_new = s.length, b - a                                  # cos, sin: [new, rope]
            qr = torch.cat([q[a:b, :, :nope], rot(q[a:b, :, nope:], cos[:, None], sin[:, None])], dim=-1)
            K[w_idx, 0] = torch.cat([latent[a:b], rot(k_rot[a:b], cos, sin)], dim=-1)
            ctx = p0 + n_new
            cache = K[r_idx, 0]                                          # [ctx, lat+rope]
            kv = F.linear(cache[:, :lat], kv_b).view(ctx, nh, nope + vd)
            k = torch.cat([kv[..., :nope], cache[:, None, lat:].expand(ctx, nh, rope)], dim=-1)   # [ctx, heads, qk]
            causal = torch.arange(ctx, device=x.device)[None, :] <= (torch.arange(n_new, device=x.device)[:, None] + p0)
            o = F.scaled_dot_product_attention(qr.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                               kv[..., nope:].transpose(0, 1)[None], attn_mask=causal,
                                               scale=mla_softmax_scale(cfg))  # o: [1, heads, new, v]
            out[a:b] = o[0].transpose(0, 1)
        return F.linear(out.reshape(-1, nh * vd), w[self._p(i, "self_attn.o_proj.weight")])

    def _mla_decode(self, i, q, latent, k_rot, seqs, rot, K, kv_b) -> torch.Tensor:
        """One token per sequence, all sequences at once, attending in the latent space: kv_b's key
        half is absorbed into the query and its value half applied after the weighted sum, so the
        cached latents are never expanded to per-head keys and values (DeepSeek's weight absorption)."""
        cfg = self.cfg
        nh, nope, vd, lat = cfg.num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        B = len(seqs)
        pos, w_idx, r_idx = self._ctx["decode"]
        cos, sin = self._ctx["rope"]                                     # [B, rope]
        q_rope = rot(q[:, :, nope:], cos[:, None], sin[:, None])         # [B, heads, rope]
        K[w_idx, 0] = torch.cat([latent, rot(k_rot, cos, sin)], dim=-1)
        n = r_idx.shape[1]
        cache = K[r_idx, 0]                                              # cache: [B, n, lat+rope]
        wkv = kv_b.view(nh, nope + vd, lat)
        q_lat = torch.einsum("bhd,hdl->bhl", q[:, :, :nope], wkv[:, :nope])          # [B, heads, lat]
        scores = (torch.einsum("bhl,bnl->bhn", q_lat, cache[..., :lat]) +
                  torch.einsum("bhr,bnr->bhn", q_rope, cache[..., lat:])) * mla_softmax_scale(cfg)
        mask = torch.arange(n, device=q.device)[None, :] <= pos[:, None]             # mask: [B, n]
        p = scores.float().masked_fill(~mask[:, None, :], float("-inf")).softmax(-1).to(q.dtype)
        ctx = torch.einsum("bhn,bnl->bhl", p, cache[..., :lat])                       # [B, heads, lat]
        out = torch.einsum("bhl,hvl->bhv", ctx, wkv[:, nope:])                        # [B, heads, v]
        return F.linear(out.reshape(B, nh * vd), self.w[self._p(i, "self_attn.o_proj.weight")])

    def _o_proj(self, i: int, out: torch.Tensor) -> torch.Tensor:
        return F.linear(out, self.w[self._p(i, "self_attn.o_proj.weight")], self.w.get(self._p(i, "self_attn.o_proj.bias")))

    def _sdpa(self, i: int, q, k, v, mask) -> torch.Tensor:
        """q: [B, heads, Tq, hd]; k, v: [B, kv_heads, n, hd]; mask: bool, broadcast to [B, heads, Tq, n].
        With attention sinks (gpt-oss) each head's softmax also takes a learned logit that has no
        value: softmax over [scores, sink], the sink's share dropped."""
        if not self.cfg.attn_sinks:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        B, nh, Tq, hd = q.shape
        nkv, n = k.shape[1], k.shape[2]
        g = nh // nkv
        # Heads grouped by the kv head they share: no repeat of k and v.
        s = (q.reshape(B, nkv, g * Tq, hd) @ k.transpose(-1, -2)).view(B, nh, Tq, n) * hd ** -0.5
        s = s.float().masked_fill(~mask, float("-inf"))
        sink = self.w[self._p(i, "self_attn.sinks")].float().view(1, nh, 1, 1).expand(B, nh, Tq, 1)
        p = torch.cat([s, sink], -1).softmax(-1)[..., :n].to(q.dtype)      # p: [B, heads, Tq, n]
        return (p.reshape(B, nkv, g * Tq, n) @ v).view(B, nh, Tq, hd)

    def _attention(self, i: int, x: torch.Tensor, seqs: list, spans: list) -> torch.Tensor:
        """x: [tokens, hidden], tokens of several sequences back to back (spans: (start, end))."""
        cfg, w = self.cfg, self.w
        if i in self.linear:
            return self._linear_attention(i, x, seqs, spans)
        if cfg.attention == "mla":
            return self._mla(i, x, seqs, spans)
        hd, nh, nkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        nq = nh + nkv
        # One matmul for q, k and v (their weights concatenated once at load); q and k then stay
        # one tensor through their norm and RoPE (per-head ops: the same numbers, half the ops).
        b = self.qkv_b[i]
        qkv = torch.mm(x, self.qkv_w[i]) if b is None else torch.addmm(b, x, self.qkv_w[i])   # qkv: [tokens, (heads + 2 kv) hd (+ heads hd gate)]
        v = qkv[:, nq * hd:(nq + nkv) * hd].view(-1, nkv, hd)            # v: [tokens, kv, hd]
        if cfg.qk_norm == "full":
            q = rms_norm(qkv[:, :nh * hd], w[self._p(i, "self_attn.q_norm.weight")], cfg.rms_norm_eps)
            k = rms_norm(qkv[:, nh * hd:nq * hd], w[self._p(i, "self_attn.k_norm.weight")], cfg.rms_norm_eps)
            qk = torch.cat([q, k], -1).view(-1, nq, hd)
        else:
            qk = qkv[:, :nq * hd].view(-1, nq, hd)                      # qk: [tokens, heads + kv, hd]
            if cfg.qk_norm == "head":
                qk = rms_norm(qk, self._qk_norm_w(i), cfg.rms_norm_eps)
        if i in self.win_layer:
            out = self._window_attention(i, qk, v, seqs, spans)
            return self._o_proj(i, self._gate(out, qkv, nq + nkv))
        j = self.kv_layer[i]
        K, V = self.kv.k[j], self.kv.v[j]                                # [token slots, kv, hd]
        if all(b - a == 1 for a, b in spans):
            # Decode: one token per sequence - one write and one batched product for all of them.
            B = len(seqs)
            _, w_idx, r_idx = self._ctx["decode"]
            cos, sin = self._ctx["rope_heads"]                           # [B, 1, rotary dim]
            qk = self._rotate(qk, cos, sin)
            K[w_idx] = qk[:, nh:]                                        # k: [B, kv, hd]
            V[w_idx] = v
            kk, vv = K[r_idx].transpose(1, 2), V[r_idx].transpose(1, 2)  # [B, kv, n, hd]
            mask = self._decode_mask(i)                                  # mask: [B, 1, 1, n]
            out = self._sdpa(i, qk[:, :nh, None], kk, vv, mask).reshape(B, nh * hd)
            return self._o_proj(i, self._gate(out, qkv, nq + nkv))
        out = torch.empty(x.shape[0], nh, hd, dtype=x.dtype, device=x.device)
        for s, (a, b), (w_idx, r_idx), (cos, sin) in zip(seqs, spans, self._ctx["prefill"], self._ctx["rope_prefill"]):
            p0, n_new = s.length, b - a
            qks = self._rotate(qk[a:b], cos, sin)                        # qks: [new, heads + kv, hd]
            K[w_idx] = qks[:, nh:]                                       # ks: [new, kv, hd]
            V[w_idx] = v[a:b]
            ctx = p0 + n_new
            kk, vv = K[r_idx].transpose(0, 1), V[r_idx].transpose(0, 1)  # [kv, ctx, hd]
            qpos = torch.arange(n_new, device=x.device)[:, None] + p0
            causal = torch.arange(ctx, device=x.device)[None, :] <= qpos
            o = self._sdpa(i, qks[:, :nh].transpose(0, 1)[None], kk[None], vv[None], causal)   # o: [1, heads, new, hd]
            out[a:b] = o[0].transpose(0, 1)
        return self._o_proj(i, self._gate(out.reshape(-1, nh * hd), qkv, nq + nkv))

    def _window_attention(self, i: int, qk: torch.Tensor, v: torch.Tensor, seqs: list, spans: list) -> torch.Tensor:
        """A sliding-window layer: each sequence's slot holds a ring of its last W keys and values
        (position p at p % W), so the layer's cache never grows. qk: [tokens, heads + kv, hd] before
        RoPE; v: [tokens, kv, hd]. Returns the attention output [tokens, heads * hd]."""
        cfg = self.cfg
        nh, hd, W = cfg.num_heads, cfg.head_dim, cfg.sliding_window
        j = self.win_layer[i]
        RK, RV = self.kv.win_k[j], self.kv.win_v[j]                      # [slots, W, kv, hd]
        if all(b - a == 1 for a, b in spans):
            B = len(seqs)
            pos = self._ctx["decode"][0]                                 # pos: [B]
            slots = self._ctx["state"]
            cos, sin = self._ctx["rope_heads"]
            qk = self._rotate(qk, cos, sin)
            at = pos % W
            RK[slots, at] = qk[:, nh:]
            RV[slots, at] = v
            mask = self._ring_mask()                                     # mask: [B, 1, 1, W]
            kk, vv = RK[slots].transpose(1, 2), RV[slots].transpose(1, 2)  # [B, kv, W, hd]
            return self._sdpa(i, qk[:, :nh, None], kk, vv, mask).reshape(B, nh * hd)
        out = torch.empty(qk.shape[0], nh, hd, dtype=qk.dtype, device=qk.device)
        for s, (a, b), (cos, sin) in zip(seqs, spans, self._ctx["rope_prefill"]):
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
            o = self._sdpa(i, qks[:, :nh].transpose(0, 1)[None], kk[None], vv[None], mask)
            out[a:b] = o[0].transpose(0, 1)
            m = min(n, W)                                                # the last W tokens stay in the ring
            RK[s.state, (new[n - m:] % W)] = qks[n - m:, nh:]
            RV[s.state, (new[n - m:] % W)] = v[b - m:b]
        return out.reshape(-1, nh * hd)

    def _ring_mask(self) -> torch.Tensor:
        """Ring entries each decoding sequence may attend to: those holding a position >= 0 (the rest
        is stale from an earlier occupant of the slot). The same for every window layer of the step:
        made once per forward. [B, 1, 1, W] bool."""
        masks = self._ctx["masks"]
        mask = masks.get("ring")
        if mask is None:
            pos, W = self._ctx["decode"][0], self.cfg.sliding_window
            ring = torch.arange(W, device=pos.device)
            held = pos[:, None] - (pos[:, None] - ring[None, :]) % W     # position in each ring entry: [B, W]
            mask = masks["ring"] = (held >= 0)[:, None, None, :]
        return mask

    def _rotate(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE on q and k heads (cos and the signed sin broadcast over heads); with a rotary dim
        below the head dim (Qwen3-Next: a quarter) only the first rotary_dim channels turn."""
        rd = self.cfg.rotary_dim
        if not rd:
            return qk * cos + rotate_half_roll(qk) * sin
        r = qk[..., :rd]
        return torch.cat([r * cos + rotate_half_roll(r) * sin, qk[..., rd:]], dim=-1)

    def _gate(self, out: torch.Tensor, qkv: torch.Tensor, start: int) -> torch.Tensor:
        """Gated attention (Qwen3-Next): the attention output times sigmoid of the gate projection,
        which follows q | k | v in qkv. out: [tokens, heads * hd]."""
        if not self.cfg.attn_output_gate:
            return out
        return out * torch.sigmoid(qkv[:, start * self.cfg.head_dim:])

    def _linear_attention(self, i: int, x: torch.Tensor, seqs: list, spans: list) -> torch.Tensor:
        """Linear attention (KDA, Gated DeltaNet): each sequence carries its recurrent and convolution
        state in its slot of the state arena. One token per sequence (decode, or one-token prompts):
        one batched step for all of them; longer chunks: the chunked form per sequence, from the
        state its earlier chunks left. A sequence's first token starts from the zero state, whatever
        its slot held before."""
        layer, j = self.linear[i], self.state_layer[i]
        R, C = self.kv.rec[j], self.kv.conv[j]                           # R: [slots, H, K, V]; C: [slots, conv dim, W-1]
        if all(b - a == 1 for a, b in spans):
            slots = self._ctx["state"]                                   # slots: [B]
            fresh = self._ctx["fresh"]
            if fresh is not None:
                R[fresh] = 0
                C[fresh] = 0
            y, S, conv = layer.step(x, R[slots], C[slots])
            R[slots] = S
            C[slots] = conv
            return y
        out = torch.empty_like(x)                                        # out: [tokens, hidden]
        for s, (a, b) in zip(seqs, spans):
            y, st = layer(x[a:b], None if s.length == 0 else LinearAttentionState(R[s.state], C[s.state]))
            R[s.state] = st.recurrent
            C[s.state] = st.conv
            out[a:b] = y
        return out

    def _mlp(self, prefix: str, x: torch.Tensor) -> torch.Tensor:
        w = self.w
        return F.linear(F.silu(F.linear(x, w[prefix + "gate_proj.weight"])) * F.linear(x, w[prefix + "up_proj.weight"]),
                        w[prefix + "down_proj.weight"])

    def _expert_ffn(self, t, x: torch.Tensor, out: "torch.Tensor | None" = None) -> torch.Tensor:
        """One expert on its tokens. t: ExpertWeights (compute dtype); x: [n, hidden or latent];
        out: where to write y (same shape as x), else a new tensor. Returns y."""
        cfg = self.cfg
        I = cfg.expert_intermediate
        h = torch.mm(x, t.gate_up_t)                                     # h: [n, 2I] = gate | up
        if t.gate_up_bias is not None:
            h += t.gate_up_bias
        if cfg.expert_act == "swiglu_clamp":   # gpt-oss: clamped SwiGLU with (up + 1)
            g = h[:, :I].clamp(max=cfg.swiglu_limit)
            h = (h[:, I:].clamp(-cfg.swiglu_limit, cfg.swiglu_limit) + 1) * (g * torch.sigmoid(g * cfg.swiglu_alpha))
        else:
            h = F.silu(h[:, :I]) * h[:, I:]                              # h: [n, I]
        if out is None or out.dtype != h.dtype:   # e.g. float32 experts of a bf16 model: rounded into out
            y = torch.mm(h, t.down_t) if t.down_bias is None else torch.addmm(t.down_bias, h, t.down_t)
            return y if out is None else out.copy_(y)
        if t.down_bias is None:
            return torch.mm(h, t.down_t, out=out)                       # out: [n, hidden or latent]
        return torch.addmm(t.down_bias, h, t.down_t, out=out)

    def _host_experts(self, m: int, fetch, xs: torch.Tensor, off: list):
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
        x_cpu = xs.index_select(0, idx).to("cpu", self._host_codec.compute_dtype)   # x_cpu: [n, hidden or latent]

        def work():
            t0 = time.perf_counter()
            y = torch.empty_like(x_cpu)
            j = 0
            for e, (a, b) in zip(host, spans):
                t = self._host_codec.weights(fetch.tensors(e))          # views of the host slot
                self._expert_ffn(t, x_cpu[j:j + b - a], y[j:j + b - a])
                j += b - a
            store.stats.host_compute_seconds += time.perf_counter() - t0
            return y
        fut = self._host_pool.submit(work)

        def finish(ys: torch.Tensor) -> None:
            ys.index_copy_(0, idx, fut.result().to(ys.device, ys.dtype))
        return finish

    def _moe(self, i: int, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        m = self.moe_index[i]
        rn = self._router_name(i)
        logits = F.linear(x, self.w[rn], self.w.get(rn[:-len("weight")] + "bias"))   # logits: [tokens, E]
        bonus = None
        if self.cache_bonus:
            # Cache-aware routing: resident experts look better by cache_bonus (off by default:
            # it changes the model's outputs; bench/exp_cache_routing.py measures by how much).
            res = self.experts.resident(m)
            if res:
                bonus = torch.zeros(cfg.num_experts, device=logits.device)
                bonus[res] = self.cache_bonus
        ids, wts = route(logits, cfg, self.w.get(correction_bias_name(cfg, i)), bonus)
        if self.record is not None:
            self.record(m, ids)
        wts = wts.to(self.dtype)
        # Tokens sorted by expert once, so each expert reads a contiguous slice. The store needs the
        # experts on the host anyway: one copy of the ids there, and the bookkeeping in numpy (a
        # few us per call where each torch op of a tiny tensor costs 5-10 us).
        T, k = ids.shape
        flat = ids.cpu().numpy().reshape(-1)                             # flat: [T*k]
        order = np.argsort(flat, kind="stable")                          # the same permutation as torch's stable sort
        counts = np.bincount(flat, minlength=cfg.num_experts)
        used = np.flatnonzero(counts).tolist()
        off = [0] + np.cumsum(counts).tolist()
        back = np.empty_like(order)
        back[order] = np.arange(order.size)                              # sorted position of each (token, slot)
        fetch = self.experts.request(m, used, self.step, counts[used].tolist())   # tokens per expert: hybrid decisions weigh them
        xin = x
        if cfg.latent_dim:   # LatentMoE: experts run in a smaller latent space
            xin = F.linear(x, self.w[self._p(i, cfg.mlp_prefix + "latent_down.weight")])   # xin: [tokens, latent]
        tok = torch.from_numpy(order // k).to(x.device)                  # token of each sorted slot
        xs = xin[tok]                                                    # xs: [T*k, hidden or latent]
        ys = torch.empty_like(xs)
        # Resident experts first while misses stream in; in waves when they do not all fit.
        codec = self.codec
        if xs.dtype != codec.compute_dtype:   # e.g. bf16 model, float32 expert matmuls on a CPU
            xs = xs.to(codec.compute_dtype)
        host_job = self._host_experts(m, fetch, xs, off) if fetch.host else None
        for wave in fetch.waves():
            for e in wave:
                on_host = e in fetch.host
                if on_host and host_job is not None:
                    continue                     # on a CPU worker (see _host_experts)
                t0 = time.perf_counter() if on_host else 0.0
                # float operands (dequantized if the store is quantized, widened once if half precision)
                # Host-computed experts convert into scratch: kept, they would push the device tier's
                # experts out of the converted-operand cache (sized to the device tier).
                t = codec.weights(fetch.tensors(e), None if on_host else (m, e))
                a, b = off[e], off[e + 1]
                self._expert_ffn(t, xs[a:b], ys[a:b])
                if on_host:
                    fetch.store.stats.host_compute_seconds += time.perf_counter() - t0
        if host_job is not None:
            host_job(ys)
        # Back to (token, slot) order, then sum each token's k expert outputs (cheaper than index_add_ on CPU).
        y = ys[torch.from_numpy(back).to(x.device)].view(T, k, -1)       # y: [T, k, hidden or latent]
        out = (y * wts[:, :, None]).sum(1)
        if cfg.latent_dim:
            out = F.linear(out, self.w[self._p(i, cfg.mlp_prefix + "latent_up.weight")])
        if cfg.shared_intermediate:
            sh = self._mlp(self._p(i, cfg.shared_prefix), x)
            if cfg.shared_expert_gate:
                sh = sh * torch.sigmoid(F.linear(x, self.w[self._p(i, "mlp.shared_expert_gate.weight")]))
            out = out + sh
        if self.prefetch_hook is not None:
            self.prefetch_hook(m, used, x)
        return out

    def _ffn(self, i: int, h: torch.Tensor) -> torch.Tensor:
        return self._moe(i, h) if i in self.moe_index else self._mlp(self._p(i, self.cfg.mlp_prefix), h)

    def _layers_attn_res(self, x: torch.Tensor, seqs: list, spans: list) -> torch.Tensor:
        """The decoder layers with Block Attention Residuals (attn_res.py): each sublayer reads a
        softmax mix of the block summaries by its pseudo-query instead of the running sum.
        x: [tokens, hidden] embeddings -> the final hidden state."""
        cfg, w = self.cfg, self.w
        res = BlockAttnRes(x, cfg.rms_norm_eps)
        for i in range(cfg.num_layers):
            h = rms_norm(res.input(w[self._p(i, "attn_res.attn_query")]), w[self._p(i, "input_layernorm.weight")],
                         cfg.rms_norm_eps)
            res.add(self._attention(i, h, seqs, spans))
            h = rms_norm(res.input(w[self._p(i, "attn_res.mlp_query")]), w[self._p(i, "post_attention_layernorm.weight")],
                         cfg.rms_norm_eps)
            res.add(self._ffn(i, h))
            if (i + 1) % cfg.attn_res_block_layers == 0:
                res.end_block()
        return res.input(w["model.attn_res.final_query"])

    def _kv_indices(self, seqs: list, spans: list) -> dict:
        """Token slots of this forward, computed once for every layer: decode - each sequence's
        position, its write slot and its read slots [B, n] (padded with slot 0, masked out);
        prefill - per sequence (write slots of the new tokens, read slots of its whole context)."""
        if all(b - a == 1 for a, b in spans):
            pos = [s.length for s in seqs]
            n = max(pos) + 1
            read = torch.stack([s.slot_ids[:n] if s.slot_ids.numel() >= n else
                                torch.cat([s.slot_ids, s.slot_ids.new_zeros(n - s.slot_ids.numel())]) for s in seqs])
            write = torch.stack([s.slot_ids[p] for s, p in zip(seqs, pos)])
            pos_t = torch.tensor(pos, device=self.device)
            ctx = {"decode": (pos_t, write, read), "rope": self._rope(pos_t), "masks": {}}   # rope: cos, sin [B, hd]
            if self.kv.state_slots:
                ctx["state"] = torch.tensor([s.state for s in seqs], device=self.device)
                fresh = [s.state for s in seqs if s.length == 0]
                ctx["fresh"] = torch.tensor(fresh, device=self.device) if fresh else None
            if self.cfg.attention != "mla":   # cos, signed sin broadcast over heads: [B, 1, hd]
                cos, sin = ctx["rope"]
                ctx["rope_heads"] = (cos[:, None], signed_sin(sin)[:, None])
            return ctx
        ctx = {"prefill": [(s.slot_ids[s.length:s.length + b - a], s.slot_ids[:s.length + b - a])
                           for s, (a, b) in zip(seqs, spans)]}
        ctx["rope"] = [self._rope(torch.arange(s.length, s.length + b - a, device=self.device))
                       for s, (a, b) in zip(seqs, spans)]                          # per sequence: cos, sin [new, hd]
        if self.cfg.attention != "mla":
            ctx["rope_prefill"] = [(c[:, None], signed_sin(s_)[:, None]) for c, s_ in ctx["rope"]]
        return ctx

    def _decode_mask(self, i: int) -> torch.Tensor:
        """Keys each decoding sequence attends to in a paged layer: [B, 1, 1, n] bool, made once
        per forward (sliding-window layers keep rings: _window_attention)."""
        masks = self._ctx["masks"]
        mask = masks.get("full")
        if mask is None:
            pos, _, r_idx = self._ctx["decode"]
            keys = torch.arange(r_idx.shape[1], device=pos.device)[None, :]
            mask = masks["full"] = (keys <= pos[:, None])[:, None, None, :]   # mask: [B, 1, 1, n]
        return mask

    def _qk_norm_w(self, i: int) -> torch.Tensor:
        """Per-head q and k norm weights stacked for the joint norm: [heads + kv, hd]."""
        t = self._qk_w.get(i)
        if t is None:
            cfg, w = self.cfg, self.w
            q, k = w[self._p(i, "self_attn.q_norm.weight")], w[self._p(i, "self_attn.k_norm.weight")]
            t = self._qk_w[i] = torch.cat([q.expand(cfg.num_heads, -1), k.expand(cfg.num_kv_heads, -1)])
        return t

    @torch.inference_mode()
    def forward(self, seqs: list, chunks: list) -> torch.Tensor:
        """Run new tokens of several sequences. chunks[j]: token ids of seqs[j] (prefill chunk or one
        decode token). Returns logits of each chunk's last token: [len(seqs), vocab].

        Intra-op threads: at most one per ``tokens_per_thread`` tokens of the forward (never more
        than torch's setting). A decode step's ops are small - matmuls of a few rows, elementwise
        ops of a few KiB - and split across threads each pays a fork/join that costs more than it
        saves, and waits for the slowest thread (a core busy with anything else stalls every op):
        on this project's 2-core machine, shared with other jobs, a 2-row expert matmul took 0.6 ms
        on one thread and 3 ms on two, and a 64-token prefill of the mid-size checkpoint of
        bench/decode_speed.py 0.56 s and 2.5 s. Large forwards (long prefills, big batches) use
        every thread; on a machine whose cores are busy anyway, ``--threads 1`` is faster still."""
        want = torch.get_num_threads()
        use = max(1, min(want, sum(len(c) for c in chunks) // self.tokens_per_thread))
        if use == want:
            return self._forward(seqs, chunks)
        torch.set_num_threads(use)
        try:
            return self._forward(seqs, chunks)
        finally:
            torch.set_num_threads(want)

    def _forward(self, seqs: list, chunks: list) -> torch.Tensor:
        cfg, w = self.cfg, self.w
        flat = [t for c in chunks for t in c]
        spans, a = [], 0
        for c in chunks:
            spans.append((a, a + len(c)))
            a += len(c)
        if self.kv is None:
            self.init_kv()
        for sq, c in zip(seqs, chunks):
            if not self.kv.ensure(sq, sq.length + len(c)):
                raise KVFull(f"the KV cache ({self.kv.num_blocks} blocks of {self.kv.block_size} tokens) has no free "
                             f"block for a sequence of {sq.length + len(c)} tokens")
        self._ctx = self._kv_indices(seqs, spans)
        x = w["model.embed_tokens.weight"][torch.tensor(flat, device=self.device)]  # x: [tokens, hidden]
        if cfg.attn_res_block_layers:
            x = self._layers_attn_res(x, seqs, spans)
        else:
            for i in range(cfg.num_layers):
                h = rms_norm(x, w[self._p(i, "input_layernorm.weight")], cfg.rms_norm_eps)
                x = x + self._attention(i, h, seqs, spans)
                h = rms_norm(x, w[self._p(i, "post_attention_layernorm.weight")], cfg.rms_norm_eps)
                x = x + self._ffn(i, h)
        for s, c in zip(seqs, chunks):
            s.length += len(c)
        last = torch.tensor([b - 1 for _, b in spans], device=self.device)
        h = rms_norm(x[last], w["model.norm.weight"], cfg.rms_norm_eps)
        if self.head_t is not None:
            return torch.mm(h, self.head_t).float()
        return F.linear(h, w["model.embed_tokens.weight"]).float()   # tied: the embedding's rows

