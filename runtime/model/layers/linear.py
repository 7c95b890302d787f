"""A linear-attention layer (KDA, Gated DeltaNet: runtime/model/linear_attention.py holds the math)
over its slot of the per-sequence state arena."""
from __future__ import annotations

import torch

from ..config import MoEConfig
from ..names import linear_names
from ..lightning_attention import LightningAttention, LightningConfig
from ..mamba2 import Mamba2, Mamba2Config
from ..linear_attention import (GatedDeltaNet, GatedDeltaNetConfig, KDAConfig, KimiDeltaAttention,
                                LinearAttentionState)
from .cache import StateCacheSpec
from .context import ForwardContext
from .dense import Linear
from .weights import layer_prefix, linear_opts, take
from .protocol import HeadSplit, Sublayer, cols, rows


def linear_kind(cfg: MoEConfig, i: int):
    """(layer class, its config) of the model's linear-attention kind at layer ``i``."""
    lin = cfg.linear
    if lin.kind == "mamba2":
        return Mamba2, Mamba2Config(hidden_size=cfg.hidden_size, num_heads=lin.num_heads, head_dim=lin.head_dim,
                                    num_groups=lin.num_groups, state_size=lin.state_dim, conv_kernel=lin.conv_kernel,
                                    rms_norm_eps=cfg.rms_norm_eps, conv_bias=lin.conv_bias, proj_bias=lin.proj_bias)
    if lin.kind == "lightning":         # its decay rates depend on the layer's depth
        return LightningAttention, LightningConfig(hidden_size=cfg.hidden_size, num_heads=lin.num_heads,
                                                   head_dim=lin.head_dim, layer_index=i, num_layers=cfg.num_layers)
    if lin.kind == "kda":
        return KimiDeltaAttention, KDAConfig(hidden_size=cfg.hidden_size, num_heads=lin.num_heads,
                                             head_dim=lin.head_dim, conv_kernel_size=lin.conv_kernel,
                                             rms_norm_eps=cfg.rms_norm_eps)
    return GatedDeltaNet, GatedDeltaNetConfig(hidden_size=cfg.hidden_size, num_k_heads=lin.num_heads,
                                              num_v_heads=lin.num_v_heads, head_k_dim=lin.head_dim,
                                              head_v_dim=lin.value_head_dim,
                                              conv_kernel_size=lin.conv_kernel, rms_norm_eps=cfg.rms_norm_eps)


