"""MoE transformer, router variants, and checkpoint conversion into the store's layout."""
from __future__ import annotations

import torch

from ..store import ExpertStore, Manifest
from ..store.slices import rank_manifest
from .config import SUPPORTED, MoEConfig
from .convert import load_dense
from .dense_slices import shard_dense
from .layers.dense import resolve_dense_quant
from .footprint import (GPU_MEMORY_UTILIZATION, cache_bytes, default_cache_tokens, dense_bytes as _dense_bytes,
                        dense_kept_bytes, device_memory, host_budget_auto, host_memory_available, stage_tensors)
from .moe import MoEModel, Sequence, StepHooks, kv_bytes_per_token, route, state_bytes_per_sequence


def compute_dtype_for(dtype: torch.dtype, device) -> torch.dtype:
    """The dtype a model of ``dtype`` weights computes in on ``device``: its own, except float32 for
    bf16 / fp16 on a CPU - CPUs without half-precision matrix units run a bf16 [8, 512] x
    [512, 1024] matmul ~3x slower than the float32 one, and transformers' fastest CPU setting for
    such a checkpoint is float32 too (bench/results/decode_speed.md). Costs twice the dense weights'
    and KV cache's bytes; experts stay half precision in the store (ExpertCodec widens them)."""
    if torch.device(device).type == "cpu" and dtype in (torch.bfloat16, torch.float16):
        return torch.float32
    return dtype


def rank_stride(m, shard) -> int:
    return rank_manifest(m, shard).blob_stride


def _check_store(store_dir: str, cfg: MoEConfig, m: Manifest) -> None:
    """The store's experts are the ones config.json describes (layers, experts, tensors, biases)."""
    H, I = cfg.expert_in, cfg.expert_intermediate
    want = {"gate_up": (2 * I, H), "gate": (I, H), "up": (I, H), "down": (H, I), "gate_up_bias": (2 * I,), "down_bias": (H,)}
    got = {w.name: tuple(w.shape) for w in m.weights}
    want = {k: v for k, v in want.items() if k in got}
    if cfg.expert_bias != ("down_bias" in got):
        raise ValueError(f"{store_dir}: the store's experts {'have' if 'down_bias' in got else 'lack'} biases, config.json "
                         f"({cfg.model_type}) says the opposite: a store of another model; convert again")
    if (m.num_layers, m.num_experts) != (cfg.num_moe_layers, cfg.num_experts) or got != want or "down" not in got:
        raise ValueError(f"{store_dir}: the store holds {m.num_layers} MoE layers x {m.num_experts} experts {got}, "
                         f"but config.json describes {cfg.num_moe_layers} x {cfg.num_experts} {want}: "
                         f"a store of another model; convert again")


