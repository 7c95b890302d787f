"""Linear-attention token mixers of the 2025/2026 hybrid models, in plain torch (issue 12).

Two layer kinds, both built on the same *gated delta rule*:

* **KDA** (Kimi Delta Attention, Kimi-Linear): per-key-channel ("fine-grained") decay.
* **Gated DeltaNet** (Qwen3-Next, and the unfused projection layout of Qwen3.5): one scalar decay per head.

Each layer keeps a fixed-size state per sequence, independent of the sequence length:

* ``recurrent``: the associative memory ``S`` ``[H, K, V]`` (float32: it integrates thousands of rank-1 updates and
  bf16 rounding would accumulate);
* ``conv``: the last ``kernel - 1`` inputs of the short causal depthwise convolution ``[C, kernel - 1]`` (activation
  dtype: it holds raw projections, nothing accumulates in it).

The recurrence per head, for token t (``q, k`` L2-normalised, ``q`` scaled by ``1/sqrt(K)``, ``g_t <= 0`` the log decay
of shape ``[K]`` for KDA or a broadcast scalar for Gated DeltaNet, ``beta_t`` in (0, 1))::

    S  <- diag(exp(g_t)) S                     # forget
    u_t = beta_t * (v_t - S^T k_t)             # delta rule: only write what S does not already predict for k_t
    S  <- S + k_t u_t^T
    o_t = S^T q_t

Two forms compute it:

* ``recurrent`` (decode): the loop above, O(H K V) per token;
* ``chunked`` (prefill): tokens in chunks of ``chunk_size`` (64); inside a chunk the sequential dependence of the
  ``u_t`` is a unit lower-triangular linear system (the "UT transform" of DeltaNet / WY representation), solved with
  one triangular solve; the state is read once and written once per chunk.

Both take an initial state and return the final state, so prefill -> decode and prefill split at any token compose.
State objects are never mutated: a new one is returned (a runtime with preallocated per-sequence slots copies it in).

Weights are given as a dict ``name -> tensor`` with names relative to the layer's attention prefix
(``model.layers.N.self_attn.`` for Kimi-Linear, ``model.layers.N.linear_attn.`` for Qwen3-Next). Both the released
checkpoint names and the transformers module names are accepted (see the class docstrings).
This module imports only torch and dataclasses.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = [
    "LinearAttentionState",
    "KDAConfig",
    "GatedDeltaNetConfig",
    "KimiDeltaAttention",
    "GatedDeltaNet",
    "kda_state_bytes",
    "gdn_state_bytes",
    "state_bytes",
    "gated_delta_rule_recurrent",
    "gated_delta_rule_chunked",
]

RECURRENT_DTYPE = torch.float32  # the state S is always kept in float32 (see module docstring)
L2NORM_EPS = 1e-6                # FLA / transformers: x / sqrt(sum(x^2) + 1e-6), not F.normalize's max(norm, eps)


# ----------------------------------------------------------------------------------------------------------------
# State and configs
# ----------------------------------------------------------------------------------------------------------------

@dataclass
class LinearAttentionState:
    """Per-sequence state of one linear-attention layer."""
    recurrent: torch.Tensor  # S: [H, K, V] float32
    conv: torch.Tensor       # last inputs of the causal conv: [C, kernel - 1], activation dtype

    def nbytes(self) -> int:
        return self.recurrent.numel() * self.recurrent.element_size() + self.conv.numel() * self.conv.element_size()


@dataclass(frozen=True)
class KDAConfig:
    """Kimi Delta Attention. Kimi-Linear ``config.json``: ``linear_attn_config.{num_heads, head_dim,
    short_conv_kernel_size}``, ``rms_norm_eps``; transformers: ``linear_num_heads``, ``linear_head_dim``,
    ``linear_conv_kernel_dim``."""
    hidden_size: int
    num_heads: int
    head_dim: int                 # K == V for KDA
    conv_kernel_size: int = 4
    rms_norm_eps: float = 1e-5    # o_norm (gated RMSNorm over head_dim)
    chunk_size: int = 64

    @property
    def qkv_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:    # q, k and v each go through their own short conv (stacked here: q | k | v)
        return 3 * self.qkv_dim


@dataclass(frozen=True)
class GatedDeltaNetConfig:
    """Gated DeltaNet. Qwen3-Next ``config.json``: ``linear_num_key_heads``, ``linear_num_value_heads``,
    ``linear_key_head_dim``, ``linear_value_head_dim``, ``linear_conv_kernel_dim``, ``rms_norm_eps``."""
    hidden_size: int
    num_k_heads: int
    num_v_heads: int              # a multiple of num_k_heads: each q/k head serves num_v_heads // num_k_heads v heads
    head_k_dim: int
    head_v_dim: int
    conv_kernel_size: int = 4
    rms_norm_eps: float = 1e-6
    chunk_size: int = 64

    def __post_init__(self):
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(f"num_v_heads ({self.num_v_heads}) must be a multiple of num_k_heads ({self.num_k_heads})")

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:    # one conv over the concatenation q | k | v
        return 2 * self.key_dim + self.value_dim


def _state_bytes(num_heads, k_dim, v_dim, conv_dim, kernel, dtype) -> int:
    rec = num_heads * k_dim * v_dim * torch.empty((), dtype=RECURRENT_DTYPE).element_size()
    conv = conv_dim * (kernel - 1) * torch.empty((), dtype=dtype).element_size()
    return rec + conv


def kda_state_bytes(cfg: KDAConfig, dtype: torch.dtype) -> int:
    """Bytes of one sequence's KDA state: float32 recurrent [H, K, K] + conv [3*H*K, kernel-1] in ``dtype`` (the
    activation dtype the layer runs in)."""
    return _state_bytes(cfg.num_heads, cfg.head_dim, cfg.head_dim, cfg.conv_dim, cfg.conv_kernel_size, dtype)


def gdn_state_bytes(cfg: GatedDeltaNetConfig, dtype: torch.dtype) -> int:
    """Bytes of one sequence's Gated DeltaNet state: float32 recurrent [Hv, Dk, Dv] + conv [2*Hk*Dk + Hv*Dv,
    kernel-1] in ``dtype``."""
    return _state_bytes(cfg.num_v_heads, cfg.head_k_dim, cfg.head_v_dim, cfg.conv_dim, cfg.conv_kernel_size, dtype)


def state_bytes(cfg, dtype: torch.dtype) -> int:
    """Dispatch on the config type (KDAConfig or GatedDeltaNetConfig)."""
    if isinstance(cfg, KDAConfig):
        return kda_state_bytes(cfg, dtype)
    if isinstance(cfg, GatedDeltaNetConfig):
        return gdn_state_bytes(cfg, dtype)
    raise TypeError(f"no linear-attention state for config type {type(cfg).__name__}")


def _zero_state(num_heads, k_dim, v_dim, conv_dim, kernel, dtype, device) -> LinearAttentionState:
    return LinearAttentionState(
        recurrent=torch.zeros(num_heads, k_dim, v_dim, dtype=RECURRENT_DTYPE, device=device),
        conv=torch.zeros(conv_dim, kernel - 1, dtype=dtype, device=device),
    )


# ----------------------------------------------------------------------------------------------------------------
# Weight validation
# ----------------------------------------------------------------------------------------------------------------

def _shape(t) -> tuple:
    return tuple(int(s) for s in t.shape)


def _take(weights: dict, names, shapes, layer: str) -> torch.Tensor:
    """The tensor stored under the first of ``names`` present, checked against ``shapes`` (one or more accepted
    shapes). Missing -> ValueError naming the tensor; wrong shape -> ValueError naming it and both shapes."""
    names = (names,) if isinstance(names, str) else tuple(names)
    shapes = [tuple(shapes)] if shapes and isinstance(shapes[0], int) else [tuple(s) for s in shapes]
    for name in names:
        if name in weights:
            t = weights[name]
            if _shape(t) not in shapes:
                want = " or ".join(str(s) for s in shapes)
                raise ValueError(f"{layer}: tensor '{name}' has shape {_shape(t)}, expected {want}")
            return t
    alt = f" (or {', '.join(repr(n) for n in names[1:])})" if len(names) > 1 else ""
    raise ValueError(f"{layer}: missing tensor '{names[0]}'{alt}")


def _conv_weight(t: torch.Tensor) -> torch.Tensor:
    """[C, 1, K] (nn.Conv1d / checkpoint layout) or [C, K] -> [C, K]."""
    return t.reshape(t.shape[0], t.shape[-1])


# ----------------------------------------------------------------------------------------------------------------
# Shared pieces
# ----------------------------------------------------------------------------------------------------------------

def _linear(x: torch.Tensor, w) -> torch.Tensor:
    """x W^T: ``w`` a weight [out, in], or a projection ``prepare`` made (a callable x -> x W^T)."""
    if not isinstance(w, torch.Tensor):
        return w(x)
    return F.linear(x, w if w.dtype == x.dtype else w.to(x.dtype))


class _Projections:
    """``prepare(make)``: each projection weight [out, in] named in ``projections`` replaced by ``make(weight)``, a
    callable x -> x W^T whose backend is picked once (runtime/model/layers/dense.py's Linear: the host kernels'
    bf16 GEMV or quantized rows on a CPU). Unprepared, the forward multiplies the tensors with F.linear."""
    projections: tuple = ()

    def prepare(self, make) -> None:
        for n in self.projections:
            setattr(self, n, make(getattr(self, n)))


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2NORM_EPS)


def _causal_conv(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor):
    """Depthwise causal conv + SiLU with carried context.

    x: [T, C] (new inputs), conv_state: [C, W-1] (previous inputs, oldest first), weight: [C, W].
    Returns (y [T, C], new conv_state [C, W-1]). Zero conv_state == zero left padding, which is how the models
    start a sequence."""
    T, C = x.shape
    W = weight.shape[-1]
    xs = torch.cat([conv_state.to(x.dtype), x.t()], dim=-1)                # xs: [C, W-1+T]
    w = weight.to(x.dtype).unsqueeze(1)                                    # w: [C, 1, W]
    y = F.conv1d(xs.unsqueeze(0), w, groups=C)[0]                          # y: [C, T] (valid conv: T outputs)
    new_state = xs[:, xs.shape[1] - (W - 1):].clone()                      # last W-1 inputs: [C, W-1]
    return F.silu(y).t(), new_state


def _gated_rmsnorm(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float, act) -> torch.Tensor:
    """RMSNorm over the last dim (head dim), times weight, times act(gate); all in float32 as FLA's fused kernel."""
    x = x.float()                                                          # x: [T, H, V]
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight.float() * x * act(gate.float())


