"""CPU decode of an attention + MoE (or dense MLP) decoder layer in two or three host-kernel calls
(runtime/kernels/moe_cpu.c); layers/fused_step.py runs a step's consecutive ones in one.

A decode step of the composed layers runs ~25 small ops per layer - norms, projections, RoPE, the
cache writes, attention, the residual adds, the router's softmax and top-k, the dispatch in numpy -
each costing 3-10 us of Python and dispatch around a few us of work; on a mid-size model that was
more time than the weights took to read (bench/results/vs_llama_cpp.md). Here one call - ``tm_attn_block``
for GQA (sliding-window rings, sinks and Qwen3-Next's output gate included), ``tm_mla_block`` for MLA
(weight absorption over the latent cache), ``tm_gdn_block`` for Gated DeltaNet and KDA (the recurrent state
in place) - does x += o(mixer(rmsnorm(x))), h = rmsnorm(x), the router's logits, its top-k and the dispatch (each expert's rows, as ``moe_block.dispatch`` sorts them); Python then asks the
expert store for those experts exactly as the composed block does (placement, hit counting, hybrid
decisions and the recorded routing stay where they are), and ``tm_moe`` adds the experts' weighted
sum into x. The shared experts, prefetch hooks and every case the kernel does not take (experts still
streaming in, waves, more rows than the kernel's GEMV takes) run through the composed block's own code. A
dense MLP layer (DeepSeek's first layers, Qwen3-Next's mlp_only_layers) takes the same call without a router:
it stops at the post-attention norm, and the MLP's two projections run on its output.

It is a backend of the layer objects: ``build_fused`` gives each decoder layer a ``FusedDecode`` (its
``forward`` from then on) where the layer's sublayers and the kernel's limits allow, else None and why
(``why_not``; the sublayers answer for themselves through layers/protocol.py, and name their kernel
through ``fused_part``, a key of ``ATTENTION_PARTS``): LatentMoE, routers other than
softmax -> top-k, top-k -> softmax and sigmoid with group-limited top-k, weights the kernels cannot read
in place. Those layers run composed in the same step."""
from __future__ import annotations

import ctypes
import time

import numpy as np
import torch

from ... import kernels
from .attention import ring_addressing
from .dense import Linear
from .experts import record_host_share, weighted_sum
from .mlp import DenseMLP

_P, _I32, _I64, _F = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_float
ROUTER_CODES = {"softmax_topk": 0, "topk_softmax": 1, "sigmoid_group": 2, "softmax_group": 3}
ROUTER_NONE = -1          # a dense MLP layer: no router, the kernel stops at the post-attention norm
QK_NORM_CODES = {None: 0, "none": 0, "head": 1, "full": 2}


class LinDesc(ctypes.Structure):
    _fields_ = [("kind", _I32), ("fmt", _I32), ("sfmt", _I32), ("group", _I32), ("q8", _I32), ("K", _I64), ("N", _I64),
                ("W", _P), ("S", _P), ("bias", _P)]


class LayerArgs(ctypes.Structure):
    _fields_ = [("H", _I32), ("nh", _I32), ("nkv", _I32), ("hd", _I32), ("rd", _I32), ("qk_norm", _I32), ("E", _I32),
                ("k", _I32), ("router", _I32), ("renorm", _I32), ("n_group", _I32), ("topk_group", _I32),
                ("eps", _F), ("scale", _F), ("route_scale", _F),
                ("in_norm", _P), ("post_norm", _P), ("q_norm", _P), ("k_norm", _P), ("correction", _P),
                ("qkv", LinDesc), ("o", LinDesc), ("gate", LinDesc), ("K", _P), ("V", _P),
                ("slots", _I64),            # rows of K / V: the C checks every write / read slot below it
                ("sinks", _P),              # [nh] float32 attention sinks (gpt-oss), or NULL
                ("gated", _I32)]            # 1: qkv ends with the output gate (Qwen3-Next), att *= sigmoid(gate)


