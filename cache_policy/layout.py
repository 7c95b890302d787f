"""Projected tokens/s of a multi-GPU layout - tensor-parallel ranks x pipeline stages - from a routing trace.

The same placement as every replay (``TieredPlacement``), run for what one rank holds, and a step-time
model for what changes with the layout (the numbers come from the profile's ``multi_gpu`` section,
each with its source):

* **Tensor parallelism (N ranks)**: every rank holds its slice of each expert (runtime/parallel/shard.py),
  so a rank's device slot holds 1/N of an expert's bytes: the same memory holds N times the experts.
  Every rank misses the same experts at the same time (one placement truth) and moves its slices over
  its own host link: a layer's misses cost ``m x bytes / N`` on each link, at the copy-size bandwidth of
  the layer's back-to-back copies (h200-anchors.json: sixteen 17 MiB copies take as long as one 272 MiB
  copy, so queued copies run at the bandwidth of their sum). Links shared by several GPUs
  (``host_links`` < GPUs) split their bandwidth. A rank computes 1/N of each expert (the profile's
  compute scales with parameters). Each layer adds two all-reduces of the step's hidden states
  (after attention and after the FFN): ``latency + 2 (N-1)/N x bytes / bus bandwidth`` (nccl-tests'
  bus-bandwidth convention); a model whose attention is replicated (runtime/parallel/shard.py) has one.
* **Pipeline parallelism (M stages)**: stage s holds a contiguous range of the MoE layers and places only
  those. A step of B sequences runs as m = min(B, M) micro-batches of ceil(B / m) sequences, replayed at
  that batch; stages overlap across micro-batches, so a step takes every stage's (slowest) micro-batch time
  once plus m - 1 more of the slowest stage's - (m + M - 1) x one when the stages are equal - plus a hop per
  stage boundary (``p2p_latency_us``). At batch 1 that is the sum of the stages: pipeline parallelism
  adds memory, not speed.

Dense weights (attention, dense MLPs, shared experts, routers, the head) are charged where the caller knows
the model (``dense_bytes``: what one rank reads per step, at the profile's HBM read rate - replicated parts
cost every rank their whole bytes, split ones a slice); a bare trace leaves them out. Not modelled: attention
over the cache (its reads grow with the context), hybrid host compute (layouts project the device path), and
kernel-launch floors of small slices (compute scales linearly with a slice's parameters: optimistic at large N).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import cost_model as cm
from .placement import TieredPlacement
from .policies import LRU
from .prefetch import PrefetchController
from .replay import _expert_size, _run_groups, device_slots_for, make_policy_factory
from .traces import Trace, build_groups, continuous_batches


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for name, v in (("tensor-parallel", self.tp), ("pipeline-parallel", self.pp)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"--{name} must be a positive integer, got {v!r}")

    @property
    def gpus(self) -> int:
        return self.tp * self.pp

    def __str__(self) -> str:
        return f"TP{self.tp}" + (f"xPP{self.pp}" if self.pp > 1 else "")


@dataclass(frozen=True)
class MultiGPU:
    """The profile's ``multi_gpu`` section: the node and its GPU interconnect."""
    gpus_per_node: int
    hbm_bytes: int
    host_links: int
    allreduce_latency_us: float
    busbw_GBps: float
    p2p_latency_us: float
    p2p_GBps: float
    source: str = ""
    hbm_read_GBps: float = 0.0

    @staticmethod
    def of(profile: cm.HardwareProfile) -> "MultiGPU":
        d = profile.raw.get("multi_gpu")
        if not d:
            raise ValueError(f"hardware profile {profile.name!r} has no multi_gpu section (GPUs per node, host links, "
                             f"interconnect): layouts cannot be projected on it")
        try:
            ic = d["interconnect"]
            return MultiGPU(int(d["gpus_per_node"]), int(d["hbm_bytes"]), int(d["host_links"]),
                            float(ic["allreduce_latency_us"]), float(ic["busbw_GBps"]), float(ic["p2p_latency_us"]),
                            float(ic["p2p_GBps"]), source=str(d.get("cite", "")),
                            hbm_read_GBps=float(d.get("hbm_read_GBps", 0.0)))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"hardware profile {profile.name!r}: multi_gpu section is not readable ({e})") from None

    def allreduce_seconds(self, nbytes: float, ranks: int) -> float:
        if ranks <= 1:
            return 0.0
        return self.allreduce_latency_us * 1e-6 + 2 * (ranks - 1) / ranks * nbytes / (self.busbw_GBps * 1e9)

    def p2p_seconds(self, nbytes: float) -> float:
        return self.p2p_latency_us * 1e-6 + nbytes / (self.p2p_GBps * 1e9)


def stage_ranges(num_layers: int, stages: int) -> list:
    """Contiguous, balanced MoE-layer ranges of ``stages`` pipeline stages."""
    if stages > num_layers:
        raise ValueError(f"{stages} pipeline stages for {num_layers} MoE layers: a stage needs at least one")
    cuts = [round(i * num_layers / stages) for i in range(stages + 1)]
    return [(cuts[i], cuts[i + 1]) for i in range(stages)]