# ----------------------------------------------------------------------------------------------------------------
# The gated delta rule (shared core)
# ----------------------------------------------------------------------------------------------------------------

def gated_delta_rule_recurrent(q, k, v, g, beta, state):
    """Token-by-token gated delta rule (decode form).

    q, k: [T, H, K] (already L2-normalised; q already scaled), v: [T, H, V], g: [T, H, K] or [T, H, 1] log decay
    (<= 0) per key channel or per head, beta: [T, H], state: [H, K, V] float32.
    Returns (o [T, H, V] float32, final state [H, K, V] float32)."""
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    S = state.float()
    out = []
    for t in range(q.shape[0]):
        S = S * g[t].exp().unsqueeze(-1)                                   # decay rows (key channels): [H, K, V]
        pred = torch.einsum("hkv,hk->hv", S, k[t])                         # what S recalls for k_t: [H, V]
        u = (v[t] - pred) * beta[t].unsqueeze(-1)                          # delta-rule correction: [H, V]
        S = S + k[t].unsqueeze(-1) * u.unsqueeze(-2)                       # rank-1 write: [H, K, V]
        out.append(torch.einsum("hkv,hk->hv", S, q[t]))                    # read with q_t after the write: [H, V]
    return torch.stack(out, 0), S


def _decayed_scores(a, b, gam_a, gam_b, inclusive: bool):
    """M[h, t, s] = sum_c a[h,t,c] b[h,s,c] exp(gam_a[h,t,c] - gam_b[h,s,c]) for s < t (s <= t if inclusive), else 0.

    a, b: [H, C, K]; gam_*: [H, C, K] (per-channel) or [H, C, 1] (per-head scalar) cumulative log decays.
    The exponent is masked to -inf above the diagonal *before* exp: there gam_t - gam_s >= 0 can be large and
    exp would overflow to inf (inf * 0 = nan)."""
    C = a.shape[1]
    keep = torch.ones(C, C, dtype=torch.bool, device=a.device).tril(0 if inclusive else -1)   # keep: [C(t), C(s)]
    if gam_a.shape[-1] == 1:                                               # scalar decay: factor out of the dot product
        diff = gam_a[..., 0].unsqueeze(-1) - gam_b[..., 0].unsqueeze(-2)   # diff: [H, C, C]
        return (a @ b.transpose(-1, -2)) * diff.masked_fill(~keep, float("-inf")).exp()
    # per-channel decay: the decay sits inside the sum over K, so materialise [H, C, C, K] (one chunk at a time)
    diff = gam_a.unsqueeze(2) - gam_b.unsqueeze(1)                         # diff: [H, C(t), C(s), K]
    decay = diff.masked_fill(~keep[..., None], float("-inf")).exp()
    return (a.unsqueeze(2) * b.unsqueeze(1) * decay).sum(-1)