class MLAArgs(ctypes.Structure):
    """moe_cpu.c's tm_mla_t: the MLA half of a layer's arguments (the rest in LayerArgs)."""
    _fields_ = [("nope", _I32), ("rope", _I32), ("vd", _I32), ("lat", _I32), ("q_lora", _I32), ("rot", _I32),
                ("lat_eps", _F), ("q_a", LinDesc), ("q", LinDesc), ("kv_a", LinDesc), ("q_a_norm", _P),
                ("kv_a_norm", _P), ("kv_b", _P), ("cache", _P), ("slots", _I64)]


class StepArgs(ctypes.Structure):
    _fields_ = [("B", _I64), ("n", _I64), ("x", _P), ("cos", _P), ("ssin", _P), ("write", _P), ("read", _P), ("pos", _P),
                ("h", _P), ("qkv", _P), ("att", _P), ("tmp", _P), ("scores", _P), ("logits", _P), ("wts", _P),
                ("ids", _P), ("xq", _P), ("xd", _P), ("n_used", _P), ("used", _P), ("counts", _P), ("row0", _P),
                ("rows", _P), ("tok", _P), ("back", _P), ("nthreads", _I32),
                # the scratch's sizes (StepBuffers._alloc): the C refuses a batch or layer past them
                ("cap_B", _I64), ("cap_n", _I64), ("cap_H", _I64), ("cap_qkv", _I64), ("cap_att", _I64),
                ("cap_heads", _I64), ("cap_E", _I64), ("cap_k", _I64), ("cap_K", _I64)]


def lin_desc(lin: Linear) -> "LinDesc | None":
    """The C view of a Linear (weights where the Linear holds them), or None where it has none."""
    d = LinDesc()
    d.K, d.N = lin.in_features, lin.out_features
    if lin.quant != "none":
        a = lin.args
        d.kind, d.fmt, d.sfmt, d.group, d.q8, d.W, d.S = 2, a.fmt, a.sfmt, a.group, a.q8, a.W, a.S
        d.bias = lin.bias32.data_ptr() if lin.bias32 is not None else None
        return d
    if lin.dtype != torch.float32 or (lin.b is not None and lin.b.dtype != torch.float32):
        return None
    if lin.kept:
        d.kind, d.W = 1, lin.w.data_ptr()
    elif lin.wt is not None and lin.wt.dtype == torch.float32 and lin.wt.is_contiguous() and lin.wt.device.type == "cpu":
        d.kind, d.W = 0, lin.wt.data_ptr()
    else:
        return None
    d.bias = lin.b.data_ptr() if lin.b is not None else None
    return d


def _f32(t: torch.Tensor, keep: list) -> int:
    """The address of t as a contiguous float32 tensor, kept alive in ``keep``."""
    keep.append(t.detach().float().contiguous())
    return keep[-1].data_ptr()