def sub_trace(trace: Trace, a: int, b: int) -> Trace:
    """The routing of MoE layers [a, b) only (what one pipeline stage places)."""
    return Trace(ids=np.ascontiguousarray(trace.ids[:, a:b]), seq_offsets=trace.seq_offsets,
                 num_experts=trace.num_experts, model=trace.model, source=f"{trace.source}[layers {a}:{b}]",
                 layer_numbers=None if trace.layer_numbers is None else trace.layer_numbers[a:b],
                 expert_bytes=trace.expert_bytes, expert_dtype=trace.expert_dtype,
                 weights=None if trace.weights is None else np.ascontiguousarray(trace.weights[:, a:b]))


def _link_seconds(prof: cm.HardwareProfile, n: np.ndarray, nbytes: int, share: float) -> np.ndarray:
    """Seconds to move ``n`` slices of ``nbytes`` back to back (per group) at the bandwidth of their sum,
    a link's ``share`` each."""
    total = n * float(nbytes)
    gbps = cm._interp_log(prof.h2d_GBps_by_MiB, np.maximum(total, 1.0) / 2**20)
    return np.where(n > 0, total / (gbps * 1e9 * share), 0.0)


def stage_step_seconds(prof: cm.HardwareProfile, mg: MultiGPU, groups, run: dict, *, params: int, nbytes: int,
                       L: int, tp: int, tokens: np.ndarray, hidden: int, act_bytes: int = 2,
                       allreduces: float = 2.0) -> np.ndarray:
    """Per step, the seconds one rank spends on its layers: overlap model of cost_model.project_step_times,
    with the layout's links, compute and all-reduces. ``run``: replay._run_groups' records of the rank's
    placement; ``tokens``: tokens of each step."""
    G = len(groups.ptr) - 1
    dev_hits, _, _, _, _, host_computed = run["R"].T
    sizes = np.diff(groups.ptr)
    per_count = prof.compute_seconds(np.arange(int(groups.count.max()) + 1), params)
    gid = np.repeat(np.arange(G), sizes)
    C = np.bincount(gid, weights=per_count[groups.count], minlength=G)
    share = min(1.0, mg.host_links / tp)         # ranks pulling at once through fewer host links split them
    D = _link_seconds(prof, sizes - dev_hits - host_computed, nbytes, share)
    P = _link_seconds(prof, run["pref"].sum(1), nbytes, share)
    c_min = float(prof.compute_seconds(1, params))
    dev = np.maximum(C, np.where(D > 0, D + c_min, 0.0))
    free = np.concatenate([[0.0], (dev - D)[:-1]])
    spill = np.maximum(0.0, P - free)
    ar = np.repeat(np.array([allreduces * mg.allreduce_seconds(t * hidden * act_bytes, tp) for t in tokens]), L)
    dense = prof.non_expert_us_per_layer * 1e-6 / tp
    return (spill + dev + ar[:G] + dense).reshape(-1, L).sum(1)