def gated_delta_rule_chunked(q, k, v, g, beta, state, chunk_size: int = 64):
    """Chunked gated delta rule (prefill form); same arguments and results as ``gated_delta_rule_recurrent``.

    Per chunk of C tokens with start state S0, gam_t = cumsum(g)_t (log decay from the chunk start to t, inclusive):
      u = beta v - beta (k * e^gam) S0 - A u,  A[t, s] = beta_t sum_c k_t k_s e^(gam_t - gam_s)  (s < t)
        => (I + A) u = beta v - (beta k e^gam) S0, a unit lower-triangular system (one solve per chunk);
      o_t = (q_t * e^gam_t) S0 + sum_{s<=t} (sum_c q_t k_s e^(gam_t - gam_s)) u_s;
      S_C = e^gam_C * S0 + sum_s (k_s * e^(gam_C - gam_s)) u_s^T.
    All exponents are differences gam_t - gam_s with t >= s, so they are <= 0: nothing overflows however strong
    the decay. A short last chunk is processed as is (no padding)."""
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    S = state.float()
    T = q.shape[0]
    # head-major for batched matmuls over heads: [H, T, *]
    q, k, v, g = (t.transpose(0, 1) for t in (q, k, v, g))
    beta = beta.t().unsqueeze(-1)                                          # beta: [H, T, 1]
    out = []
    for c0 in range(0, T, chunk_size):
        sl = slice(c0, min(c0 + chunk_size, T))
        qc, kc, vc, bc = q[:, sl], k[:, sl], v[:, sl], beta[:, sl]       # [H, C, K|V|1]
        gam = g[:, sl].cumsum(dim=1)                                       # gam: [H, C, K|1]
        kb = kc * bc                                                       # beta_t k_t: [H, C, K]
        A = _decayed_scores(kb, kc, gam, gam, inclusive=False)             # A: [H, C, C], strictly lower
        rhs = torch.cat([vc * bc, kb * gam.exp()], dim=-1)                 # [H, C, V + K]
        # (I + A) X = rhs; unitriangular=True reads only the strict lower part of A and takes the diagonal as 1
        X = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)
        V = vc.shape[-1]
        u = X[..., :V] - X[..., V:] @ S                                    # corrections u: [H, C, V]
        P = _decayed_scores(qc, kc, gam, gam, inclusive=True)              # P: [H, C, C], lower incl. diagonal
        out.append((qc * gam.exp()) @ S + P @ u)                           # o: [H, C, V]
        gam_end = gam[:, -1:]                                              # [H, 1, K|1]
        k_to_end = kc * (gam_end - gam).exp()                              # k_s decayed to the chunk end: [H, C, K]
        S = S * gam_end.transpose(-1, -2).exp() + k_to_end.transpose(-1, -2) @ u   # S: [H, K, V]
    o = torch.cat(out, dim=1).transpose(0, 1)                              # o: [T, H, V]
    return o, S