class GQAPart:
    """The attention half of a fused GQA layer (``tm_attn_block``): fills the layer's arguments, says the
    step scratch it needs, and runs the call over the paged cache or the layer's window ring."""

    def __init__(self, attn, L: LayerArgs, keep: list) -> None:
        self.attn = attn
        L.nh, L.nkv, L.hd = attn.nh, attn.nkv, attn.hd
        L.rd = 0 if attn.no_rope else attn.rotary_dim or attn.hd          # 0: no RoPE (the kernel passes no cos)
        L.qk_norm = QK_NORM_CODES[attn.qk_norm]
        L.scale = attn.hd ** -0.5
        if attn.qk_norm == "head":
            L.q_norm = _f32(attn.qk_w.weight, keep)
        elif attn.qk_norm == "full":
            L.q_norm, L.k_norm = _f32(attn.q_norm.weight, keep), _f32(attn.k_norm.weight, keep)
        if attn.sinks is not None:
            L.sinks = _f32(attn.sinks, keep)
        L.qkv, L.o = lin_desc(attn.qkv), lin_desc(attn.o)
        L.gated = int(bool(attn.gated))
        self.widths = (L.qkv.N, L.o.K, attn.nh, max(L.qkv.K, L.o.K))    # qkv, att, heads, widest input
        self.ring = attn.window if attn.windowed else 0
        self.chunked = attn.chunked       # Llama 4's chunked ring: only its addressing differs
        self._kv = None

    @staticmethod
    def why_not(attn, cfg) -> "str | None":
        if attn.qk_norm not in QK_NORM_CODES:
            return f"q/k norm {attn.qk_norm!r}"
        if (attn.rotary_dim or attn.hd) > 1024:
            return "sizes past the kernel's limits"
        if any(lin_desc(lin) is None for lin in (attn.qkv, attn.o)):
            return "projections the kernels cannot read in place"
        return None

    kind = 0                              # tm_fused_layer_t.kind: tm_attn_block

    def prepare(self, L: LayerArgs, ctx):
        """Point the layer's arguments at this forward's cache; -> (the kernel's extra arguments (none), a window
        ring's (write, read, pos) for this step or None)."""
        kv = ctx.kv
        if kv is not self._kv:            # the cache arena this layer reads (fixed once the engine made it)
            self._kv = kv
            cache = kv[self.attn.i]
            L.K, L.V = cache.k.data_ptr(), cache.v.data_ptr()
            L.slots = cache.k.numel() // (L.nkv * L.hd)                  # [slots, nkv, hd] rows it holds
        # a window ring [slots, W, kv, hd] read as rows [slots * W, kv, hd]: the step's ring rows in place of
        # its paged ones (attention.ring_addressing, shared by the step's window layers)
        return None, (ring_addressing(ctx, self.ring, self.chunked) if self.ring else None)

    def __call__(self, lib, L: LayerArgs, a: StepArgs, ctx) -> int:
        _, ring = self.prepare(L, ctx)
        if ring is None:
            return lib.tm_attn_block(ctypes.byref(L), ctypes.byref(a))
        write, read, pos = ring
        paged = a.write, a.read, a.n, a.pos
        a.write, a.read, a.n, a.pos = write.data_ptr(), read.data_ptr(), read.shape[1], pos.data_ptr()
        try:
            return lib.tm_attn_block(ctypes.byref(L), ctypes.byref(a))
        finally:
            a.write, a.read, a.n, a.pos = paged


# MLAttention.rotation (layers/rope.py's rotations) as tm_mla_t.rot codes
MLA_ROT = {"none": 0, "half": 1, "interleaved": 2}


class MLAPart:
    """The attention half of a fused MLA layer (``tm_mla_block``): q through q_a -> norm -> q_b or q_proj,
    the latent and its rotary key from kv_a, attention in the latent space with kv_b absorbed - the
    composed ``MLAttention._decode`` in one call."""

    def __init__(self, attn, L: LayerArgs, keep: list) -> None:
        self.attn = attn
        M = self.margs = MLAArgs()
        M.nope, M.rope, M.vd, M.lat = attn.nope, attn.rope, attn.vd, attn.lat
        M.rot, M.lat_eps, M.q_lora = MLA_ROT[attn.rotation], attn.eps, attn.q_lora
        if attn.q_lora:
            M.q_a, M.q, M.q_a_norm = lin_desc(attn.q_a), lin_desc(attn.q_b), _f32(attn.q_a_norm.weight, keep)
        else:
            M.q = lin_desc(attn.q)
        M.kv_a, M.kv_a_norm = lin_desc(attn.kv_a), _f32(attn.kv_a_norm.weight, keep)
        M.kv_b = _f32(attn.kv_b, keep)                                  # [nh (nope + vd), lat]
        L.nh, L.nkv, L.hd, L.scale = attn.nh, 1, attn.nope + attn.rope, attn.scale
        L.o = lin_desc(attn.o)
        nh, qk, w = attn.nh, attn.nope + attn.rope, attn.lat + attn.rope
        self.widths = (nh * qk + w + M.q_lora, nh * (attn.vd + 2 * attn.lat), nh,
                       max(L.o.K, attn.kv_a.in_features, M.q_lora))
        self.ring = 0
        self._kv = None

    @staticmethod
    def why_not(attn, cfg) -> "str | None":
        if attn.rotation not in MLA_ROT or attn.rope > 1024:
            return "a rotation or size the kernel does not take"
        if attn.rotation != "none" and (cfg.rotary_dim or cfg.head_dim) != attn.rope:
            return "the model's rotary tables are not the width of MLA's rotary key"
        lins = (attn.q_a, attn.q_b) if attn.q_lora else (attn.q,)
        if any(lin_desc(lin) is None for lin in (*lins, attn.kv_a, attn.o)):
            return "projections the kernels cannot read in place"
        if attn.kv_b.dtype != torch.float32:
            return "not float32"
        return None

    kind = 1                              # tm_mla_block

    def prepare(self, L: LayerArgs, ctx):
        M, kv = self.margs, ctx.kv
        if kv is not self._kv:
            self._kv = kv
            cache = kv[self.attn.i].k                                    # [slots, 1, lat + rope]
            M.cache, M.slots = cache.data_ptr(), cache.numel() // (M.lat + M.rope)
        return M, None

    def __call__(self, lib, L: LayerArgs, a: StepArgs, ctx) -> int:
        M, _ = self.prepare(L, ctx)
        return lib.tm_mla_block(ctypes.byref(L), ctypes.byref(M), ctypes.byref(a))


