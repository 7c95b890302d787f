"""Which attention class each layer is, and what the layers cache: the one place the config picks a
layer's attention kind, and the cache specs every kind declares (``cache_spec``) gathered per layer.

It sits above the kinds (they import ``layers/cache.py`` for their specs), so nothing below imports it."""
from __future__ import annotations

from ..config import MoEConfig
from .absent import Absent
from .attention import Attention
from .dsa import DSAttention
from .linear import LinearAttentionLayer
from .mla import MLAttention
from .v4_attention import V4Attention


def attention_kind(cfg: MoEConfig, i: int):
    """The attention class of layer ``i``: the one place the config picks it."""
    if i in cfg.empty_attn_layers:      # a layer of an FFN alone (Nemotron-H)
        return Absent
    if i in cfg.linear_layers:
        return LinearAttentionLayer
    if cfg.attention == "v4":
        return V4Attention
    if cfg.attention == "mla":
        return DSAttention if cfg.sparse_mla else MLAttention
    return Attention


def cache_specs(cfg: MoEConfig, layers=None) -> dict:
    """Layer index -> what it caches per sequence: TokenCacheSpec (grows with every token),
    WindowCacheSpec or StateCacheSpec (fixed), as each layer's attention kind declares it
    (``cache_spec``). One budget covers all of them (MoEModel.init_kv). ``layers``: only these (a
    pipeline stage's; None: every layer)."""
    return {i: attention_kind(cfg, i).cache_spec(cfg, i) for i in (range(cfg.num_layers) if layers is None else layers)}


def kv_bytes_per_token(cfg: MoEConfig, dtype, layers=None) -> float:
    """Bytes a sequence's cache grows by per token: per-token layers' k (and v), DeepSeek-V4's compressed
    entries (a fraction of a row per token)."""
    return sum(s.bytes_per_token(dtype) for s in cache_specs(cfg, layers).values() if hasattr(s, "bytes_per_token"))


def state_bytes_per_sequence(cfg: MoEConfig, dtype, layers=None) -> int:
    """Fixed bytes per sequence: recurrent states, sliding-window rings, DeepSeek-V4's rings and
    compressor state."""
    return sum(s.bytes_per_sequence(dtype) for s in cache_specs(cfg, layers).values()
               if hasattr(s, "bytes_per_sequence"))
