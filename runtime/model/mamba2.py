"""Mamba-2 state-space layers (transformers ``GraniteMoeHybridMambaLayer`` / ``Mamba2Mixer``: Granite 4 hybrids,
Nemotron-H, Falcon-H1), for one sequence (prefill) or a batch of decode tokens.

``in_proj`` gives [z | x B C | dt]; x B C go through a depthwise causal convolution (with bias) and SiLU. Per head
h (``head_dim`` channels P, state size N, head h reading group h // (H / G) of B and C):

    dt_t = softplus(dt_t + dt_bias_h)      S_t = exp(dt_t A_h) S_{t-1} + dt_t x_t B_t^T      y_t = S_t C_t + D_h x_t

with A_h = -exp(A_log_h) and S [P, N]. Then y * SiLU(z) through an RMSNorm per group of channels, and ``out_proj``.

The prefill runs the same recurrence in chunks (the SSD form: within a chunk the decayed products (C_i . B_j)
exp(sum of a over j+1..i), across chunks the carried state); chunks of our own size, which change the result by float
rounding only."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .linear_attention import RECURRENT_DTYPE, LinearAttentionState, _check_input, _linear, _Projections, _take

CHUNK = 64          # prefill tokens per block of the chunked form


@dataclass(frozen=True)
class Mamba2Config:
    hidden_size: int
    num_heads: int
    head_dim: int             # P: channels per head (intermediate = H * P)
    num_groups: int           # G: groups of B and C (H / G heads each)
    state_size: int           # N
    conv_kernel: int
    rms_norm_eps: float = 1e-6
    conv_bias: bool = True
    proj_bias: bool = False

    @property
    def inner(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:    # x | B | C
        return self.inner + 2 * self.num_groups * self.state_size


class Mamba2(_Projections):
    """Weights (relative to the layer's prefix, e.g. ``model.layers.N.mamba.``): in_proj.weight
    [inner + conv_dim + H, hidden] (z | x B C | dt), conv1d.weight [conv_dim, 1, W] (+ conv1d.bias), dt_bias [H],
    A_log [H], D [H], norm.weight [inner], out_proj.weight [hidden, inner] (+ biases with ``proj_bias``).

    ``layer(x, state=None) -> (y, new_state)``; x: [T, hidden]; the state: recurrent [H, P, N] float32, conv
    [conv_dim, W - 1] (the convolution's last inputs)."""

    projections = ("in_proj", "out_proj")

    def __init__(self, cfg: Mamba2Config, weights: dict, name: str = "mamba2"):
        self.cfg, self.name = cfg, name
        c, D = cfg, cfg.hidden_size

        def take(n, shape):
            return _take(weights, n, shape, name)
        self.in_proj = take("in_proj.weight", (c.inner + c.conv_dim + c.num_heads, D))
        self.out_proj = take("out_proj.weight", (D, c.inner))
        self.in_bias = take("in_proj.bias", (self.in_proj.shape[0],)).float() if c.proj_bias else None
        self.out_bias = take("out_proj.bias", (D,)).float() if c.proj_bias else None
        w = take("conv1d.weight", [(c.conv_dim, 1, c.conv_kernel), (c.conv_dim, c.conv_kernel)])
        self.conv = w.reshape(c.conv_dim, c.conv_kernel).float()                   # conv: [C, W]
        self.conv_b = take("conv1d.bias", (c.conv_dim,)).float() if c.conv_bias else None
        self.dt_bias = take("dt_bias", (c.num_heads,)).float()
        self.A = -take("A_log", (c.num_heads,)).float().exp()                      # A: [H] < 0
        self.D = take("D", (c.num_heads,)).float()
        self.norm = take("norm.weight", (c.inner,))

    def init_state(self, dtype=torch.float32, device=None) -> LinearAttentionState:
        c = self.cfg
        return LinearAttentionState(recurrent=torch.zeros(c.num_heads, c.head_dim, c.state_size, dtype=RECURRENT_DTYPE,
                                                          device=device),
                                    conv=torch.zeros(c.conv_dim, c.conv_kernel - 1, dtype=dtype, device=device))

    def _project(self, x: torch.Tensor):
        """z [T, inner], xBC [T, conv_dim], dt [T, H] (before softplus), all float32."""
        c = self.cfg
        p = _linear(x, self.in_proj).float()
        if self.in_bias is not None:
            p = p + self.in_bias
        return p.split([c.inner, c.conv_dim, c.num_heads], dim=-1)

    def _split(self, xbc: torch.Tensor, dt: torch.Tensor):
        """After the convolution: x [T, H, P], B and C [T, H, N] (each head's group), dt [T, H] (softplus'd)."""
        c = self.cfg
        T, GN = xbc.shape[0], c.num_groups * c.state_size
        xs, B, C = xbc.split([c.inner, GN, GN], dim=-1)
        rep = c.num_heads // c.num_groups
        B = B.reshape(T, c.num_groups, c.state_size).repeat_interleave(rep, dim=1)
        C = C.reshape(T, c.num_groups, c.state_size).repeat_interleave(rep, dim=1)
        return xs.reshape(T, c.num_heads, c.head_dim), B, C, F.softplus(dt + self.dt_bias)

    def _out(self, y: torch.Tensor, z: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """y [T, inner] float32, gated by SiLU(z), normed per group of channels, -> out_proj: [T, hidden]."""
        c = self.cfg
        g = (y * F.silu(z)).reshape(y.shape[0], c.num_groups, -1)                  # g: [T, G, inner / G]
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps)
        g = (self.norm.float() * g.reshape(y.shape[0], -1)).to(x.dtype)
        out = _linear(g, self.out_proj)
        return out if self.out_bias is None else out + self.out_bias.to(out.dtype)

    def __call__(self, x: torch.Tensor, state: LinearAttentionState | None = None):
        c = self.cfg
        _check_input(x, c.hidden_size, self.name)
        state = state if state is not None else self.init_state(x.dtype, x.device)
        if tuple(state.recurrent.shape) != (c.num_heads, c.head_dim, c.state_size) \
                or tuple(state.conv.shape) != (c.conv_dim, c.conv_kernel - 1):
            raise ValueError(f"{self.name}: state must be [{c.num_heads}, {c.head_dim}, {c.state_size}] and "
                             f"[{c.conv_dim}, {c.conv_kernel - 1}], got {tuple(state.recurrent.shape)} and "
                             f"{tuple(state.conv.shape)}")
        T = x.shape[0]
        z, xbc, dt = self._project(x)
        seq = torch.cat([state.conv.float(), xbc.t()], 1)                        # seq: [C, W - 1 + T]
        conv = F.conv1d(seq[None], self.conv[:, None], self.conv_b, groups=c.conv_dim)[0]   # conv: [C, T]
        xs, B, C, dt = self._split(F.silu(conv.t()), dt)                         # xs: [T, H, P]; B, C: [T, H, N]
        S = state.recurrent.float()                                              # S: [H, P, N]
        a = (dt * self.A).t()                                                    # a: [H, T] log decay per token
        ys = []
        for s in range(0, T, CHUNK):
            n = min(CHUNK, T - s)
            cum = a[:, s:s + n].cumsum(-1)                                       # cum: [H, n]
            seg = cum[:, :, None] - cum[:, None, :]                              # seg: [H, n, n] = sum a over j+1..i
            keep = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
            L = torch.exp(seg.masked_fill(~keep, float("-inf")))
            Bc, Cc = B[s:s + n].transpose(0, 1), C[s:s + n].transpose(0, 1)      # Bc, Cc: [H, n, N]
            u = (xs[s:s + n] * dt[s:s + n, :, None]).transpose(0, 1)             # u: [H, n, P] = dt x
            y = ((Cc @ Bc.transpose(1, 2)) * L) @ u                              # within the chunk: [H, n, P]
            y = y + torch.exp(cum)[:, :, None] * (Cc @ S.transpose(1, 2))        # the carried state
            w = torch.exp(cum[:, -1:] - cum)                                     # w: [H, n] decay to the chunk's end
            S = torch.exp(cum[:, -1])[:, None, None] * S + (u * w[:, :, None]).transpose(1, 2) @ Bc
            ys.append(y)
        y = torch.cat(ys, 1).transpose(0, 1) + self.D[None, :, None] * xs        # y: [T, H, P]
        new = LinearAttentionState(recurrent=S.to(RECURRENT_DTYPE), conv=seq[:, T:].to(state.conv.dtype))
        return self._out(y.reshape(T, -1), z, x), new

    def step(self, x: torch.Tensor, recurrent: torch.Tensor, conv: torch.Tensor):
        """One decode token for each of B sequences. x: [B, hidden]; recurrent: [B, H, P, N] float32; conv:
        [B, conv_dim, W - 1]. Returns (y [B, hidden], new recurrent, new conv)."""
        c = self.cfg
        Bn = x.shape[0]
        if recurrent.shape != (Bn, c.num_heads, c.head_dim, c.state_size) \
                or conv.shape != (Bn, c.conv_dim, c.conv_kernel - 1):
            raise ValueError(f"{self.name}: decode states must be [{Bn}, {c.num_heads}, {c.head_dim}, {c.state_size}] "
                             f"and [{Bn}, {c.conv_dim}, {c.conv_kernel - 1}], got {tuple(recurrent.shape)} and "
                             f"{tuple(conv.shape)}")
        z, xbc, dt = self._project(x)
        seq = torch.cat([conv.float(), xbc[:, :, None]], -1)                     # seq: [B, C, W] oldest first
        out = (seq * self.conv).sum(-1)
        if self.conv_b is not None:
            out = out + self.conv_b
        xbc = F.silu(out)
        GN, rep = c.num_groups * c.state_size, c.num_heads // c.num_groups
        xs, Bm, Cm = xbc.split([c.inner, GN, GN], dim=-1)
        xs = xs.reshape(Bn, c.num_heads, c.head_dim)                             # xs: [B, H, P]
        Bm = Bm.reshape(Bn, c.num_groups, c.state_size).repeat_interleave(rep, dim=1)   # Bm, Cm: [B, H, N]
        Cm = Cm.reshape(Bn, c.num_groups, c.state_size).repeat_interleave(rep, dim=1)
        dt = F.softplus(dt + self.dt_bias)                                       # dt: [B, H]
        S = torch.exp(dt * self.A)[:, :, None, None] * recurrent.float() \
            + (dt[:, :, None] * xs)[..., None] * Bm[:, :, None, :]               # S: [B, H, P, N]
        y = torch.einsum("bhpn,bhn->bhp", S, Cm) + self.D[None, :, None] * xs
        return self._out(y.reshape(Bn, -1), z, x), S, seq[:, :, 1:].to(conv.dtype)
