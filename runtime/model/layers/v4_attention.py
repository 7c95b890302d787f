"""DeepSeek-V4 attention (transformers 5.24's ``DeepseekV4Attention``, the paper's CSA / HCA): one shared
K=V head per layer over

* a **sliding window** of the last ``sliding_window`` tokens (every layer), and
* **compressed entries** (CSA and HCA layers): every ``rate`` tokens a compressor pools one entry from
  its window of raw projections, softmax-gated per channel with a learned position bias, RMS-normed
  and rotated at the window's first position. HCA (rate 128) pools each window alone; CSA (rate 4)
  pools the previous window's first half-projection (Ca) with its own second half (Cb), and a
  lightning indexer (its own compressor at ``index_head_dim``, ReLU scores of its own queries,
  weighted per head) picks the ``index_topk`` entries each query attends to. A query sees an entry
  once its window is complete.

Queries come through a low-rank path (q_a -> RMSNorm -> q_b -> RMSNorm per head without a weight), q and
the K=V head carry interleaved RoPE on their last ``qk_rope_head_dim`` channels (``main`` θ on
sliding layers, the compress θ and scaling elsewhere), each head's softmax has a learned sink logit,
the output's rotary channels are rotated back by the query's position (V carried RoPE too), and the
heads go out through a grouped low-rank projection (o_a per group of heads, then o_b).

What a layer keeps per sequence (``CompressedCacheSpec``): a ring of its last ``window`` K=V rows; the
compressed entries (and the indexer's keys) in blocks of the paged allocator, ``block_size / rate`` per
block, so they grow with the sequence at ``(head_dim + index_head_dim) / rate`` values per token; and
the compressor's state - the raw projections of the window still open, and (CSA) the first half of the
last complete window. Everything the layer needs to continue a sequence is there, so a prompt fed in
chunks, token by token or with other sequences gives the same result as in one piece (tested against
transformers, which keeps the same state in its cache layers)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..config import MoEConfig
from .cache import CacheTensor
from .context import ForwardContext
from .rope import inv_frequencies
from .weights import layer_prefix, take
from .protocol import HeadSplit, Sublayer


@dataclass(frozen=True)
class CompressedCacheSpec:
    """What a DeepSeek-V4 layer caches: per sequence a ring of ``window`` K=V rows of ``dim`` and the
    compressor's open window (raw kv and gate projections of ``width`` per row, ``rate`` rows; CSA also the
    last complete window's first half, and the indexer's of ``index_width``); per ``rate`` tokens one
    entry of ``dim`` (+ ``index_dim`` for the indexer's key). rate 0: a sliding layer (the ring only)."""
    dim: int
    window: int
    rate: int = 0
    width: int = 0             # raw projection width: dim (HCA) or 2 dim (CSA: Ca | Cb)
    index_dim: int = 0         # CSA: the indexer's key width
    overlap: bool = False      # CSA: keeps the last complete window's Ca

    def bytes_per_token(self, dtype) -> float:
        if not self.rate:
            return 0
        b = (self.dim + self.index_dim) * _size(dtype)
        return b // self.rate if b % self.rate == 0 else b / self.rate

    def entries_per_block(self, block_size: int) -> int:
        return block_size // self.rate if self.rate else 0

    def state_shapes(self) -> dict:
        """name -> per-sequence shape of the fixed state (the ring and the compressor's)."""
        out = {"ring": (self.window, self.dim)}
        if self.rate:
            out.update(buf_kv=(self.rate, self.width), buf_gate=(self.rate, self.width))
            if self.overlap:
                out.update(ov_kv=(self.rate, self.dim), ov_gate=(self.rate, self.dim))
            if self.index_dim:
                out.update(ibuf_kv=(self.rate, 2 * self.index_dim), ibuf_gate=(self.rate, 2 * self.index_dim),
                           iov_kv=(self.rate, self.index_dim), iov_gate=(self.rate, self.index_dim))
        return out

    def bytes_per_sequence(self, dtype) -> int:
        return sum(int(torch.Size(s).numel()) for s in self.state_shapes().values()) * _size(dtype)

    def cache_tensors(self) -> dict:
        """The fixed state per slot (``state_shapes``), and per ``rate`` positions a compressed entry ``comp``
        [dim] (CSA also the indexer's key ``icomp`` [index_dim]) in the sequence's KV blocks."""
        out = {k: CacheTensor(shape, "slot") for k, shape in self.state_shapes().items()}
        if self.rate:
            out["comp"] = CacheTensor((self.dim,), "block", rate=self.rate)
            if self.index_dim:
                out["icomp"] = CacheTensor((self.index_dim,), "block", rate=self.rate)
        return out


def entry_rows(cache, seq, name: str):
    """(read(count) -> the sequence's first ``count`` entries [count, dim], write(e, row)) of a layer's
    compressed entries ``name`` (comp or icomp; cache: its ``LayerCache``); (None, None) where the layer
    has none. Entry e lies in the block that holds its window's first position, e * rate."""
    arena = cache.tensors.get(name)
    if arena is None:
        return None, None
    rate, bs = cache.spec.rate, cache.block_size
    epb = bs // rate                                                     # entries per block

    def read(count: int):
        p = torch.arange(count, device=arena.device) * rate              # each entry's first position
        blocks = torch.as_tensor(seq.blocks[: -(-count * rate // bs)] or [0], device=arena.device)
        return arena[blocks[p // bs] * epb + (p % bs) // rate]

    def write(e: int, row) -> None:
        p = e * rate
        arena[seq.blocks[p // bs] * epb + (p % bs) // rate] = row
    return read, write


def _size(dtype) -> int:
    return torch.tensor([], dtype=dtype).element_size()


def rope_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rd: int) -> torch.Tensor:
    """Interleaved RoPE on the last ``rd`` channels of x [..., d]: pair (2i, 2i+1) turned by angle i.
    cos, sin: [..., rd / 2], broadcast over x's leading dims."""
    nope, r = x[..., :-rd], x[..., -rd:]
    r1, r2 = r[..., 0::2], r[..., 1::2]
    rot = torch.stack((r1 * cos - r2 * sin, r2 * cos + r1 * sin), -1).flatten(-2)
    return torch.cat((nope, rot), -1)


def unweighted_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)


class Compressor:
    """One series of compressed entries (the layer's, or the CSA indexer's): ``dim`` wide, one per
    ``rate`` tokens; ``overlap``: CSA's two half-projections (entry e pools the Ca of window e - 1 and the
    Cb of window e), else each window alone."""

    def __init__(self, w: dict, p: str, dim: int, rate: int, overlap: bool, eps: float, rd: int, inv) -> None:
        self.kv, self.gate = take(w, p + "kv_proj.weight"), take(w, p + "gate_proj.weight")
        self.bias = take(w, p + "position_bias")                         # [rate, width]
        self.norm = take(w, p + "kv_norm.weight")
        self.dim, self.rate, self.overlap, self.eps, self.rd, self.inv = dim, rate, overlap, eps, rd, inv

    @staticmethod
    def tensors(p: str, H: int, dim: int, rate: int, overlap: bool) -> dict:
        width = 2 * dim if overlap else dim
        return {p + "kv_proj.weight": (width, H), p + "gate_proj.weight": (width, H), p + "position_bias": (rate, width),
                p + "kv_norm.weight": (dim,)}

    def __call__(self, x: torch.Tensor, p0: int, st: dict, pre: str, entries: "callable") -> None:
        """x: [n, hidden], the tokens at positions p0 .. p0 + n - 1 of one sequence. Completes the windows
        they close, writing entry e through ``entries(e, row)``; keeps the open window's rows in the
        sequence's state ``st`` (names prefixed ``pre``)."""
        R, D = self.rate, self.dim
        kv, gate = F.linear(x, self.kv), F.linear(x, self.gate)          # [n, width]
        held = p0 % R                                                    # rows of the open window already in the state
        if held:
            kv = torch.cat([st[pre + "buf_kv"][:held], kv])
            gate = torch.cat([st[pre + "buf_gate"][:held], gate])
        start = p0 - held                                                # position of kv's first row
        full = (kv.shape[0] // R) * R
        left = kv.shape[0] - full
        if left:
            st[pre + "buf_kv"][:left] = kv[full:]
            st[pre + "buf_gate"][:left] = gate[full:]
        if not full:
            return
        nw = full // R
        ckv = kv[:full].view(nw, R, -1)
        cg = gate[:full].view(nw, R, -1) + self.bias                     # [windows, rate, width]
        e0 = start // R                                                  # the first window's entry
        if self.overlap:
            slots_kv = ckv.new_zeros(nw, 2 * R, D)
            slots_g = cg.new_full((nw, 2 * R, D), float("-inf"))
            slots_kv[:, R:], slots_g[:, R:] = ckv[..., D:], cg[..., D:]              # Cb of the window
            slots_kv[1:, :R], slots_g[1:, :R] = ckv[:-1, :, :D], cg[:-1, :, :D]       # Ca of the window before
            if e0 > 0:                                                   # that window closed in an earlier call
                slots_kv[0, :R], slots_g[0, :R] = st[pre + "ov_kv"], st[pre + "ov_gate"]
            st[pre + "ov_kv"][:] = ckv[-1, :, :D]
            st[pre + "ov_gate"][:] = cg[-1, :, :D]
            ckv, cg = slots_kv, slots_g
        pooled = (ckv * cg.softmax(dim=1, dtype=torch.float32).to(ckv.dtype)).sum(1)   # [windows, dim]
        pooled = rms(pooled, self.norm, self.eps)
        pos = torch.arange(nw, dtype=torch.float32, device=pooled.device) * R + start
        ang = pos[:, None] * self.inv[None, :]
        pooled = rope_tail(pooled, ang.cos(), ang.sin(), self.rd)
        for j in range(nw):
            entries(e0 + j, pooled[j])


class V4Attention(Sublayer):
    """DeepSeek-V4 attention of layer ``i`` (its cache: ``kv[i]``, as ``cache_spec`` declares it)."""

    def __init__(self, cfg: MoEConfig, i: int, w: dict) -> None:
        p = layer_prefix(i) + "self_attn."
        self.i, v4 = i, cfg.v4
        self.kind = v4.kinds[i]
        self.nh, self.hd, self.rd, self.W, self.eps = (cfg.num_heads, cfg.head_dim, v4.rope_head_dim, v4.window,
                                                       cfg.rms_norm_eps)
        self.g = v4.o_groups
        self.q_a, self.q_a_norm, self.q_b = take(w, p + "q_a_proj.weight"), take(w, p + "q_a_norm.weight"), \
            take(w, p + "q_b_proj.weight")
        self.kv, self.kv_norm = take(w, p + "kv_proj.weight"), take(w, p + "kv_norm.weight")
        self.o_a, self.o_b = take(w, p + "o_a_proj.weight"), take(w, p + "o_b_proj.weight")
        self.sinks = take(w, p + "sinks")
        self.inv = rope_inv(cfg, self.kind).to(self.q_a.device)
        self.comp = self.index = None
        if self.kind != "sliding":
            self.rate = v4.compress_rates[self.kind]
            csa = self.kind == "csa"
            self.comp = Compressor(w, p + "compressor.", self.hd, self.rate, csa, self.eps, self.rd, self.inv)
            if csa:
                q = p + "compressor.indexer."
                self.index = Compressor(w, q, v4.index_head_dim, self.rate, True, self.eps, self.rd, self.inv)
                self.iq_b = take(w, q + "q_b_proj.weight")
                self.iw = take(w, q + "scorer.weights_proj.weight")
                self.ih, self.idim, self.topk = v4.index_n_heads, v4.index_head_dim, v4.index_topk

    @classmethod
    def head_split(cls, cfg: MoEConfig, shard) -> HeadSplit:
        return HeadSplit(why="DeepSeek-V4's attention has one shared K=V head")   # every rank runs it whole

    @staticmethod
    def cache_spec(cfg: MoEConfig, i: int) -> CompressedCacheSpec:
        v4 = cfg.v4
        kind = v4.kinds[i]
        if kind == "sliding":
            return CompressedCacheSpec(cfg.head_dim, v4.window)
        csa = kind == "csa"
        return CompressedCacheSpec(cfg.head_dim, v4.window, v4.compress_rates[kind],
                                   (2 if csa else 1) * cfg.head_dim, v4.index_head_dim if csa else 0, csa)

    @staticmethod
    def tensors(cfg: MoEConfig, i: int) -> dict:
        p, H, hd, nh, v4 = layer_prefix(i) + "self_attn.", cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.v4
        qr, og, orank = v4.q_lora_rank, v4.o_groups, v4.o_lora_rank
        out = {p + "q_a_proj.weight": (qr, H), p + "q_a_norm.weight": (qr,),
               p + "q_b_proj.weight": (nh * hd, qr), p + "kv_proj.weight": (hd, H),
               p + "kv_norm.weight": (hd,), p + "o_a_proj.weight": (og * orank, nh * hd // og),
               p + "o_b_proj.weight": (H, og * orank), p + "sinks": (nh,)}
        kind = v4.kinds[i]
        if kind != "sliding":
            rate, csa = v4.compress_rates[kind], kind == "csa"
            out.update(Compressor.tensors(p + "compressor.", H, hd, rate, csa))
            if csa:
                q = p + "compressor.indexer."
                out.update(Compressor.tensors(q, H, v4.index_head_dim, rate, True))
                out.update({q + "q_b_proj.weight": (v4.index_n_heads * v4.index_head_dim, qr),
                            q + "scorer.weights_proj.weight": (v4.index_n_heads, H)})
        return out

    # -- one sequence's tokens -------------------------------------------------------------------
    def _run(self, x: torch.Tensor, p0: int, st: dict, comp_rows, icomp_rows) -> torch.Tensor:
        """x: [n, hidden] of one sequence at positions p0 .. p0 + n - 1; st: its state views (ring,
        compressor); comp_rows / icomp_rows(count) -> the first ``count`` compressed entries / indexer
        keys of the sequence as [count, dim] views, and (e, row) -> writes entry e. Returns [n, hidden]."""
        n, nh, hd, rd, W, eps = x.shape[0], self.nh, self.hd, self.rd, self.W, self.eps
        dev = x.device
        pos = torch.arange(p0, p0 + n, device=dev)
        ang = pos.float()[:, None] * self.inv[None, :]
        cos, sin = ang.cos(), ang.sin()                                  # [n, rd / 2]
        q_res = rms(F.linear(x, self.q_a), self.q_a_norm, eps)           # q_res: [n, q_lora]
        q = unweighted_rms(F.linear(q_res, self.q_b).view(n, nh, hd), eps)
        q = rope_tail(q, cos[:, None], sin[:, None], rd)                  # q: [n, heads, hd]
        kv = rope_tail(rms(F.linear(x, self.kv), self.kv_norm, eps), cos, sin, rd)   # kv: [n, hd]
        # the window: the ring's rows (positions p0 - W .. p0 - 1, those >= 0), then the new ones
        ring = st["ring"]                                                # [W, hd], position t at t % W
        rpos = torch.arange(W, device=dev)
        held = (p0 - 1) - (p0 - 1 - rpos) % W                            # position in each ring row (< 0: none)
        keys = torch.cat([ring, kv])                                     # [W + n, hd]
        kpos = torch.cat([held, pos])
        mask = (kpos[None, :] <= pos[:, None]) & (kpos[None, :] > pos[:, None] - W) & (kpos[None, :] >= 0)   # [n, W + n]
        if self.comp is not None:
            R = self.rate
            self.comp(x, p0, st, "", comp_rows[1])
            T = (p0 + n) // R                                            # entries complete after these tokens
            ent = comp_rows[0](T)                                        # [T, hd]
            visible = torch.arange(T, device=dev)[None, :] < ((pos + 1) // R)[:, None]   # [n, T]: the window closed by then
            if self.index is not None:
                self.index(x, p0, st, "i", icomp_rows[1])
                visible = visible & self._indexed(x, q_res, cos, sin, icomp_rows[0](T), visible)
            keys = torch.cat([keys, ent])
            mask = torch.cat([mask, visible], 1)
        s = torch.einsum("nhd,kd->nhk", q, keys) * hd ** -0.5            # [n, heads, keys]
        s = s.masked_fill(~mask[:, None, :], float("-inf"))
        sink = self.sinks.float().view(1, nh, 1).expand(n, nh, 1)
        logits = torch.cat([s, sink], -1)
        logits = logits - logits.max(-1, keepdim=True).values
        p = logits.softmax(-1)[..., :-1].to(keys.dtype)
        o = torch.einsum("nhk,kd->nhd", p, keys)                         # o: [n, heads, hd]
        o = rope_tail(o, cos[:, None], -sin[:, None], rd)                # V carried RoPE: turned back by -position
        og = o.reshape(n, self.g, -1)                                    # og: [n, groups, heads / groups * hd]
        y = torch.einsum("ngi,goi->ngo", og, self.o_a.view(self.g, -1, og.shape[-1])).reshape(n, -1)
        m = min(n, W)                                                    # the last W tokens stay in the ring
        ring[pos[n - m:] % W] = kv[n - m:]
        return F.linear(y, self.o_b)

    def _indexed(self, x, q_res, cos, sin, keys, visible) -> torch.Tensor:
        """CSA: the ``index_topk`` entries each query picks among those it may see -> [n, T] bool."""
        n, T = x.shape[0], keys.shape[0]
        if T == 0:
            return visible
        q = F.linear(q_res, self.iq_b).view(n, self.ih, self.idim)
        q = rope_tail(q, cos[:, None], sin[:, None], self.rd)            # [n, heads, idim]
        sc = F.relu(torch.einsum("nhd,td->nht", q.float(), keys.float())) * self.idim ** -0.5
        wts = F.linear(x, self.iw).float() * self.ih ** -0.5             # [n, heads]
        score = (sc * wts[:, :, None]).sum(1)                            # [n, T]
        score = score.masked_fill(~visible, float("-inf"))
        top = score.topk(min(self.topk, T), dim=-1).indices              # [n, k]
        pick = torch.zeros(n, T + 1, dtype=torch.bool, device=x.device)
        pick.scatter_(1, torch.where(torch.gather(visible, 1, top), top, T), True)
        return pick[:, :T]

    def __call__(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """x: [tokens, hidden], tokens of several sequences back to back (ctx.spans)."""
        out = torch.empty_like(x)
        cache = ctx.kv[self.i]
        state = cache.slot_tensors()                                     # name -> [slots, ...]
        for s, (a, b) in zip(ctx.seqs, ctx.spans):
            st = {k: t[s.state] for k, t in state.items()}
            out[a:b] = self._run(x[a:b], s.length, st, entry_rows(cache, s, "comp"), entry_rows(cache, s, "icomp"))
        return out


def rope_inv(cfg: MoEConfig, kind: str) -> torch.Tensor:
    """Inverse frequencies of a layer's RoPE: θ = rope_theta on sliding layers, the compress θ and its
    YaRN scaling (attention factor 1: cos / sin unscaled, as the reference applies it) elsewhere."""
    v4 = cfg.v4
    if kind == "sliding":
        inv, _ = inv_frequencies(v4.rope_head_dim, cfg.rope_theta, {}, cfg.max_position_embeddings)
    else:
        inv, _ = inv_frequencies(v4.rope_head_dim, v4.compress_rope_theta, v4.compress_rope_scaling,
                                 cfg.max_position_embeddings)
    return inv.float()