def _run_rule(mode: str, cfg_chunk: int, q, k, v, g, beta, state):
    if mode == "auto":
        # one token: the loop is the cheaper form; more: the chunked form (matmul-bound, state touched per chunk)
        mode = "recurrent" if q.shape[0] == 1 else "chunked"
    if mode == "recurrent":
        return gated_delta_rule_recurrent(q, k, v, g, beta, state)
    if mode == "chunked":
        return gated_delta_rule_chunked(q, k, v, g, beta, state, cfg_chunk)
    raise ValueError(f"mode must be 'auto', 'recurrent' or 'chunked', not {mode!r}")


def _check_input(x: torch.Tensor, hidden: int, name: str):
    if x.dim() != 2 or x.shape[1] != hidden:
        raise ValueError(f"{name}: input must be [tokens, {hidden}] (one sequence), got {_shape(x)}")
    if x.shape[0] == 0:
        raise ValueError(f"{name}: input has no tokens")


def _check_state(state: LinearAttentionState, rec_shape: tuple, conv_shape: tuple, name: str):
    if _shape(state.recurrent) != rec_shape:
        raise ValueError(f"{name}: state.recurrent has shape {_shape(state.recurrent)}, expected {rec_shape}")
    if _shape(state.conv) != conv_shape:
        raise ValueError(f"{name}: state.conv has shape {_shape(state.conv)}, expected {conv_shape}")