class LinearAttentionLayer(Sublayer):
    def __init__(self, cfg: MoEConfig, i: int, w: dict) -> None:
        kind, lc = linear_kind(cfg, i)
        p = layer_prefix(i) + cfg.linear.prefix
        self.i, self.cfg_kind = i, cfg.linear.kind
        names = linear_names(cfg, i)
        stored = {w[n].dtype for n in names if n in w and w[n].dim() == 2}
        self.layer = kind(lc, {n[len(p):]: take(w, n) for n in names}, name=f"layer {i}")
        # The projections on dense.py's Linear, in the checkpoint's dtype (bf16 came through the compute dtype
        # exactly): the host kernels' bf16 GEMV or --dense-quant rows on a CPU, torch.mm elsewhere.
        keep = stored.pop() if len(stored) == 1 else None
        dt = getattr(w, "dtype", None)
        if dt is not None:
            self.layer.prepare(lambda t: Linear(t if keep is None else t.to(keep), None, dt, **linear_opts(w)))

    # the fused CPU decode (layers/fused.py DeltaPart, tm_gdn_block) takes Gated DeltaNet and KDA
    fused_part = "linear"

    def fused_refusal(self) -> "str | None":
        return None if self.cfg_kind in ("kda", "gated_deltanet") else f"{self.cfg_kind} layers (no host kernel yet)"

    @classmethod
    def head_split(cls, cfg: MoEConfig, shard) -> HeadSplit:
        """Heads split (Gated DeltaNet: key-head groups with their value heads); each rank keeps its heads'
        recurrent state, so the state arena splits too. The low-rank first factors and the per-head output
        norm are replicated."""
        N, lin = shard.world, cfg.linear
        if lin.kind == "mamba2":
            return HeadSplit(why="Mamba-2 layers are not split over tensor-parallel ranks yet")
        if lin.kind == "lightning":
            return HeadSplit(why="lightning attention normalises every head's output together (one RMSNorm over "
                                 "all heads): a rank holds only its heads")
        if lin.num_heads % N:
            return HeadSplit(why=f"{lin.num_heads} linear-attention heads do not split over {N} ranks")
        # the rank's config: MoEConfig's fields (its ``linear`` view is made from them)
        return HeadSplit(changes={"linear_num_heads": lin.num_heads // N, "linear_num_v_heads": lin.num_v_heads // N})

    @staticmethod
    def shard_tensors(cfg: MoEConfig, i: int, out: dict, plan) -> None:
        lin = cfg.linear
        _SHARD_TENSORS.get(lin.kind, _shard_gdn)(lin, out, layer_prefix(i) + lin.prefix, plan.shard)

    @staticmethod
    def cache_spec(cfg: MoEConfig, i: int) -> StateCacheSpec:
        """A fixed state per sequence: the recurrent memory (float32) and the short convolution's inputs."""
        lin = cfg.linear
        H, K, W = lin.num_heads, lin.head_dim, lin.conv_kernel
        if lin.kind == "kda":               # keys and values of one size; q, k, v each convolved
            return StateCacheSpec(recurrent=(H, K, K), conv=(3 * H * K, W - 1))
        if lin.kind == "lightning":         # no short convolution
            return StateCacheSpec(recurrent=(H, K, K), conv=(0, 0))
        if lin.kind == "mamba2":            # [P, N] per head; x | B | C convolved
            return StateCacheSpec(recurrent=(H, K, lin.state_dim), conv=(H * K + 2 * lin.num_groups * lin.state_dim, W - 1))
        Hv, V = lin.num_v_heads, lin.value_head_dim     # Gated DeltaNet: a [Dk, Dv] memory per value head
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
        cache = ctx.kv[self.i]
        R, C = cache.recurrent, cache.conv                               # R: [slots, H, K, V]; C: [slots, conv dim, W-1]
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


def _shard_kda(lin, out: dict, p: str, shard) -> None:
    """Kimi Delta Attention's tensors (the released names: runtime/model/arch/kimi_linear.py) for the rank's heads
    (lin: the config's ``linear`` view)."""
    a, b = shard.part(lin.num_heads)
    K = lin.head_dim
    for n in ("q_proj.weight", "k_proj.weight", "v_proj.weight", "q_conv1d.weight", "k_conv1d.weight",
              "v_conv1d.weight", "f_b_proj.weight", "g_b_proj.weight", "dt_bias"):
        out[p + n] = rows(out[p + n], a * K, b * K)
    out[p + "b_proj.weight"] = rows(out[p + "b_proj.weight"], a, b)
    out[p + "A_log"] = out[p + "A_log"][..., a:b, :].contiguous() if out[p + "A_log"].dim() == 4 else \
        out[p + "A_log"][a:b].contiguous()
    out[p + "o_proj.weight"] = cols(out[p + "o_proj.weight"], a * K, b * K)


def _shard_gdn(lin, out: dict, p: str, shard) -> None:
    """Gated DeltaNet's tensors (runtime/model/arch/qwen3_next.py's table) for the rank's key-head groups (lin: the
    config's ``linear`` view)."""
    Hk, Dk, Hv, Dv = lin.num_heads, lin.head_dim, lin.num_v_heads, lin.value_head_dim
    a, b = shard.part(Hk)
    r = Hv // Hk                                         # value heads per key head
    va, vb = a * r, b * r

    def flat_qkv(t: torch.Tensor) -> torch.Tensor:      # rows (or conv channels) q | k | v, each flat over heads
        q, k, v = t[:Hk * Dk], t[Hk * Dk:2 * Hk * Dk], t[2 * Hk * Dk:]
        return torch.cat([q[a * Dk:b * Dk], k[a * Dk:b * Dk], v[va * Dv:vb * Dv]]).contiguous()
    if p + "in_proj_qkvz.weight" in out:                 # Qwen3-Next: grouped per key head [q k v z] and [b a]
        w = out[p + "in_proj_qkvz.weight"]
        out[p + "in_proj_qkvz.weight"] = w.reshape(Hk, -1, w.shape[1])[a:b].reshape(-1, w.shape[1]).contiguous()
        w = out[p + "in_proj_ba.weight"]
        out[p + "in_proj_ba.weight"] = w.reshape(Hk, -1, w.shape[1])[a:b].reshape(-1, w.shape[1]).contiguous()
    else:                                                # Qwen3.5: flat
        out[p + "in_proj_qkv.weight"] = flat_qkv(out[p + "in_proj_qkv.weight"])
        out[p + "in_proj_z.weight"] = rows(out[p + "in_proj_z.weight"], va * Dv, vb * Dv)
        for n in ("in_proj_b.weight", "in_proj_a.weight"):
            out[p + n] = rows(out[p + n], va, vb)
    out[p + "conv1d.weight"] = flat_qkv(out[p + "conv1d.weight"])
    for n in ("dt_bias", "A_log"):
        out[p + n] = rows(out[p + n], va, vb)
    out[p + "out_proj.weight"] = cols(out[p + "out_proj.weight"], va * Dv, vb * Dv)


# the linear-attention kind's cut, by the kind the config names (Gated DeltaNet otherwise, as ``linear_kind``)
_SHARD_TENSORS = {"kda": _shard_kda}
