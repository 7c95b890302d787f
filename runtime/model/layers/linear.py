"""A linear-attention layer (KDA, Gated DeltaNet: runtime/model/linear_attention.py holds the math)
over its slot of the per-sequence state arena."""
from __future__ import annotations

import torch

from ..config import MoEConfig
from ..names import linear_names
from ..linear_attention import (GatedDeltaNet, GatedDeltaNetConfig, KDAConfig, KimiDeltaAttention,
                                LinearAttentionState)
from .cache import StateCacheSpec
from .context import ForwardContext
from .weights import layer_prefix, take
from .protocol import Sublayer


def linear_kind(cfg: MoEConfig):
    """(layer class, its config) of the model's linear-attention kind."""
    if cfg.linear_kind == "kda":
        return KimiDeltaAttention, KDAConfig(hidden_size=cfg.hidden_size, num_heads=cfg.linear_num_heads,
                                             head_dim=cfg.linear_head_dim, conv_kernel_size=cfg.linear_conv_kernel,
                                             rms_norm_eps=cfg.rms_norm_eps)
    return GatedDeltaNet, GatedDeltaNetConfig(hidden_size=cfg.hidden_size, num_k_heads=cfg.linear_num_heads,
                                              num_v_heads=cfg.linear_num_v_heads, head_k_dim=cfg.linear_head_dim,
                                              head_v_dim=cfg.linear_value_head_dim,
                                              conv_kernel_size=cfg.linear_conv_kernel, rms_norm_eps=cfg.rms_norm_eps)


class LinearAttentionLayer(Sublayer):
    def __init__(self, cfg: MoEConfig, i: int, w: dict, *, state_index: int) -> None:
        kind, lc = linear_kind(cfg)
        p = layer_prefix(i) + cfg.linear_prefix
        self.state_index = state_index
        self.layer = kind(lc, {n[len(p):]: take(w, n) for n in linear_names(cfg, i)}, name=f"layer {i}")

    @staticmethod
    def cache_spec(cfg: MoEConfig, i: int) -> StateCacheSpec:
        """A fixed state per sequence: the recurrent memory (float32) and the short convolution's inputs."""
        H, K, W = cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_conv_kernel
        if cfg.linear_kind == "kda":        # keys and values of one size; q, k, v each convolved
            return StateCacheSpec(recurrent=(H, K, K), conv=(3 * H * K, W - 1))
        Hv, V = cfg.linear_num_v_heads, cfg.linear_value_head_dim   # Gated DeltaNet: a [Dk, Dv] memory per value head
        return StateCacheSpec(recurrent=(Hv, K, V), conv=(2 * H * K + Hv * V, W - 1))

    @staticmethod
    def tensors(cfg: MoEConfig, i: int) -> dict:
        """The checkpoint tensors this layer takes -> shape: its architecture module's table."""
        return linear_names(cfg, i)

    def __call__(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Each sequence carries its recurrent and convolution state in its slot of the state arena.
        One token per sequence (decode, or one-token prompts): one batched step for all of them;
        longer chunks: the chunked form per sequence, from the state its earlier chunks left. A
        sequence's first token starts from the zero state, whatever its slot held before."""
        j = self.state_index
        R, C = ctx.kv.rec[j], ctx.kv.conv[j]                             # R: [slots, H, K, V]; C: [slots, conv dim, W-1]
        if ctx.decode:
            slots = ctx.state                                            # slots: [B]
            if ctx.fresh is not None:
                R[ctx.fresh] = 0
                C[ctx.fresh] = 0
            y, S, conv = self.layer.step(x, R[slots], C[slots])
            R[slots] = S
            C[slots] = conv
            return y
        out = torch.empty_like(x)                                        # out: [tokens, hidden]
        for s, (a, b) in zip(ctx.seqs, ctx.spans):
            y, st = self.layer(x[a:b], None if s.length == 0 else LinearAttentionState(R[s.state], C[s.state]))
            R[s.state] = st.recurrent
            C[s.state] = st.conv
            out[a:b] = y
        return out