class GDNArgs(ctypes.Structure):
    """moe_cpu.c's tm_gdn_t: a linear-attention token mixer's half of a layer's arguments (Gated DeltaNet or KDA)."""
    _fields_ = [("kind", _I32), ("hk", _I32), ("hv", _I32), ("dk", _I32), ("dv", _I32), ("W", _I32), ("rank", _I32),
                ("norm_eps", _F), ("in_", LinDesc), ("f_a", LinDesc), ("f_b", LinDesc), ("b", LinDesc), ("g_a", LinDesc),
                ("g_b", LinDesc), ("conv", _P), ("A_log", _P), ("dt_bias", _P), ("norm", _P), ("R", _P), ("C", _P),
                ("slots", _I64), ("state", _P)]


def _delta_parts(mixer) -> tuple:
    """(kind code, the projections tm_gdn_block reads, in tm_gdn_t's order, and the output norm and projection)
    of a GatedDeltaNet or KimiDeltaAttention (runtime/model/linear_attention.py)."""
    if hasattr(mixer, "qkv_proj"):       # KDA
        return 1, (mixer.qkv_proj, mixer.f_a, mixer.f_b, mixer.b_proj, mixer.g_a, mixer.g_b), mixer.o_norm, mixer.o_proj
    return 0, (mixer.in_proj,), mixer.norm, mixer.out_proj


class DeltaPart:
    """The token-mixer half of a fused linear-attention layer (``tm_gdn_block``): Gated DeltaNet (Qwen3-Next /
    Qwen3.5) or Kimi Delta Attention (Kimi-Linear, Kimi K3) - the projections, the short convolution, the
    gated delta rule on each sequence's slot of the state arena (in place) and the gated output norm: the
    mixer's ``step`` and the arena's gather / scatter in one call."""

    def __init__(self, attn, L: LayerArgs, keep: list) -> None:
        self.attn = attn
        mixer, c = attn.layer, attn.layer.cfg
        kind, lins, norm, out = _delta_parts(mixer)
        G = self.gargs = GDNArgs()
        G.kind, G.W, G.norm_eps = kind, c.conv_kernel_size, c.rms_norm_eps
        if kind:
            G.hk = G.hv = c.num_heads
            G.dk = G.dv = c.head_dim
            G.rank = mixer.f_a.out_features
            G.in_, G.f_a, G.f_b, G.b, G.g_a, G.g_b = (lin_desc(lin) for lin in lins)
            width = 5 * c.num_heads * c.head_dim + c.num_heads + 2 * G.rank
        else:
            G.hk, G.hv, G.dk, G.dv = c.num_k_heads, c.num_v_heads, c.head_k_dim, c.head_v_dim
            G.in_ = lin_desc(lins[0])
            width = G.in_.N
        G.conv, G.A_log, G.dt_bias = _f32(mixer.conv, keep), _f32(mixer.A_log, keep), _f32(mixer.dt_bias, keep)
        G.norm = _f32(norm, keep)
        L.nh, L.nkv, L.hd, L.scale = G.hv, 1, G.dk, 1.0
        L.o = lin_desc(out)
        self.widths = (width, G.hv * G.dv, G.hv, max(max(lin.in_features for lin in lins), L.o.K))
        self.ring = 0
        self._kv = None

    @staticmethod
    def why_not(attn, cfg) -> "str | None":
        mixer = attn.layer
        _, lins, _, out = _delta_parts(mixer)
        if any(not isinstance(lin, Linear) or lin_desc(lin) is None for lin in (*lins, out)):
            return "projections the kernels cannot read in place"
        c = mixer.cfg
        if getattr(c, "head_v_dim", getattr(c, "head_dim", 0)) > 4096 or c.conv_kernel_size > 64:
            return "sizes past the kernel's limits"
        return None

    kind = 2                              # tm_gdn_block

    def __call__(self, lib, L: LayerArgs, a: StepArgs, ctx) -> int:
        G, _ = self.prepare(L, ctx)
        return lib.tm_gdn_block(ctypes.byref(L), ctypes.byref(G), ctypes.byref(a))

    def prepare(self, L: LayerArgs, ctx):
        G, kv = self.gargs, ctx.kv
        cache = kv[self.attn.i]
        if kv is not self._kv:            # the state arena this layer reads and writes in place
            R, C = cache.recurrent, cache.conv
            if R.dtype != torch.float32 or C.dtype != torch.float32 or not (R.is_contiguous() and C.is_contiguous()):
                raise RuntimeError(f"layer {self.attn.i}: the fused linear attention reads a contiguous float32 state "
                                   f"arena, got {R.dtype} / {C.dtype}")
            self._kv = kv
            G.R, G.C, G.slots = R.data_ptr(), C.data_ptr(), R.shape[0]
        if ctx.fresh is not None:         # a sequence's first token starts from the zero state
            cache.recurrent[ctx.fresh] = 0
            cache.conv[ctx.fresh] = 0
        G.state = ctx.state.data_ptr()    # [B] int64, alive with ctx for the call
        return G, None