def project(trace: Trace, cfg, batch: int, layout: Layout, *, hidden: int, allreduces_per_layer: float = 2.0,
            dense_bytes=0, progress=None) -> dict:
    """Tokens/s of ``layout`` at ``batch`` (continuous batching of the trace's sequences). ``cfg``: a
    ReplayConfig (policy, prefetch, capacity per GPU - a fraction of the experts as slices, a count of
    slices or bytes of HBM -, profile, expert size); ``hidden``: the model's hidden size (all-reduce bytes);
    ``allreduces_per_layer``: the split sublayers of a layer on average (runtime/parallel/shard.py
    ``allreduces_per_layer``: 2 with split attention and FFN; 1 where attention is replicated);
    ``dense_bytes``: bytes of dense weights one rank reads per step (a number, or one per stage: runtime/plan.py
    ``step_dense_bytes``), at the profile's ``hbm_read_GBps`` - decode's dense products read their weights
    once per step; 0 (a trace without its model) leaves them out, an upper bound."""
    if cfg.cpu.enabled:
        raise ValueError("layout projections model the device path: drop --cpu-experts")
    prof = cfg.cost_profile
    mg = MultiGPU.of(prof)
    if layout.tp > mg.gpus_per_node:
        raise ValueError(f"--tensor-parallel {layout.tp} exceeds the {mg.gpus_per_node} GPUs of a {prof.name} node "
                         f"(tensor parallelism stays inside a node; use --pipeline-parallel across nodes)")
    size = _expert_size(trace, cfg)
    nbytes, params = -(-size["bytes"] // layout.tp), size["params"] / layout.tp
    m = min(batch, layout.pp)
    micro = -(-batch // m)
    stages = []
    total_steps = None
    for s, (a, b) in enumerate(stage_ranges(trace.num_layers, layout.pp)):
        tr = trace if layout.pp == 1 else sub_trace(trace, a, b)
        L, E, k = tr.num_layers, tr.num_experts, tr.top_k
        dev_slots, host_slots = device_slots_for(tr, cfg, nbytes)
        groups = build_groups(tr, continuous_batches(tr.seq_offsets, micro))
        factory = make_policy_factory(tr, cfg, None, micro)
        cost = cm.HybridCost(prof, int(params), nbytes)
        place = TieredPlacement(num_layers=L, num_experts=E, scope=cfg.scope, device_slots=dev_slots,
                                host_slots=host_slots, policy_factory=factory,
                                host_policy_factory=LRU if cfg.policy == "none" else factory)
        place.warm_start()
        ctl = PrefetchController(cfg.prefetch, num_layers=L, num_experts=E, budget=cfg.prefetch_budget or k,
                                 rule=cfg.prefetch_rule, link_s=cost.t_link, saving_s=cost.prefetch_saving(False),
                                 fit_trace=cfg.fit_trace if cfg.prefetch == "transition" else None,
                                 model_path=cfg.transition_model)
        wants = factory().wants if cfg.policy != "belady" else "next_use"
        if cfg.policy == "belady" or cfg.prefetch == "oracle":
            raise ValueError("layout projections take online policies and prefetchers (not belady / oracle)")
        run = _run_groups(groups, place, ctl, cost, None, wants, cfg, L, E, progress)
        t = stage_step_seconds(prof, mg, groups, run, params=int(params), nbytes=nbytes, L=L, tp=layout.tp,
                               tokens=groups.batch_sizes, hidden=hidden, allreduces=allreduces_per_layer)
        db = dense_bytes[s] if isinstance(dense_bytes, (list, tuple)) else dense_bytes
        if db:
            if mg.hbm_read_GBps <= 0:
                raise ValueError(f"profile {prof.name!r}: multi_gpu.hbm_read_GBps is needed to charge dense weights")
            t = t + db / (mg.hbm_read_GBps * 1e9)
        dev_hits = run["R"][:, 0]
        acc = int(np.diff(groups.ptr).sum())
        stages.append({"layers": [a, b], "device_slots": dev_slots, "step_seconds": t,
                       "device_hit_rate": float(dev_hits.sum() / acc) if acc else None,
                       "h2d_slices": int(acc - dev_hits.sum() + run["pref"].sum())})
        total_steps = len(t)
    T = trace.num_tokens
    # Micro-batch steps of every stage, in order: a step of the whole batch is m of them.
    per = np.stack([s["step_seconds"] for s in stages])                  # per: [stages, micro-steps]
    hop = mg.p2p_seconds(micro * hidden * 2) if layout.pp > 1 else 0.0
    if layout.pp == 1:
        seconds = float(per.sum())
    else:
        n = per.shape[1]
        full = -(-n // m)
        padded = np.zeros((per.shape[0], full * m))
        padded[:, :n] = per
        slow = padded.reshape(per.shape[0], full, m).max(2)              # slow: [stages, steps] slowest micro-batch
        # m equal micro-batches through M stages in order finish after every stage once plus m - 1 more of
        # the slowest (a flow shop's makespan): the sum of the stages at batch 1, (m + M - 1) x one when equal
        seconds = float((slow.sum(0) + (m - 1) * slow.max(0)).sum() + full * (layout.pp - 1) * hop)
    moved = sum(s["h2d_slices"] for s in stages) * nbytes
    return {"layout": str(layout), "tp": layout.tp, "pp": layout.pp, "gpus": layout.gpus, "batch": batch,
            "micro_batches": m, "tokens_per_s": T / seconds if seconds > 0 else float("inf"),
            "bytes_per_token_per_gpu": moved / T / layout.pp, "slice_bytes": nbytes,
            "device_slots_per_gpu": [s["device_slots"] for s in stages],
            "device_hit_rate": float(np.mean([s["device_hit_rate"] for s in stages])),
            "allreduce_us": 1e6 * mg.allreduce_seconds(batch * hidden * 2, layout.tp),
            "allreduces_per_layer": allreduces_per_layer if layout.tp > 1 else 0.0,
            "steps": int(total_steps or 0), "profile": prof.name, "multi_gpu_source": mg.source,
            "expert_size_source": size["source"]}


def fits_all_resident(*, expert_bytes_total: int, dense_bytes: int, kv_bytes: int, layout: Layout,
                      hbm_bytes: int, usable: float = 0.9) -> "tuple[bool, float]":
    """Whether every expert fits on the layout's GPUs without tiering: each GPU holds 1/N of its stage's
    experts and dense weights (dense split by tensor parallelism, roughly) and its KV; returns (fits,
    bytes per GPU needed / usable HBM)."""
    per_gpu = (expert_bytes_total / layout.pp + dense_bytes / layout.pp + kv_bytes / layout.pp) / layout.tp
    cap = hbm_bytes * usable
    return per_gpu <= cap, per_gpu / cap


__all__ = ["Layout", "MultiGPU", "project", "stage_ranges", "sub_trace", "fits_all_resident"]