# ----------------------------------------------------------------------------------------------------------------
# Kimi Delta Attention
# ----------------------------------------------------------------------------------------------------------------

class KimiDeltaAttention(_Projections):
    """Kimi-Linear's KDA layer (transformers ``KimiLinearDeltaAttention``), for one sequence.

    Weights (relative to ``model.layers.N.self_attn.``), released checkpoint names, with the transformers module
    names also accepted:
      q_proj / k_proj / v_proj.weight  [H*K, hidden]
      q_conv1d / k_conv1d / v_conv1d.weight [H*K, 1, W]   (transformers: stacked ``conv1d.weight`` [3*H*K, 1, W])
      f_a_proj.weight [K, hidden], f_b_proj.weight [H*K, K]  (transformers: under ``forget_gate.``)
      dt_bias [H*K], A_log [H] or [1, 1, H, 1]              (transformers: under ``forget_gate.``)
      b_proj.weight [H, hidden]
      g_a_proj.weight [K, hidden], g_b_proj.weight [H*K, K]  (low-rank output gate)
      o_norm.weight [K], o_proj.weight [hidden, H*K]

    ``layer(x, state=None, mode="auto") -> (y, new_state)``; x: [T, hidden]."""

    projections = ("qkv_proj", "f_a", "f_b", "b_proj", "g_a", "g_b", "o_proj")

    def __init__(self, cfg: KDAConfig, weights: dict, name: str = "kda"):
        self.cfg, self.name = cfg, name
        H, K, D, W = cfg.num_heads, cfg.head_dim, cfg.hidden_size, cfg.conv_kernel_size
        HK = H * K

        def take(names, shapes):
            return _take(weights, names, shapes, name)

        # q, k and v in one product (their rows stacked: the conv's channel order q | k | v)
        self.qkv_proj = torch.cat([take(f"{n}_proj.weight", (HK, D)) for n in "qkv"])   # [3*H*K, hidden]
        if "conv1d.weight" in weights:                                     # transformers layout: already stacked
            self.conv = _conv_weight(take("conv1d.weight", [(3 * HK, 1, W), (3 * HK, W)]))
        else:                                                              # released checkpoint: one conv per q/k/v
            self.conv = torch.cat([_conv_weight(take(f"{p}_conv1d.weight", [(HK, 1, W), (HK, W)]))
                                   for p in ("q", "k", "v")], dim=0)       # conv: [3*H*K, W], channel order q|k|v
        self.f_a = take(("f_a_proj.weight", "forget_gate.f_a_proj.weight"), (K, D))
        self.f_b = take(("f_b_proj.weight", "forget_gate.f_b_proj.weight"), (HK, K))
        self.dt_bias = take(("dt_bias", "forget_gate.dt_bias"), (HK,)).float()
        self.A_log = take(("A_log", "forget_gate.A_log"), [(H,), (1, 1, H, 1)]).float().reshape(H)
        self.b_proj = take("b_proj.weight", (H, D))
        self.g_a = take("g_a_proj.weight", (K, D))
        self.g_b = take("g_b_proj.weight", (HK, K))
        self.o_norm = take("o_norm.weight", (K,))
        self.o_proj = take("o_proj.weight", (D, HK))

    def init_state(self, dtype=torch.float32, device=None) -> LinearAttentionState:
        c = self.cfg
        return _zero_state(c.num_heads, c.head_dim, c.head_dim, c.conv_dim, c.conv_kernel_size, dtype, device)

    def __call__(self, x: torch.Tensor, state: LinearAttentionState | None = None, mode: str = "auto"):
        c = self.cfg
        H, K = c.num_heads, c.head_dim
        _check_input(x, c.hidden_size, self.name)
        if state is None:
            state = self.init_state(x.dtype, x.device)
        _check_state(state, (H, K, K), (c.conv_dim, c.conv_kernel_size - 1), self.name)
        T = x.shape[0]

        mixed = _linear(x, self.qkv_proj)                                  # mixed: [T, 3HK]
        mixed, conv_state = _causal_conv(mixed, state.conv, self.conv)    # short conv + SiLU on q, k and v
        q, k, v = (t.reshape(T, H, K) for t in mixed.split(H * K, dim=-1))  # q, k, v: [T, H, K]

        # fine-grained forget gate: a low-rank projection gives one decay per (head, key channel)
        f = _linear(_linear(x, self.f_a), self.f_b).float() + self.dt_bias   # f: [T, H*K]
        g = -self.A_log.exp().unsqueeze(-1) * F.softplus(f.reshape(T, H, K))  # g: [T, H, K], log decay <= 0
        beta = torch.sigmoid(_linear(x, self.b_proj).float())              # beta: [T, H] write strength

        q = _l2norm(q.float()) * (K ** -0.5)                               # normalised in fp32, as FLA's kernels
        k = _l2norm(k.float())
        o, S = _run_rule(mode, c.chunk_size, q, k, v, g, beta, state.recurrent)   # o: [T, H, K]

        gate = _linear(_linear(x, self.g_a), self.g_b).reshape(T, H, K)    # low-rank output gate: [T, H, K]
        o = _gated_rmsnorm(o, self.o_norm, gate, c.rms_norm_eps, torch.sigmoid)   # KDA gates with sigmoid
        y = _linear(o.reshape(T, H * K).to(x.dtype), self.o_proj)          # y: [T, hidden]
        return y, LinearAttentionState(recurrent=S.to(RECURRENT_DTYPE), conv=conv_state)

    def step(self, x: torch.Tensor, recurrent: torch.Tensor, conv: torch.Tensor):
        """One decode token for each of B sequences at once (continuous batching: every sequence has its
        own state). x: [B, hidden]; recurrent: [B, H, K, K] float32; conv: [B, 3*H*K, kernel-1].
        Returns (y [B, hidden], new recurrent, new conv); the same numbers as ``__call__`` on each
        sequence's single token, in one set of batched ops instead of B."""
        c = self.cfg
        H, K, W = c.num_heads, c.head_dim, c.conv_kernel_size
        B = x.shape[0]
        if recurrent.shape != (B, H, K, K) or conv.shape != (B, c.conv_dim, W - 1):
            raise ValueError(f"{self.name}: decode states must be [{B}, {H}, {K}, {K}] and [{B}, {c.conv_dim}, {W - 1}], "
                             f"got {_shape(recurrent)} and {_shape(conv)}")
        mixed = _linear(x, self.qkv_proj)                                  # mixed: [B, 3HK]
        xs = torch.cat([conv.to(x.dtype), mixed[:, :, None]], -1)          # xs: [B, C, W] oldest first
        mixed = F.silu((xs * self.conv.to(x.dtype)).sum(-1))               # the causal conv's last output: [B, C]
        q, k, v = (t.reshape(B, H, K) for t in mixed.split(H * K, dim=-1))  # q, k, v: [B, H, K]
        f = _linear(_linear(x, self.f_a), self.f_b).float() + self.dt_bias   # f: [B, H*K]
        g = -self.A_log.exp().unsqueeze(-1) * F.softplus(f.reshape(B, H, K))  # g: [B, H, K]
        beta = torch.sigmoid(_linear(x, self.b_proj).float())              # beta: [B, H]
        q = _l2norm(q.float()) * (K ** -0.5)
        k = _l2norm(k.float())
        S = recurrent.float() * g.exp().unsqueeze(-1)                      # forget: [B, H, K, V]
        u = (v.float() - torch.einsum("bhkv,bhk->bhv", S, k)) * beta.unsqueeze(-1)   # delta-rule write: [B, H, V]
        S = S + k.unsqueeze(-1) * u.unsqueeze(-2)
        o = torch.einsum("bhkv,bhk->bhv", S, q)                            # o: [B, H, V]
        gate = _linear(_linear(x, self.g_a), self.g_b).reshape(B, H, K)
        o = _gated_rmsnorm(o, self.o_norm, gate, c.rms_norm_eps, torch.sigmoid)
        y = _linear(o.reshape(B, H * K).to(x.dtype), self.o_proj)          # y: [B, hidden]
        return y, S, xs[:, :, 1:]


