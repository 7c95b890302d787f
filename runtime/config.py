"""The one runtime configuration: what ``generate``, ``serve`` (and its engine process) and
``load_model`` + ``Engine`` need, validated once at construction against the registries (policies,
prefetchers, scopes, schedules, prefetch rules, profiles), built from the command line and sent to
the engine process as a plain dict (``dataclasses.asdict``)."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from cache_policy.cost_model import load_profile
from cache_policy.keys import PREFILL_CHUNK, SCHEDULES, SCOPES, CpuExperts
from cache_policy.policies import live_policies
from cache_policy.prefetch import LIVE_PREFETCHERS
from cache_policy.replay import PREFETCH_RULES

from .engine import Engine
from .engine.speculative import SpecOptions
from .kernels.moe import ACT_QUANT
from .model import load_model
from .model.config import MoEConfig
from .model.layers.dense import DENSE_QUANT_CHOICES
from .parallel.shard import Shard, plan, rank_manifest, shared_pick_cuts
from .store import Manifest


@dataclass
class RuntimeConfig:
    model: str
    device_budget: "int | str | None" = None   # bytes, or "auto" (runtime/plan.py)
    kv_cache_budget: int = 0
    host_budget: "int | str | None" = None     # bytes, or "auto" (a machine without a GPU: load_model)
    policy: str = "reuse"
    scope: str = "global"
    prefetch: str = "none"
    max_batch: int = 16
    prefill_chunk: int = PREFILL_CHUNK
    threads: "int | None" = None
    expert_budget: "int | None" = None   # bytes of device expert slots directly (instead of device_budget)
    cache_bonus: float = 0.0
    schedule: str = "fcfs"
    max_active: "int | None" = None
    cpu_experts: str = "0"               # 0 | N | auto: hybrid execution (ExpertStore)
    prefetch_rule: str = "cost"          # cost | always (cache_policy.prefetch.PrefetchGate)
    profile: "str | None" = None         # hardware profile of the cost decisions (default: cpu / h200)
    host_act_quant: str = "q8"           # q8 | none: quantized experts on the CPU dot 8-bit activations (runtime/kernels;
                                         # llama.cpp's default); none: exact float activations
    dense_quant: str = "auto"            # auto | none | int8 | int4: non-expert projections quantized at load
                                         # (layers/dense.py); auto: as the store's convert --dense-quant recorded
    tensor_parallel: int = 1             # ranks that split every expert and the attention heads (runtime/parallel)
    pipeline_parallel: int = 1           # stages of consecutive layers (x tensor_parallel ranks each)
    prefix_caching: bool = True          # reuse the KV blocks of cached prompt prefixes (runtime/engine/kv_manager.py)
    prefix_snapshots: "int | None" = None   # state snapshots for the prefix cache (stateful models; None: max_active)
    # speculative decoding: SpecOptions' fields as a dict (the config travels as one), None: off
    speculative: "dict | None" = None

    def __post_init__(self) -> None:
        if not os.path.isfile(os.path.join(self.model, "manifest.json")):
            raise ValueError(f"--model {self.model!r}: not a store directory (no manifest.json); "
                             f"run 'tiered-moe convert' first")
        if self.policy not in live_policies():
            raise ValueError(f"--policy {self.policy!r}: use {', '.join(live_policies())}")
        if self.scope not in SCOPES:
            raise ValueError(f"--scope {self.scope!r}: use {' or '.join(SCOPES)}")
        if self.prefetch not in LIVE_PREFETCHERS:
            raise ValueError(f"--prefetch {self.prefetch!r}: use {', '.join(LIVE_PREFETCHERS)}")
        if isinstance(self.device_budget, str) and self.device_budget != "auto":
            raise ValueError(f"--device-budget {self.device_budget!r}: give bytes or auto")
        if isinstance(self.host_budget, str) and self.host_budget != "auto":
            raise ValueError(f"--host-budget {self.host_budget!r}: give bytes or auto")
        if self.max_batch < 1 or self.prefill_chunk < 1:
            raise ValueError("--max-batch and --prefill-chunk must be at least 1")
        if not self.cache_bonus >= 0:
            raise ValueError(f"--cache-bonus must be >= 0, got {self.cache_bonus}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"--schedule {self.schedule!r}: use {' or '.join(SCHEDULES)}")
        if self.max_active is not None and self.max_active < self.max_batch:
            raise ValueError(f"--max-active ({self.max_active}) must be at least --max-batch ({self.max_batch})")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"--threads must be at least 1, got {self.threads}")
        self.cpu_experts = str(CpuExperts.parse(self.cpu_experts))
        if self.prefetch_rule not in PREFETCH_RULES:
            raise ValueError(f"--prefetch-rule {self.prefetch_rule!r}: use {', '.join(PREFETCH_RULES)}")
        if self.profile is not None:
            load_profile(self.profile)
        if self.host_act_quant not in ACT_QUANT:
            raise ValueError(f"--host-act-quant {self.host_act_quant!r}: use {' or '.join(ACT_QUANT)}")
        if self.dense_quant not in DENSE_QUANT_CHOICES:
            raise ValueError(f"--dense-quant {self.dense_quant!r}: use {', '.join(DENSE_QUANT_CHOICES)}")
        if self.prefix_snapshots is not None and (not isinstance(self.prefix_snapshots, int) or self.prefix_snapshots < 0):
            raise ValueError(f"--prefix-snapshots must be a non-negative integer, got {self.prefix_snapshots!r}")
        if not isinstance(self.tensor_parallel, int) or self.tensor_parallel < 1:
            raise ValueError(f"--tensor-parallel must be a positive integer, got {self.tensor_parallel!r}")
        if not isinstance(self.pipeline_parallel, int) or self.pipeline_parallel < 1:
            raise ValueError(f"--pipeline-parallel must be a positive integer, got {self.pipeline_parallel!r}")
        if self.pipeline_parallel > 1:
            mc = MoEConfig.from_hf(self.model)
            if self.pipeline_parallel > mc.num_moe_layers:
                raise ValueError(f"--pipeline-parallel {self.pipeline_parallel}: the model has {mc.num_moe_layers} MoE "
                                 f"layers, a stage needs at least one")
            if mc.attn_res_block_layers:
                raise ValueError(f"--pipeline-parallel: {self.model} uses Block Attention Residuals, which pipeline "
                                 f"stages do not support yet; use --tensor-parallel")
            cut = shared_pick_cuts(mc, self.pipeline_parallel)
            if cut:
                raise ValueError(f"--pipeline-parallel {self.pipeline_parallel}: a stage would start at layer {cut[0]}, "
                                 f"which attends to the keys the layer before it picked (a shared DSA indexer) - "
                                 f"stages do not hand the pick over; use another stage count or --tensor-parallel")
            if self.host_budget is not None:
                raise ValueError("--pipeline-parallel needs a host tier that holds every expert of a stage: drop "
                                 "--host-budget")
        if self.speculative is not None:
            SpecOptions(**self.speculative)           # validated now; errors name the flag
            if self.tensor_parallel * self.pipeline_parallel > 1:
                raise ValueError("--speculative runs on one process: drop --tensor-parallel / --pipeline-parallel")
        if self.tensor_parallel > 1:
            if self.host_budget is not None:
                raise ValueError("--tensor-parallel needs a host tier that holds every expert (shared by the node's "
                                 "ranks): drop --host-budget")
            plan(MoEConfig.from_hf(self.model), Shard(0, self.tensor_parallel))   # what cannot split says so now
            rank_manifest(Manifest.read(self.model), Shard(0, self.tensor_parallel))

    def load(self, progress: bool = False, rank=None):
        """The model and its store, as configured: (model, store). ``rank``: this process's place in a
        tensor-parallel group (runtime/parallel/group.py): its slices."""
        if self.threads:
            torch.set_num_threads(self.threads)
        return load_model(self.model, device_budget=self.device_budget, expert_budget=self.expert_budget,
                          kv_cache_bytes=self.kv_cache_budget, host_budget=self.host_budget, policy=self.policy,
                          scope=self.scope, cpu_experts=self.cpu_experts, profile=self.profile,
                          max_batch=self.max_batch, progress=progress, host_act_quant=self.host_act_quant,
                          dense_quant=self.dense_quant, rank=rank)

    def engine(self, model, store, *, max_batch: "int | None" = None, max_active: "int | None" = None,
               keep_records: bool = True):
        """The engine over ``model`` and ``store``. ``max_batch`` lowers the configured one and
        ``max_active`` is then raised to at least it (generate knows its batch: no more sequences
        than prompts run at once)."""
        batch = min(self.max_batch, max_batch or self.max_batch)
        max_active = max_active if max_active is not None else self.max_active
        max_active = None if max_active is None else max(max_active, batch)
        return Engine(model, store, max_batch=batch, prefill_chunk=self.prefill_chunk, prefetch=self.prefetch,
                      cache_bonus=self.cache_bonus, schedule=self.schedule, max_active=max_active,
                      prefetch_rule=self.prefetch_rule, keep_records=keep_records,
                      prefix_caching=self.prefix_caching, prefix_snapshots=self.prefix_snapshots,
                      speculative=SpecOptions(**self.speculative) if self.speculative is not None else None)