class MLPArgs(ctypes.Structure):
    """moe_cpu.c's tm_mlp_t: a dense SwiGLU MLP (a MoE block's shared experts, a dense layer's MLP)."""
    _fields_ = [("H", _I32), ("I", _I32), ("act", _I32), ("limit", _F), ("gate_up", LinDesc), ("down", LinDesc),
                ("gate", LinDesc), ("scratch", _P), ("scratch_n", _I64)]


class MLPPart:
    """A ``DenseMLP`` after a fused block in one ``tm_mlp_block`` call - x += [sigmoid(gate h) *] down(act(gate_up
    h)) on the kernel's post-norm h - where Python ran its two projections, the activation and the gate's
    projection and sigmoid (~8 small ops) per layer and step. ``build`` gives None where a projection is not one
    the kernels read in place (the MLP then runs composed)."""

    def __init__(self, mlp: DenseMLP, gate: "Linear | None", descs: tuple) -> None:
        M = self.args = MLPArgs()
        M.H, M.I = mlp.down.out_features, mlp.inter
        M.act, M.limit = (2, mlp.limit) if mlp.limit else (0, 0.0)
        M.gate_up, M.down = descs[0], descs[1]
        if gate is not None:
            M.gate = descs[2]
        self.scratch = torch.empty(0)

    @staticmethod
    def build(mlp: "DenseMLP | None", gate: "Linear | None" = None) -> "MLPPart | None":
        if not isinstance(mlp, DenseMLP):
            return None
        lins = (mlp.gate_up, mlp.down) + ((gate,) if gate is not None else ())
        if not all(isinstance(lin, Linear) for lin in lins) or (gate is not None and gate.out_features != 1):
            return None
        descs = tuple(lin_desc(lin) for lin in lins)
        return None if any(d is None for d in descs) else MLPPart(mlp, gate, descs)

    def size(self, B: int) -> None:
        """Scratch for B rows (tm_mlp_block's: B (3 I + 1) floats), grown, never shrunk."""
        M = self.args
        need = B * (3 * M.I + 1)
        if self.scratch.numel() < need:
            self.scratch = torch.empty(need)
            M.scratch, M.scratch_n = self.scratch.data_ptr(), need

    def __call__(self, lib, a: StepArgs, B: int) -> None:
        M = self.args
        self.size(B)
        rc = lib.tm_mlp_block(ctypes.byref(M), ctypes.byref(a))
        if rc:
            raise RuntimeError(f"the fused MLP kernel refused (code {rc}: {lib.tm_strerror(rc).decode()})")