def load_model(store_dir: str, *, device_budget: "int | None" = None, expert_budget: "int | None" = None,
               kv_cache_bytes: int = 0, host_budget: "int | None" = None, policy: str = "reuse", scope: str = "global",
               device: "str | None" = None, progress: bool = False, dtype=None, cpu_experts="0",
               profile: "str | None" = None, max_batch: int = 1, host_act_quant: str = "none",
               dense_quant: str = "auto", rank=None):
    """A converted store -> (model, store).

    ``device_budget``: the whole device tier - dense weights, the KV cache reservation
    (``kv_cache_bytes``) and expert slots; the experts get what is left. ``expert_budget``: bytes
    of expert slots directly. Neither: every expert fits on the device. ``host_budget``: bytes of
    expert slots in host memory (None: every expert). ``dtype``: the dtype the dense weights,
    activations and KV cache are computed in; default the checkpoint's, except float32 for a
    half-precision checkpoint on a CPU (see ``compute_dtype_for``). ``cpu_experts`` (0, N or auto) and
    ``profile``: hybrid execution, see ``ExpertStore``. ``host_act_quant``: none or q8, how 4-bit experts
    computed on the CPU take their activations (runtime/kernels/moe.py); ``dense_quant``: none, int8, int4
    (non-expert projections quantized at load: layers/dense.py) or auto (as ``convert --dense-quant`` recorded). ``max_batch``: sequences that run at once; a
    model with linear-attention layers reserves their recurrent state on the device (in
    ``kv_cache_bytes`` when given). ``rank``: a tensor-parallel rank (runtime/parallel/group.py ``Rank``):
    the model and store hold its slice (runtime/parallel/shard.py), and every budget is the rank's."""
    cfg = MoEConfig.from_hf(store_dir)
    m = Manifest.read(store_dir)
    _check_store(store_dir, cfg, m)
    dense_quant = resolve_dense_quant(dense_quant, m.extra)
    dense = load_dense(store_dir, cfg)
    stored = dense["model.embed_tokens.weight"].dtype       # the checkpoint's dtype (before a stage drops the embedding)
    shard, moe_range = None, None
    if rank is not None and rank.layers is not None and tuple(rank.layers) != (0, cfg.num_layers):
        # A pipeline stage: its layers' tensors, the embeddings on the first, norm and head on the last.
        lo, hi = rank.layers
        keep = set(stage_tensors(cfg, dense, set(range(lo, hi)), lo == 0, hi == cfg.num_layers))
        dense = {n: t for n, t in dense.items() if n in keep}
        moe_range = tuple(rank.moe)
    if rank is not None and rank.tp > 1:
        dense = shard_dense(cfg, rank.plan, dense)       # the rank's slice of the checkpoint's tensors
        cfg, shard = rank.plan.cfg, rank.plan.shard
    dtype = dtype or compute_dtype_for(stored,
                                       device or ("cuda" if torch.cuda.is_available() else "cpu"))
    # A rank's expert slots hold its slice of each expert (the whole one without tensor parallelism).
    stride = m.blob_stride if shard is None else rank_stride(m, shard)
    held = m.num_layers if moe_range is None else moe_range[1] - moe_range[0]     # MoE layers this process holds
    on = device or (rank.device if rank is not None else None) or ("cuda" if torch.cuda.is_available() else "cpu")
    if torch.device(on).type == "cpu" and rank is None and device_budget is None and expert_budget is None \
            and host_budget is not None:
        host_budget, cpu_experts, expert_budget = _one_memory(cfg, m, dense, dtype, host_budget, kv_cache_bytes,
                                                              max_batch, dense_quant)
    elif host_budget == "auto":
        raise ValueError("--host-budget auto sizes the one memory of a machine without a GPU (no --device-budget); "
                         "with a device tier give the host budget in bytes")
    if device_budget == "auto":
        # As runtime/plan.py reports it (footprint.py): the device's memory at gpu_memory_utilization, the cache for
        # max_batch sequences of the context (up to 8192 tokens) unless --kv-cache-budget says otherwise, the rest
        # expert slots.
        mem, _ = device_memory(device or (rank.device if rank is not None else None) or
                               ("cuda" if torch.cuda.is_available() else None), profile)
        device_budget = int(mem * GPU_MEMORY_UTILIZATION)
        if not kv_cache_bytes:
            kv_cache_bytes = cache_bytes(cfg, dtype, min(cfg.max_position_embeddings, 8192), max_batch)
    if device_budget is not None:
        dense_bytes = _dense_bytes(dense.values(), dtype)
        need = cfg.top_k * stride * (m.num_layers if scope == "layer" else 1)
        state = max_batch * state_bytes_per_sequence(cfg, dtype)
        cache = max(kv_cache_bytes, state)     # the KV budget holds the state slots when given
        expert_budget = min(device_budget - dense_bytes - cache, held * m.num_experts * stride)
        if expert_budget < need:
            what = f"KV cache ({kv_cache_bytes:,} bytes)"
            if state > kv_cache_bytes:
                what = (f"the fixed per-sequence caches (recurrent state, sliding-window rings) of --max-batch "
                        f"{max_batch} sequences ({state:,} bytes)")
            raise ValueError(f"device budget {device_budget:,} bytes cannot hold the dense weights ({dense_bytes:,} bytes) "
                             f"+ {what} + one layer's top-{cfg.top_k} experts ({need:,} bytes): "
                             f"the minimum is {dense_bytes + cache + need:,} bytes")
    if expert_budget is None:
        expert_budget = held * m.num_experts * stride
    store = ExpertStore(store_dir, device_budget=expert_budget, host_budget=host_budget, policy=policy, scope=scope,
                        device=device or (rank.device if rank is not None else None),
                        min_experts_per_layer=cfg.top_k, progress=progress, cpu_experts=cpu_experts,
                        profile=profile, shard=shard, share=rank.share if rank is not None and rank.world > 1 else None,
                        layers=moe_range)
    return MoEModel(cfg, dense, store, device=store.device, dtype=dtype, kv_bytes=kv_cache_bytes or None,
                    host_act_quant=host_act_quant, dense_quant=dense_quant, tp=rank), store


def _one_memory(cfg, m, dense: dict, dtype, host_budget, kv_cache_bytes: int, max_batch: int,
                dense_quant: str = "none") -> tuple:
    """A machine without a GPU given only a host budget: one memory. A "device" tier would be a second copy of
    the experts in the same RAM, so the host budget is all the experts get - every expert computes from its
    host-tier slot (cpu_experts = every MoE layer; llama.cpp's --n-cpu-moe over all of them) and the device
    tier keeps the minimum its checks ask (one layer's top-k slots, never filled). ``auto``: the memory
    available (host_memory_available: MemAvailable, or a cgroup limit's room) less what the dense weights will
    grow by (counted at the size they are kept: bf16, --dense-quant's codes; footprint.dense_kept_bytes), the KV
    cache and a margin (footprint.host_budget_auto). -> (host_budget, cpu_experts,
    expert_budget)."""
    stride = m.blob_stride
    if host_budget == "auto":
        avail, src = host_memory_available()
        loaded = sum(t.numel() * t.element_size() for t in dense.values())       # held now, as stored
        grow = max(0, dense_kept_bytes(dense, dtype, dense_quant) - loaded)     # as the model will keep them
        # the cache the engine will make: its default token slots; state slots for max_active (4 x max_batch)
        # sequences and as many snapshots
        tokens = default_cache_tokens(cfg.max_position_embeddings, max_batch)
        kv = kv_cache_bytes or int(tokens * kv_bytes_per_token(cfg, dtype)
                                   + 8 * max_batch * state_bytes_per_sequence(cfg, dtype))
        host_budget = host_budget_auto(avail, grow, kv)
        need = cfg.top_k * stride
        if host_budget < need:
            raise ValueError(f"--host-budget auto: {avail:,} bytes available ({src}) less the dense weights' growth "
                             f"({grow:,}), the KV cache ({kv:,}) and the margin leave {max(host_budget, 0):,} bytes, "
                             f"less than one layer's top-{cfg.top_k} experts ({need:,} bytes)")
        host_budget = min(host_budget, m.num_layers * m.num_experts * stride)
    return host_budget, str(m.num_layers), cfg.top_k * stride


__all__ = ["SUPPORTED", "MoEConfig", "MoEModel", "Sequence", "StepHooks", "route", "load_model"]
