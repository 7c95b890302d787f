"""MiniMax's lightning attention (transformers ``MiniMaxLightningAttention``; MiniMax-Text-01 / M1): linear
attention with a fixed decay per head, for one sequence (prefill) or a batch of decode tokens.

Per head h with decay rate s_h, the state S [head_dim, head_dim] and the output of token t:

    S_t = exp(-s_h) S_{t-1} + k_t^T v_t          o_t = q_t S_t

with q, k, v = SiLU(x W_qkv) (no RoPE: positions enter through the decay alone). The heads' outputs, flat, go
through one RMSNorm over all heads together, a sigmoid gate from the layer input, and ``out_proj``.
s_h = (2^(-8/H))^(h+1) x (1 - i / (L - 1 + 1e-5) + 1e-5) for layer i of L: later layers forget slower.

The prefill runs the same recurrence in chunks: within a chunk the decayed scores (q k^T) * exp(-s (t - j)),
t >= j, and across chunks the carried state (the "block" form transformers uses, with chunks of our own size: the
chunking does not change the result beyond float rounding)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .linear_attention import RECURRENT_DTYPE, LinearAttentionState, _check_input, _linear, _Projections, _take

CHUNK = 64          # prefill tokens per block of the chunked form


@dataclass(frozen=True)
class LightningConfig:
    hidden_size: int
    num_heads: int
    head_dim: int
    layer_index: int          # the decay rate depends on the layer's depth
    num_layers: int
    # the output norm's: transformers' module builds it with its RMSNorm's own default, not the config's rms_norm_eps
    rms_norm_eps: float = 1e-6

    @property
    def inner(self) -> int:
        return self.num_heads * self.head_dim


def slope_rates(num_heads: int, layer_index: int, num_layers: int) -> torch.Tensor:
    """s_h [H] float32, as transformers computes them (a float32 power of the base, times the depth factor)."""
    base = 1 / (2 ** (8 / num_heads))
    rate = base ** (torch.arange(num_heads) + 1)
    return (rate * (1 - layer_index / (num_layers - 1 + 1e-5) + 1e-5)).float()


class LightningAttention(_Projections):
    """Weights (relative to ``model.layers.N.self_attn.``): qkv_proj.weight [3*H*D, hidden] (rows per head
    [q | k | v]), output_gate.weight [H*D, hidden], norm.weight [H*D], out_proj.weight [hidden, H*D].

    ``layer(x, state=None) -> (y, new_state)``; x: [T, hidden]. The state's conv part is empty (no short
    convolution)."""

    projections = ("qkv_proj", "output_gate", "out_proj")

    def __init__(self, cfg: LightningConfig, weights: dict, name: str = "lightning"):
        self.cfg, self.name = cfg, name
        D, HD = cfg.hidden_size, cfg.inner

        def take(n, shape):
            return _take(weights, n, shape, name)
        self.qkv_proj = take("qkv_proj.weight", (3 * HD, D))
        self.output_gate = take("output_gate.weight", (HD, D))
        self.norm = take("norm.weight", (HD,))
        self.out_proj = take("out_proj.weight", (D, HD))
        self.slope = slope_rates(cfg.num_heads, cfg.layer_index, cfg.num_layers)      # slope: [H]

    def init_state(self, dtype=torch.float32, device=None) -> LinearAttentionState:
        c = self.cfg
        return LinearAttentionState(recurrent=torch.zeros(c.num_heads, c.head_dim, c.head_dim, dtype=RECURRENT_DTYPE,
                                                          device=device),
                                    conv=torch.zeros(0, 0, dtype=dtype, device=device))

    def _qkv(self, x: torch.Tensor):
        """q, k, v: [T, H, D] float32."""
        c = self.cfg
        qkv = F.silu(_linear(x, self.qkv_proj)).float().reshape(x.shape[0], c.num_heads, 3 * c.head_dim)
        return qkv.split(c.head_dim, dim=-1)

    def _out(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """o [T, H, D] float32 -> y [T, hidden]: RMSNorm over all heads, sigmoid gate, out_proj."""
        o = o.reshape(o.shape[0], -1)                                      # o: [T, H*D]
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps)
        o = (self.norm.float() * o).to(x.dtype)
        return _linear(torch.sigmoid(_linear(x, self.output_gate)) * o, self.out_proj)

    def __call__(self, x: torch.Tensor, state: LinearAttentionState | None = None):
        c = self.cfg
        _check_input(x, c.hidden_size, self.name)
        S = (state.recurrent if state is not None else self.init_state(device=x.device).recurrent).float()
        if S.shape != (c.num_heads, c.head_dim, c.head_dim):
            raise ValueError(f"{self.name}: state must be [{c.num_heads}, {c.head_dim}, {c.head_dim}], got "
                             f"{tuple(S.shape)}")
        q, k, v = (t.transpose(0, 1) for t in self._qkv(x))                # q, k, v: [H, T, D]
        s = self.slope.to(x.device)[:, None]                               # s: [H, 1]
        out = []
        for a in range(0, x.shape[0], CHUNK):
            qc, kc, vc = q[:, a:a + CHUNK], k[:, a:a + CHUNK], v[:, a:a + CHUNK]
            n = qc.shape[1]
            r = torch.arange(n, device=x.device, dtype=torch.float32)
            gap = r[:, None] - r[None, :]                                  # gap: [n, n] = t - j
            decay = torch.where(gap >= 0, torch.exp(-s[:, :, None] * gap.clamp(min=0)), 0.0)   # decay: [H, n, n]
            o = ((qc @ kc.transpose(1, 2)) * decay) @ vc                   # within the chunk: [H, n, D]
            o = o + (qc * torch.exp(-s * (r + 1))[:, :, None]) @ S         # the carried state, decayed to each t
            S = torch.exp(-s * n)[:, :, None] * S + (kc * torch.exp(-s * (n - 1 - r))[:, :, None]).transpose(1, 2) @ vc
            out.append(o)
        y = self._out(torch.cat(out, 1).transpose(0, 1), x)                # y: [T, hidden]
        return y, LinearAttentionState(recurrent=S.to(RECURRENT_DTYPE),
                                       conv=torch.zeros(0, 0, dtype=x.dtype, device=x.device))

    def step(self, x: torch.Tensor, recurrent: torch.Tensor, conv: torch.Tensor):
        """One decode token for each of B sequences. x: [B, hidden]; recurrent: [B, H, D, D] float32; conv: [B, 0, 0]
        (none). Returns (y [B, hidden], new recurrent, conv)."""
        c = self.cfg
        B = x.shape[0]
        if recurrent.shape != (B, c.num_heads, c.head_dim, c.head_dim):
            raise ValueError(f"{self.name}: decode state must be [{B}, {c.num_heads}, {c.head_dim}, {c.head_dim}], "
                             f"got {tuple(recurrent.shape)}")
        q, k, v = self._qkv(x)                                             # q, k, v: [B, H, D]
        lam = torch.exp(-self.slope.to(x.device))[None, :, None, None]     # lam: [1, H, 1, 1]
        S = lam * recurrent.float() + k.unsqueeze(-1) * v.unsqueeze(-2)    # S: [B, H, D, D]
        o = torch.einsum("bhk,bhkv->bhv", q, S)                            # o: [B, H, D]
        return self._out(o, x), S, conv