# attention sublayer's ``fused_part`` -> the part that runs it fused
ATTENTION_PARTS = {"gqa": GQAPart, "mla": MLAPart, "linear": DeltaPart}


class StepBuffers:
    """Scratch of one decode step, shared by the step's fused layers: sized by the largest layer
    (``dims``: hidden, qkv width, attention width, heads, experts, top-k, widest projection input),
    grown with the batch and the context, never shrunk."""

    def __init__(self, dims: tuple, ring: int = 0) -> None:
        self.dims = dims
        self.ring = ring                   # the widest window ring a fused layer reads (its scores are that long)
        self.B = self.n = 0
        self._views_B = -1
        self.x = self.ctx = None           # the forward the arguments point at (``begin``)
        self.args = StepArgs()

    def begin(self, x: torch.Tensor, ctx) -> StepArgs:
        """Point the step's arguments at this forward: x [B, hidden] (updated in place), the context's
        slots and rotary angles; (re)allocate the scratch if the step outgrew it."""
        B, n = x.shape[0], ctx.read.shape[1]
        if B > self.B or max(n, self.ring) > self.n:     # scores: as long as the paged context or a window ring
            self._alloc(max(B, self.B), max(n, self.ring, 2 * self.n, 64))
        a = self.args
        # no rotary tables where no layer reads them (a model whose fused layers are all linear attention)
        cos, ssin = ctx.rope_heads if ctx.rope_heads is not None else (None, None)
        a.B, a.n, a.x = B, n, x.data_ptr()
        a.cos, a.ssin = (cos.data_ptr(), ssin.data_ptr()) if cos is not None else (None, None)
        a.write, a.read, a.pos = ctx.write.data_ptr(), ctx.read.data_ptr(), ctx.pos.data_ptr()
        a.nthreads = kernels.threads()
        self.x, self.ctx, self.Bk = x, ctx, B * self.dims[5]
        self._keep = (cos, ssin)
        if B != self._views_B:             # this batch's rows of the step buffers, as tensors / arrays
            self._views_B = B
            self.hB, self.wtsB, self.idsB = self.h[:B], self.wts[:B], self.ids_np[:B]
            self.tokB, self.backB = self.tok[:self.Bk], self.back[:self.Bk]
        return a

    def _alloc(self, B: int, n: int) -> None:
        H, qkv, att, heads, E, k, K_max = self.dims
        E, k = max(E, 1), max(k, 1)        # dense layers alone route nothing: the router's buffers still exist
        self.B, self.n = B, n
        f = lambda *s: torch.empty(*s)                                       # noqa: E731
        self.h, self.qkv, self.att, self.tmp = f(B, H), f(B, qkv), f(B, att), f(B, H)
        self.scores, self.logits, self.wts = f(B * heads * n), f(B, E), f(B, k)
        self.ids = torch.empty(B, k, dtype=torch.int64)
        self.ids_np = self.ids.numpy()
        self._views_B = -1
        self.xq = torch.empty(B * K_max, dtype=torch.int8)
        self.xd = torch.empty(B * kernels.lib().tm_q8_ldd(K_max))
        self.nused = np.zeros(1, np.int64)
        self.used, self.counts, self.row0, self.rows = (np.zeros(E, np.int64) for _ in range(4))
        self.tok, self.back = torch.empty(B * k, dtype=torch.int64), torch.empty(B * k, dtype=torch.int64)
        self.xs, self.ys = f(B * k, H), f(B * k, H)
        a = self.args
        for name in ("h", "qkv", "att", "tmp", "scores", "logits", "wts", "ids", "xq", "xd", "tok", "back"):
            setattr(a, name, getattr(self, name).data_ptr())
        for name, arr in (("n_used", self.nused), ("used", self.used), ("counts", self.counts), ("row0", self.row0),
                          ("rows", self.rows)):
            setattr(a, name, arr.ctypes.data)
        a.cap_B, a.cap_n = B, n
        a.cap_H, a.cap_qkv, a.cap_att, a.cap_heads, a.cap_E, a.cap_k, a.cap_K = self.dims


