"""MoE transformer, router variants, and checkpoint conversion into the store's layout."""
from __future__ import annotations

import os

from .config import SUPPORTED, MoEConfig
from .moe import MoEModel, Sequence, route


def load_model(store_dir: str, *, device_budget: "int | None" = None, host_budget: "int | None" = None,
               policy: str = "lru", scope: str = "global", device: "str | None" = None, progress: bool = False):
    """A converted store -> (model, store). device_budget None: every expert fits on the device."""
    import torch

    from ..store import ExpertStore, Manifest
    from .convert import load_dense
    cfg = MoEConfig.from_hf(store_dir)
    m = Manifest.read(store_dir)
    H, I = cfg.hidden_size, cfg.expert_intermediate
    want = {"gate": (I, H), "up": (I, H), "down": (H, I)}
    got = {t.name: tuple(t.shape) for t in m.tensors}
    if (m.num_layers, m.num_experts) != (cfg.num_moe_layers, cfg.num_experts) or got != want:
        raise ValueError(f"{store_dir}: the store holds {m.num_layers} MoE layers x {m.num_experts} experts {got}, "
                         f"but config.json describes {cfg.num_moe_layers} x {cfg.num_experts} {want}: "
                         f"a store of another model; convert again")
    if device_budget is None:
        device_budget = m.num_layers * m.num_experts * m.blob_stride
    store = ExpertStore(store_dir, device_budget=device_budget, host_budget=host_budget, policy=policy, scope=scope,
                        device=device, min_experts_per_layer=cfg.top_k, progress=progress)
    dense = load_dense(store_dir, cfg)
    dtype = dense["model.embed_tokens.weight"].dtype
    return MoEModel(cfg, dense, store, device=store.device, dtype=dtype), store


__all__ = ["SUPPORTED", "MoEConfig", "MoEModel", "Sequence", "route", "load_model"]