# ----------------------------------------------------------------------------------------------------------------
# Gated DeltaNet
# ----------------------------------------------------------------------------------------------------------------

class GatedDeltaNet(_Projections):
    """Qwen3-Next's Gated DeltaNet layer (transformers ``Qwen3NextGatedDeltaNet``), for one sequence.

    Weights (relative to ``model.layers.N.linear_attn.``):
      in_proj_qkvz.weight [2*Hk*Dk + 2*Hv*Dv, hidden]: rows grouped per key head g: [q_g (Dk) | k_g (Dk) |
          v of its r=Hv/Hk value heads (r*Dv) | z of the same (r*Dv)]
      in_proj_ba.weight [2*Hv, hidden]: per key head g: [b of its r value heads | a of the same]
        (Qwen3.5 unfused layout also accepted: in_proj_qkv [2*Hk*Dk + Hv*Dv, hidden] = q | k | v flat,
         in_proj_z [Hv*Dv, hidden], in_proj_b / in_proj_a [Hv, hidden])
      conv1d.weight [2*Hk*Dk + Hv*Dv, 1, W] over q | k | v (flat, head-major)
      dt_bias [Hv], A_log [Hv], norm.weight [Dv], out_proj.weight [hidden, Hv*Dv]

    ``layer(x, state=None, mode="auto") -> (y, new_state)``; x: [T, hidden]."""

    projections = ("in_proj", "out_proj")

    def __init__(self, cfg: GatedDeltaNetConfig, weights: dict, name: str = "gated_deltanet"):
        self.cfg, self.name = cfg, name
        D, W = cfg.hidden_size, cfg.conv_kernel_size
        Hk, Hv, Dk, Dv = cfg.num_k_heads, cfg.num_v_heads, cfg.head_k_dim, cfg.head_v_dim
        r = Hv // Hk

        def take(names, shapes):
            return _take(weights, names, shapes, name)

        if "in_proj_qkv.weight" in weights:
            # Qwen3.5 layout: already flat q | k | v, z, b, a. Stack into one [q|k|v|z|b|a] projection.
            self.in_proj = torch.cat([take("in_proj_qkv.weight", (cfg.conv_dim, D)),
                                      take("in_proj_z.weight", (cfg.value_dim, D)),
                                      take("in_proj_b.weight", (Hv, D)),
                                      take("in_proj_a.weight", (Hv, D))], dim=0)
        else:
            # Qwen3-Next layout: regroup the rows once here so the forward is a plain flat split.
            qkvz = take("in_proj_qkvz.weight", (2 * cfg.key_dim + 2 * cfg.value_dim, D))
            ba = take("in_proj_ba.weight", (2 * Hv, D))
            qkvz = qkvz.reshape(Hk, 2 * Dk + 2 * r * Dv, D)                 # per key-head group
            wq, wk, wv, wz = qkvz.split([Dk, Dk, r * Dv, r * Dv], dim=1)
            ba = ba.reshape(Hk, 2 * r, D)
            wb, wa = ba.split([r, r], dim=1)
            # flatten group-major: value head index = g * r + j, the order transformers' reshape gives
            self.in_proj = torch.cat([t.reshape(-1, D) for t in (wq, wk, wv, wz, wb, wa)], dim=0)
        self.conv = _conv_weight(take("conv1d.weight", [(cfg.conv_dim, 1, W), (cfg.conv_dim, W)]))
        self.dt_bias = take("dt_bias", (Hv,)).float()
        self.A_log = take("A_log", (Hv,)).float()
        self.norm = take("norm.weight", (Dv,))
        self.out_proj = take("out_proj.weight", (D, cfg.value_dim))

    def init_state(self, dtype=torch.float32, device=None) -> LinearAttentionState:
        c = self.cfg
        return _zero_state(c.num_v_heads, c.head_k_dim, c.head_v_dim, c.conv_dim, c.conv_kernel_size, dtype, device)

    def __call__(self, x: torch.Tensor, state: LinearAttentionState | None = None, mode: str = "auto"):
        c = self.cfg
        Hk, Hv, Dk, Dv = c.num_k_heads, c.num_v_heads, c.head_k_dim, c.head_v_dim
        _check_input(x, c.hidden_size, self.name)
        if state is None:
            state = self.init_state(x.dtype, x.device)
        _check_state(state, (Hv, Dk, Dv), (c.conv_dim, c.conv_kernel_size - 1), self.name)
        T = x.shape[0]

        proj = _linear(x, self.in_proj)                                    # [T, conv_dim + Hv*Dv + 2*Hv]
        mixed, z, b, a = proj.split([c.conv_dim, c.value_dim, Hv, Hv], dim=-1)
        mixed, conv_state = _causal_conv(mixed, state.conv, self.conv)    # short conv + SiLU over q | k | v
        q, k, v = mixed.split([c.key_dim, c.key_dim, c.value_dim], dim=-1)
        q, k = q.reshape(T, Hk, Dk), k.reshape(T, Hk, Dk)                  # q, k: [T, Hk, Dk]
        v = v.reshape(T, Hv, Dv)                                           # v: [T, Hv, Dv]

        beta = torch.sigmoid(b.float())                                    # beta: [T, Hv]
        g = -self.A_log.exp() * F.softplus(a.float() + self.dt_bias)       # g: [T, Hv] one log decay per head

        q = _l2norm(q.float()) * (Dk ** -0.5)
        k = _l2norm(k.float())
        if Hv != Hk:                                                       # key head g serves value heads g*r..g*r+r-1
            q = q.repeat_interleave(Hv // Hk, dim=1)                       # q, k: [T, Hv, Dk]
            k = k.repeat_interleave(Hv // Hk, dim=1)
        o, S = _run_rule(mode, c.chunk_size, q, k, v, g.unsqueeze(-1), beta, state.recurrent)  # o: [T, Hv, Dv]

        o = _gated_rmsnorm(o, self.norm, z.reshape(T, Hv, Dv), c.rms_norm_eps, F.silu)   # GDN gates with SiLU(z)
        y = _linear(o.reshape(T, Hv * Dv).to(x.dtype), self.out_proj)     # y: [T, hidden]
        return y, LinearAttentionState(recurrent=S.to(RECURRENT_DTYPE), conv=conv_state)

    def step(self, x: torch.Tensor, recurrent: torch.Tensor, conv: torch.Tensor):
        """One decode token for each of B sequences at once, each with its own state. x: [B, hidden];
        recurrent: [B, Hv, Dk, Dv] float32; conv: [B, conv_dim, kernel-1]. Returns (y [B, hidden], new
        recurrent, new conv): ``__call__`` on each sequence's token, as one set of batched ops."""
        c = self.cfg
        Hk, Hv, Dk, Dv, W = c.num_k_heads, c.num_v_heads, c.head_k_dim, c.head_v_dim, c.conv_kernel_size
        B = x.shape[0]
        if recurrent.shape != (B, Hv, Dk, Dv) or conv.shape != (B, c.conv_dim, W - 1):
            raise ValueError(f"{self.name}: decode states must be [{B}, {Hv}, {Dk}, {Dv}] and [{B}, {c.conv_dim}, {W - 1}], "
                             f"got {_shape(recurrent)} and {_shape(conv)}")
        proj = _linear(x, self.in_proj)                                    # [B, conv_dim + Hv*Dv + 2*Hv]
        mixed, z, b, a = proj.split([c.conv_dim, c.value_dim, Hv, Hv], dim=-1)
        xs = torch.cat([conv.to(x.dtype), mixed[:, :, None]], -1)          # xs: [B, C, W] oldest first
        mixed = F.silu((xs * self.conv.to(x.dtype)).sum(-1))               # the causal conv's last output: [B, C]
        q, k, v = mixed.split([c.key_dim, c.key_dim, c.value_dim], dim=-1)
        q = _l2norm(q.reshape(B, Hk, Dk).float()) * (Dk ** -0.5)
        k = _l2norm(k.reshape(B, Hk, Dk).float())
        if Hv != Hk:
            q = q.repeat_interleave(Hv // Hk, dim=1)                       # q, k: [B, Hv, Dk]
            k = k.repeat_interleave(Hv // Hk, dim=1)
        beta = torch.sigmoid(b.float())                                    # beta: [B, Hv]
        g = -self.A_log.exp() * F.softplus(a.float() + self.dt_bias)       # g: [B, Hv]
        S = recurrent.float() * g.exp()[:, :, None, None]                  # forget: [B, Hv, Dk, Dv]
        u = (v.reshape(B, Hv, Dv).float() - torch.einsum("bhkv,bhk->bhv", S, k)) * beta.unsqueeze(-1)
        S = S + k.unsqueeze(-1) * u.unsqueeze(-2)
        o = torch.einsum("bhkv,bhk->bhv", S, q)                            # o: [B, Hv, Dv]
        o = _gated_rmsnorm(o, self.norm, z.reshape(B, Hv, Dv), c.rms_norm_eps, F.silu)
        y = _linear(o.reshape(B, Hv * Dv).to(x.dtype), self.out_proj)     # y: [B, hidden]
        return y, S, xs[:, :, 1:]