class FusedDecode:
    """The decode backend of one decoder layer (``DecoderLayer.forward`` where it is built): a decode step
    in two kernel calls, every other forward through the layer's composed path. ``bufs``: the step's
    scratch, shared by the model's fused layers."""

    def __init__(self, layer, bufs: "StepBuffers | None" = None) -> None:
        attn, block = layer.attn, layer.ffn
        self.layer, self.attn, self.block, self.composed = layer, attn, block, layer.composed
        self.lib = kernels.lib()
        L = self.args = LayerArgs()
        L.eps = layer.input_norm.eps
        self._keep = [layer.input_norm.weight, layer.post_norm.weight]
        L.in_norm, L.post_norm = self._keep[0].data_ptr(), self._keep[1].data_ptr()
        self.dense = isinstance(block, DenseMLP)
        if self.dense:      # no router, no gate: the kernel stops at the post norm, the MLP runs on its h
            L.H, L.E, L.k, L.router = layer.input_norm.weight.numel(), 0, 0, ROUTER_NONE
            self.experts = self.kernel = None
            self.mlp = MLPPart.build(block)
            self._ffn = self._dense
        else:
            cfg = block.cfg
            L.H, L.E, L.k = cfg.hidden_size, cfg.num_experts, cfg.top_k
            L.router = ROUTER_CODES[cfg.router]
            L.renorm = int(bool(cfg.norm_topk_prob))
            L.n_group, L.topk_group = int(cfg.n_group or 1), int(cfg.topk_group or 1)
            L.route_scale = float(cfg.routed_scaling_factor)
            if block.correction is not None:
                L.correction = _f32(block.correction.reshape(-1), self._keep)
            L.gate = lin_desc(block.router)
            self.experts = block.executor.backend           # HostKernelExperts (fused_refusal saw to it)
            self.kernel = block.executor.kernel
            self._ffn = self._experts
            self.mlp = MLPPart.build(block.shared, block.shared_gate) if block.shared is not None else None
        self.part = ATTENTION_PARTS[attn.fused_part](attn, L, self._keep)   # fills the attention's fields
        self.bufs = bufs

    @staticmethod
    def why_not(layer, device, cfg=None) -> "str | None":
        """Why ``layer`` cannot decode fused (None: it can): what its sublayers say (layers/protocol.py),
        then the kernel's own limits. ``cfg``: the model's config (a dense MLP layer has none of its own)."""
        if kernels.lib() is None or torch.device(device).type != "cpu":
            return "host kernels off or not a CPU"
        attn, block = layer.attn, layer.ffn
        dense = isinstance(block, DenseMLP)       # DeepSeek's first layers, Qwen3-Next's mlp_only_layers
        why = layer.attn.fused_refusal() or (None if dense else layer.ffn.fused_refusal())
        if why is not None:
            return why
        cfg = cfg if dense else block.cfg
        if cfg is None:
            return "a dense MLP layer without the model's config"
        part = ATTENTION_PARTS.get(getattr(attn, "fused_part", None))
        if part is None:
            return f"{type(attn).__name__} names no fused kernel"
        why = part.why_not(attn, cfg)
        if why is not None:
            return why
        if dense:
            return FusedDecode._norms_why(layer)
        if cfg.router not in ROUTER_CODES:
            return f"router {cfg.router}"
        why = FusedDecode._norms_why(layer)
        if why is not None:
            return why
        if cfg.num_experts > 4096 or (cfg.n_group or 1) > 256:
            return "sizes past the kernel's limits"
        if cfg.router in ("sigmoid_group", "softmax_group") and (cfg.n_group or 1) > 1 and cfg.num_experts % cfg.n_group:
            return "expert groups of unequal size"
        if lin_desc(block.router) is None:
            return "a router the kernels cannot read in place"
        return None

    @staticmethod
    def _norms_why(layer) -> "str | None":
        if layer.input_norm.weight.dtype != torch.float32 or layer.post_norm.weight.dtype != torch.float32:
            return "not float32"
        if layer.input_norm.eps != layer.post_norm.eps:
            return "input and post-attention norms of different eps"
        return None

    def dims(self) -> tuple:
        """The step scratch this layer needs: hidden, qkv width, attention width, heads, experts, top-k and
        the widest projection input (StepBuffers' dims)."""
        L = self.args
        qkv, att, heads, k_in = self.part.widths
        mlp_in = self.mlp.args.I if self.mlp is not None else 0
        return (L.H, qkv, att, heads, L.E, L.k, max(L.H, k_in, mlp_in))

    def __call__(self, x: torch.Tensor, ctx) -> torch.Tensor:
        """The layer on x [B, hidden]: a decode step fused (x updated in place and returned), any other
        forward - prefill, or a step whose routing cache-aware routing changes - composed."""
        if not ctx.decode or ctx.hooks.cache_bonus:
            return self.composed(x, ctx)
        bufs = self.bufs
        if bufs.x is not x or bufs.ctx is not ctx:       # the step's first fused layer, or one after a composed one
            x = x.contiguous()
            bufs.begin(x, ctx)
        self._attention(ctx, bufs)
        self._ffn(ctx, bufs)
        return x

    def _attention(self, ctx, bufs: StepBuffers) -> None:
        """x += o(attention(rmsnorm(x))), then h = rmsnorm(x), the router's top-k and the dispatch."""
        rc = self.part(self.lib, self.args, bufs.args, ctx)
        if rc:
            raise RuntimeError(f"the fused attention kernel refused layer {self.layer.index} (code {rc}: "
                               f"{kernels.lib().tm_strerror(rc).decode()})")

    def _experts(self, ctx, bufs: StepBuffers) -> None:
        """The routed experts through the MoE block's own stages (request: record, store, hooks), their
        weighted sum added into x by ``tm_moe``, then the block's shared experts."""
        block, x, B, Bk = self.block, bufs.x, bufs.x.shape[0], bufs.Bk
        h, wts = bufs.hB, bufs.wtsB                                      # h: [B, hidden], post-norm
        # [B, k] expert ids for the recorded routing (a copy: the buffer is reused by the next layer)
        ids = torch.from_numpy(bufs.idsB.copy()) if ctx.hooks.record is not None else None
        nu = int(bufs.nused[0])
        used, counts = bufs.used[:nu].tolist(), bufs.rows[:nu].tolist()
        fetch = block.request(ctx, ids, used, counts, h)
        if self.experts.takes(fetch, counts):
            t0 = time.perf_counter()
            self.kernel.run_step([fetch.tensors(e) for e in used], bufs.row0, bufs.rows, bufs.xs.data_ptr(),
                                 bufs.ys.data_ptr(), Bk, h.data_ptr(), bufs.tok.data_ptr(), bufs.back.data_ptr(),
                                 wts.data_ptr(), x.data_ptr(), B, self.args.k)
            record_host_share(fetch, used, counts, t0)
        else:            # the executor's general path: waves, loads in flight, prefill-sized rows
            off = [0] + np.cumsum(bufs.counts).tolist()
            ys = block.executor.run(block.moe_idx, fetch, h[bufs.tokB], off)
            x += weighted_sum(ys, bufs.backB, wts)
        if self.mlp is not None:
            self.mlp(self.lib, bufs.args, B)
        else:
            sh = block.shared_out(h)
            if sh is not None:
                x += sh

    def _dense(self, ctx, bufs: StepBuffers) -> None:
        """A dense MLP layer's FFN on the kernel's post-norm h, added into x."""
        if self.mlp is not None:
            self.mlp(self.lib, bufs.args, bufs.x.shape[0])
        else:
            bufs.x += self.block(bufs.hB)


def build_fused(layers: list, device, cfg=None) -> list:
    """Each layer's decode backend: a ``FusedDecode`` where the layer can take it (sharing one
    ``StepBuffers`` sized by the largest), else None; and why not, per layer. ``cfg``: the model's config."""
    why = [FusedDecode.why_not(layer, device, cfg) for layer in layers]
    fused = [FusedDecode(layer) if w is None else None for layer, w in zip(layers, why)]
    dims = [f.dims() for f in fused if f is not None]
    if dims:
        ring = max((f.part.ring for f in fused if f is not None), default=0)
        bufs = StepBuffers(tuple(max(d[i] for d in dims) for i in range(7)), ring)
        for f in fused:
            if f is not None:
                f.bufs = bufs
    return fused, why
