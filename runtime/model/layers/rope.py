"""Rotary position embeddings: default RoPE, YaRN, Llama 3.1's scaling, DeepSeek's interleaved layout, MLA's
softmax scale."""
from __future__ import annotations

import math

import numpy as np
import torch

from ..config import MoEConfig


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def rotate_half_roll(x: torch.Tensor) -> torch.Tensor:
    """rotate_half without the negation: (b, a). Times sin with its first half negated
    (``signed_sin``) it is rotate_half(x) * sin, bit for bit (-b * s == b * -s), in one op, not three."""
    return torch.roll(x, x.shape[-1] // 2, dims=-1)


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    a, b = sin.chunk(2, dim=-1)
    return torch.cat((-a, b), dim=-1)



def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_frequencies(cfg: MoEConfig):
    """Inverse frequencies over head_dim and the factor on cos/sin: default RoPE, YaRN (interpolate low
    frequencies by `factor`, keep high ones, a linear ramp between) or Llama 3.1's scaling."""
    return inv_frequencies(cfg.rotary_dim or cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)


def inv_frequencies(dim: int, base: float, y: dict, max_positions: int):
    """(inverse frequencies [dim / 2], factor on cos / sin) of RoPE over ``dim`` channels with ``base``;
    ``y``: {}, YaRN's parameters or Llama 3.1's (rope_type llama3)."""
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    if not y:
        return 1.0 / pos_freqs, 1.0
    if y.get("rope_type") == "llama3":
        return llama3_frequencies(1.0 / pos_freqs, y), 1.0
    factor = y.get("factor") or max_positions / y["original_max_position_embeddings"]
    att = y.get("attention_factor")
    if att is None:
        m, m_all = y.get("mscale"), y.get("mscale_all_dim")
        att = _yarn_mscale(factor, m) / _yarn_mscale(factor, m_all) if (m and m_all) else _yarn_mscale(factor)
    beta_fast, beta_slow = y.get("beta_fast") or 32, y.get("beta_slow") or 1
    orig = y["original_max_position_embeddings"]

    def corr_dim(rot):
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if y.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extra = 1 - ramp                                   # 1: keep the original frequency
    inv = (1.0 / (factor * pos_freqs)) * (1 - extra) + (1.0 / pos_freqs) * extra
    return inv, float(att)


def llama3_frequencies(inv: torch.Tensor, y: dict) -> torch.Tensor:
    """Llama 3.1's RoPE scaling of the inverse frequencies inv [dim / 2]: wavelengths past
    original_max_position_embeddings / low_freq_factor divided by ``factor``, those below ... / high_freq_factor
    kept, a ramp between by how many wavelengths the original length holds. Equal low and high factors (Llama 4
    Scout's) have no ramp: transformers' 0 / 0 there is never picked (its ``where``), nor is ours."""
    factor, lo, hi = float(y["factor"]), float(y["low_freq_factor"]), float(y["high_freq_factor"])
    old = float(y["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / lo, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo) if hi != lo else torch.zeros_like(inv)
    ramp = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old / hi) & (wavelen <= old / lo)
    return torch.where(medium, ramp, scaled)


def mla_softmax_scale(cfg: MoEConfig) -> float:
    """1/sqrt(qk head dim), times YaRN's mscale(factor, mscale_all_dim)^2 as DeepSeek applies it."""
    m = cfg.mla
    s = (m.qk_nope_head_dim + m.qk_rope_head_dim) ** -0.5
    y = cfg.rope_scaling
    if y and y.get("mscale_all_dim"):
        factor = y.get("factor") or cfg.max_position_embeddings / y["original_max_position_embeddings"]
        s *= _yarn_mscale(factor, y["mscale_all_dim"]) ** 2
    return s


def _rotate(t, cos, sin):
    return t * cos + rotate_half(t) * sin


def _no_rotation(t, cos, sin):
    return t



def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's layout: rotary pairs (x0, x1), (x2, x3), ... each rotated by one frequency."""
    c, s_ = cos[..., : cos.shape[-1] // 2], sin[..., : sin.shape[-1] // 2]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s_, x2 * c + x1 * s_], dim=-1)


class RotaryEmbedding:
    """cos and sin of positions, with the YaRN factor on both, in the model's dtype."""

    def __init__(self, cfg: MoEConfig, device, dtype) -> None:
        inv_freq, self.factor = rope_frequencies(cfg)
        self.inv_freq, self.dtype = inv_freq.to(device), dtype
        self._np = inv_freq.float().numpy() if torch.device(device).type == "cpu" and dtype == torch.float32 else None

    def decode(self, pos: list):
        """(cos, sin, signed sin) [B, rotary] of one position per sequence - a decode step - in numpy
        on a CPU: the same formula as ``__call__`` in a few us instead of ~10 torch ops; None where
        the torch path must run (another device or dtype)."""
        if self._np is None:
            return None
        freqs = np.multiply.outer(np.asarray(pos, dtype=np.float32), self._np)   # freqs: [B, rotary / 2]
        c, s = np.cos(freqs), np.sin(freqs)
        if self.factor != 1.0:
            c *= np.float32(self.factor)
            s *= np.float32(self.factor)
        cos, sin = np.concatenate((c, c), -1), np.concatenate((s, s), -1)
        return torch.from_numpy(cos), torch.from_numpy(sin), torch.from_numpy(np.concatenate((-s, s), -1))

    def __call__(self, pos: torch.Tensor):
        freqs = pos.float()[:, None] * self.inv_freq[None, :]           # freqs: [tokens, rotary dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.factor).to(self.dtype), (emb.sin() * self.factor).to(self.dtype)
