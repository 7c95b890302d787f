"""``tiered-moe plan``: how a store's model fits a node's GPUs - per rank, dense weights, KV cache and recurrent
state for C tokens x B sequences, the expert slots left, host DRAM needed - and which layout to run.

One truth for the device budget: ``device_split`` is what ``load_model`` does with ``--device-budget`` (dense
weights first, then the cache reservation, then expert slots of the rank's slice stride; what is left is
smaller than one slot), and the planner reports exactly that split for each layout. ``--device-budget auto``
asks it for this machine's device (CUDA: the device's memory; otherwise the profile's GPU) at a
``gpu_memory_utilization`` share (vLLM's name for the same knob).

Layouts: every (tensor-parallel N, pipeline stages M) with N x M = the GPUs, N at most a node's GPUs and a
split the model allows (runtime/parallel/shard.py). Pipeline stages hold contiguous MoE-layer ranges
(cache_policy/layout.stage_ranges); a stage's ranks hold that stage's layers, the embeddings on the first
and the head on the last. Projected tokens/s come from cache_policy/layout.py over a routing trace: the
given one, the store's own (``routing-trace.npz`` beside its manifest, as ``generate --trace-out`` writes
it), or a synthetic one of the store's shape (said so in the output).
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass

import torch

from cache_policy import cost_model as cm
from cache_policy.jsonfile import read_json
from cache_policy.layout import Layout, MultiGPU, project, stage_ranges
from cache_policy.replay import ReplayConfig
from cache_policy.synthetic import SyntheticSpec, generate
from cache_policy.traces import load_trace

from .expert_codec import blob_tensor_specs, expert_weight_specs
from .model.config import MoEConfig
from .model.convert import ShippedQuant
# What a model takes on a device: load_model splits a budget by the same sums (importable from here as before).
from .model import compute_dtype_for
from .model.footprint import (GPU_MEMORY_UTILIZATION, cache_bytes, dense_bytes, dense_kept_bytes,  # noqa: F401
                              device_memory, host_budget_auto, host_margin, host_memory_available, stage_tensors)
from .model.layers.dense import resolve_dense_quant
from .model.moe import dense_tensors
from .parallel.shard import Shard, allreduces_per_layer, plan, rank_manifest, shard_dense, stage_layers
from .quant import cost_dtype, get_format
from .store import Manifest
from .store.host_tier import disk_read_rate
from .store.layout import _align

TRACE_NAME = "routing-trace.npz"


@dataclass
class DeviceSplit:
    """One rank's device budget, to the byte: budget = dense + cache + expert_slots x slot_bytes + left."""
    budget: int
    dense: int
    cache: int                 # KV blocks for the context x sequences + per-sequence state (recurrent, rings)
    expert_slots: int
    slot_bytes: int
    left: int                  # less than one slot
    experts_total: int         # expert slices this rank's layers have (all resident when slots >= this)

    @property
    def experts(self) -> int:
        return self.expert_slots * self.slot_bytes

    @property
    def all_resident(self) -> bool:
        return self.expert_slots >= self.experts_total


def device_split(budget: int, dense: int, cache: int, slot_bytes: int, experts_total: int) -> DeviceSplit:
    """What load_model does with a device budget: ValueError when dense + cache leave no room for a slot."""
    room = int(budget) - int(dense) - int(cache)
    if room < slot_bytes:
        raise ValueError(f"device budget {int(budget):,} bytes cannot hold the dense weights ({int(dense):,} bytes) + the "
                         f"cache ({int(cache):,} bytes) + one expert slot ({slot_bytes:,} bytes)")
    slots = min(room // slot_bytes, experts_total)
    return DeviceSplit(int(budget), int(dense), int(cache), int(slots), int(slot_bytes),
                       room - slots * slot_bytes, int(experts_total))


def step_dense_bytes(cfg, dense: dict, dtype, layers: set, first: bool, last: bool) -> int:
    """Bytes of dense weights a rank reads per decode step: its stage's tensors (``dense``: the rank's, e.g. meta
    tensors after shard_dense), less the embedding table, which a step reads a row of per token (unless the
    head is tied to it), and less the hash-routing tables (a row per token)."""
    names = [n for n in stage_tensors(cfg, dense, layers, first, last)
             if not n.endswith("tid2eid") and (n != "model.embed_tokens.weight" or (last and cfg.tie_word_embeddings))]
    return dense_bytes([dense[n] for n in names], dtype)


def dense_shapes(store_dir: str) -> dict:
    """name -> meta tensor of each dense tensor of the store (shapes and dtypes from the file's header)."""
    from safetensors import safe_open
    out = {}
    with safe_open(os.path.join(store_dir, "dense.safetensors"), framework="pt") as f:
        for n in f.keys():
            sl = f.get_slice(n)
            dt = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "I64": torch.int64,
                  "I32": torch.int32, "U8": torch.uint8, "I8": torch.int8, "F8_E4M3": torch.float8_e4m3fn}.get(
                      sl.get_dtype(), torch.float32)
            out[n] = torch.empty(sl.get_shape(), dtype=dt, device="meta")
    return out


@dataclass
class RankPlan:
    layout: str
    tp: int
    pp: int
    stage: int
    layers: list               # model layers of the stage
    split: DeviceSplit
    host_bytes_per_node: int   # one copy of the stage's experts per node, shared by its ranks
    kv_per_rank_per_token: float
    projected_tokens_per_s: "float | None" = None
    device_hit_rate: "float | None" = None
    note: str = ""


def plan_layouts(store_dir: str, *, gpus: int, context: int, batch: int, profile: str = "h200",
                 budget: "int | None" = None, utilization: float = GPU_MEMORY_UTILIZATION,
                 trace=None, policy: str = "lru", expert_format: "str | None" = None) -> dict:
    """Every layout of ``gpus`` GPUs the model can run: each stage's rank plan (rank 0 of each stage: the
    ranks of a stage are alike), the projection, and the recommended layout."""
    if gpus < 1 or context < 1 or batch < 1:
        raise ValueError("--gpus, --context and --batch must be positive")
    if not 0 < utilization <= 1:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {utilization}")
    cfg, m, meta, what = model_shape(store_dir, expert_format)
    prof = cm.load_profile(profile)
    mg = MultiGPU.of(prof)
    budget = int(budget if budget is not None else mg.hbm_bytes * utilization)
    dtype = meta["model.embed_tokens.weight"].dtype
    dtype = dtype if dtype.is_floating_point else torch.bfloat16
    trace, trace_source = _trace_for(store_dir, cfg, m, trace)
    rows, skipped = [], []
    for tp in [d for d in range(1, gpus + 1) if gpus % d == 0 and d <= mg.gpus_per_node]:
        pp = gpus // tp
        try:
            p = plan(cfg, Shard(0, tp))
            rm = m if tp == 1 else rank_manifest(m, Shard(0, tp))
            ranges = stage_ranges(cfg.num_moe_layers, pp)
        except ValueError as e:
            skipped.append({"layout": str(Layout(tp, pp)), "why": str(e)})
            continue
        dense_all = shard_dense(cfg, p, dict(meta)) if tp > 1 else dict(meta)
        stages, step_bytes = [], []
        for s, (a, b) in enumerate(ranges):
            (lo, hi), _ = stage_layers(cfg, pp, s)
            layers = set(range(lo, hi))
            names = stage_tensors(cfg, dense_all, layers, s == 0, s == pp - 1)
            dense = dense_bytes([dense_all[n] for n in names], dtype)
            cache = cache_bytes(p.cfg, dtype, context, batch, layers)
            try:
                split = device_split(budget, dense, cache, rm.blob_stride, (b - a) * m.num_experts)
            except ValueError as e:
                stages = None
                skipped.append({"layout": str(Layout(tp, pp)), "why": f"stage {s}: {e}"})
                break
            step_bytes.append(step_dense_bytes(cfg, dense_all, dtype, layers, s == 0, s == pp - 1))
            stages.append(RankPlan(layout=str(Layout(tp, pp)), tp=tp, pp=pp, stage=s, layers=sorted(layers),
                                   split=split, host_bytes_per_node=(b - a) * m.num_experts * m.blob_stride,
                                   kv_per_rank_per_token=cache_bytes(p.cfg, dtype, 1, 1, layers, snapshots=0)))
        if not stages:
            continue
        slots = min(s.split.expert_slots for s in stages)
        cap = str(max(1, min(slots, (ranges[0][1] - ranges[0][0]) * m.num_experts)))
        rc = ReplayConfig(policy=policy, scope="global", device_capacity=cap, profile=profile,
                          expert_bytes=m.blob_bytes, dtype=_cost_dtype(m))
        try:
            pr = project(trace, rc, batch, Layout(tp, pp), hidden=cfg.hidden_size,
                         allreduces_per_layer=allreduces_per_layer(cfg, tp), dense_bytes=step_bytes)
            for st in stages:
                st.projected_tokens_per_s, st.device_hit_rate = pr["tokens_per_s"], pr["device_hit_rate"]
        except ValueError as e:
            for st in stages:
                st.note = f"not projected: {e}"
        rows.append(stages)
    if not rows:
        raise ValueError(f"no layout of {gpus} GPU(s) runs this model: " + "; ".join(f"{x['layout']}: {x['why']}"
                                                                                    for x in skipped))
    best = max(rows, key=lambda st: (st[0].projected_tokens_per_s or 0.0, -st[0].pp))
    for stages in rows:      # a node holds the stages of its GPUs: one shared copy of their experts each
        per_node = max(1, mg.gpus_per_node // stages[0].tp)
        host = [sum(st.host_bytes_per_node for st in stages[i:i + per_node]) for i in range(0, len(stages), per_node)]
        for i, st in enumerate(stages):
            st.host_bytes_per_node = host[i // per_node]
    return {"model": store_dir, "source": what, "gpus": gpus, "context": context, "batch": batch, "profile": prof.name,
            "budget_per_gpu": budget, "utilization": utilization, "trace": trace_source,
            "layouts": [[_row(st) for st in stages] for stages in rows], "skipped": skipped,
            "recommended": best[0].layout, "multi_gpu_source": mg.source}


def model_shape(model_dir: str, expert_format: "str | None" = None) -> tuple:
    """(config, manifest, dense meta tensors, what): from a converted store, or - before converting or even
    downloading - from a Hugging Face config.json alone (dense shapes from the architecture's tensor table,
    experts in ``expert_format``: default the checkpoint's shipped format, else bf16)."""
    cfg = MoEConfig.from_hf(model_dir)
    if os.path.exists(os.path.join(model_dir, "manifest.json")):
        if expert_format is not None:
            raise ValueError(f"{model_dir} is a converted store: its experts are {Manifest.read(model_dir).expert_format}; "
                             f"drop --expert-format")
        return cfg, Manifest.read(model_dir), dense_shapes(model_dir), "store"
    if expert_format is None:
        raw = read_json(os.path.join(model_dir, "config.json"))
        qc = raw.get("quantization_config")
        if isinstance(qc, dict) and raw.get("expert_dtype") and "expert_dtype" not in qc:
            qc = {**qc, "expert_dtype": raw["expert_dtype"]}     # DeepSeek-V4 ships it at the top level
        sq = ShippedQuant(qc, os.path.join(model_dir, "config.json"))
        expert_format = {None: "bf16", "mxfp4": "mxfp4", "compressed-tensors": "int4",
                         "fp8": "mxfp4" if getattr(sq, "expert_dtype", "fp8") == "fp4" else "fp8_e4m3"}[sq.method]
    weights = expert_weight_specs(cfg.expert_in, cfg.expert_intermediate, get_format(expert_format),
                                  torch.bfloat16 if cfg.expert_bias else None, cfg.gated_experts)
    tensors, nbytes = Manifest.layout(blob_tensor_specs(weights))
    m = Manifest(model=os.path.basename(os.path.abspath(model_dir)), num_layers=cfg.num_moe_layers,
                 num_experts=cfg.num_experts, tensors=tensors, blob_bytes=nbytes, blob_stride=_align(nbytes),
                 checksums=[], layer_numbers=list(cfg.moe_layers), extra={}, weights=weights)
    meta = {n: torch.empty(shape, dtype=torch.int32 if n.endswith("tid2eid") else torch.bfloat16, device="meta")
            for n, shape in dense_tensors(cfg).items()}
    return cfg, m, meta, f"config.json only (experts as {expert_format}, dense weights bf16)"


def _row(st: RankPlan) -> dict:
    d = asdict(st)
    d["split"]["experts"] = st.split.experts
    d["split"]["all_resident"] = st.split.all_resident
    return d


def _cost_dtype(m) -> str:
    return cost_dtype(m.expert_format) or "bf16"


def _trace_for(store_dir: str, cfg, m, trace) -> tuple:
    if trace is not None:
        tr = load_trace(trace) if isinstance(trace, str) else trace
        src = trace if isinstance(trace, str) else "given"
    elif os.path.exists(os.path.join(store_dir, TRACE_NAME)):
        tr, src = load_trace(os.path.join(store_dir, TRACE_NAME)), f"the store's own ({TRACE_NAME})"
    else:
        tr = generate(SyntheticSpec(num_layers=m.num_layers, num_experts=m.num_experts, top_k=cfg.top_k,
                                    num_sequences=16, seq_len=64, seed=0))
        src = ("synthetic (no recorded routing: a Zipf trace of the store's shape; record one with "
               f"'tiered-moe generate --trace-out {os.path.join(store_dir, TRACE_NAME)}')")
    if (tr.num_layers, tr.num_experts) != (m.num_layers, m.num_experts):
        raise ValueError(f"the trace routes {tr.num_layers} layers x {tr.num_experts} experts, the store has "
                         f"{m.num_layers} x {m.num_experts}")
    return tr, src


def plan_cpu(store_dir: str, *, context: int, batch: int, memory: "int | None" = None,
             probe_disk: bool = True, dense_quant: str = "auto") -> dict:
    """A machine without a GPU (``--gpus 0``): one memory. What ``--host-budget auto`` gives the experts
    (load_model's own sum, footprint.host_budget_auto): the memory available (``memory``, else this
    machine's: MemAvailable or a cgroup limit's room) less the dense weights as kept (footprint.dense_kept_bytes:
    bf16 as stored, or ``dense_quant``'s codes), the KV
    cache of ``context`` x ``batch`` and the margin; how many experts that holds and the share left on disk;
    where some stay on disk, the rate the store's files read at as the store reads them (``probe_disk``:
    host_tier.disk_read_rate, about a second) and so the most tokens/s a given MB read per token allows."""
    if context < 1 or batch < 1:
        raise ValueError("--context and --batch must be positive")
    cfg, m = MoEConfig.from_hf(store_dir), Manifest.read(store_dir)
    dense_quant = resolve_dense_quant(dense_quant, m.extra)
    shapes = dense_shapes(store_dir)
    dtype = compute_dtype_for(shapes["model.embed_tokens.weight"].dtype, "cpu")
    dense, cache = dense_kept_bytes(shapes, dtype, dense_quant), cache_bytes(cfg, dtype, context, batch)
    avail, src = (int(memory), "--host-memory") if memory is not None else host_memory_available()
    budget = host_budget_auto(avail, dense, cache)
    total = m.num_layers * m.num_experts
    slots = max(0, min(budget // m.blob_stride, total))
    rate, mode = disk_read_rate(store_dir, m) if probe_disk and slots < total else (None, None)
    return {"model": cfg.model_type, "source": store_dir, "memory": avail, "memory_source": src,
            "dense": dense, "dense_dtype": str(dtype).replace("torch.", ""), "dense_quant": dense_quant, "cache": cache, "context": context,
            "batch": batch, "margin": host_margin(avail), "host_budget": max(0, budget),
            "expert_bytes": m.blob_stride, "experts_total": total, "experts_in_memory": int(slots),
            "on_disk_share": 1 - slots / total, "runs": slots >= cfg.top_k, "disk_read_Bps": rate,
            "disk_read_mode": mode}


def format_plan_cpu(p: dict) -> str:
    mib = 2 ** 20
    lines = [f"plan: {p['model']} ({p['source']}) on this machine's CPU (no GPU: one memory), context "
             f"{p['context']:,} x batch {p['batch']}",
             f"memory available   {p['memory'] / mib:>10,.0f} MiB  ({p['memory_source']})",
             (f"- dense weights    {p['dense'] / mib:>10,.0f} MiB  (as kept: --dense-quant {p['dense_quant']}, other "
              f"tensors {p['dense_dtype']})"),
             f"- KV cache + state {p['cache'] / mib:>10,.0f} MiB",
             f"- margin           {p['margin'] / mib:>10,.0f} MiB  (256 MiB + 10% of what is available)",
             f"= experts          {p['host_budget'] / mib:>10,.0f} MiB  (--host-budget auto): {p['experts_in_memory']:,} "
             f"of {p['experts_total']:,} experts of {p['expert_bytes'] / mib:.2f} MiB in memory, "
             f"{p['on_disk_share']:.0%} read from disk when needed"]
    if p.get("disk_read_Bps"):
        r = p["disk_read_Bps"]
        lines.append(f"disk read rate     {r / 1e6:>10,.0f} MB/s ({p['disk_read_mode']}, whole experts, 4 threads): "
                     f"each MB read per token caps decode at {r / 1e6:,.0f} tok/s")
    if not p["runs"]:
        lines.append("cannot run: the memory left does not hold one layer's top-k experts")
    return "\n".join(lines)


def format_plan(p: dict) -> str:
    gib = 2 ** 30
    out = [f"plan: {p['model']} ({p['source']}) on {p['gpus']} GPU(s) of {p['profile']} "
           f"({p['budget_per_gpu'] / gib:.1f} GiB per GPU at {p['utilization']:.0%}), context {p['context']:,} x batch "
           f"{p['batch']}",
           f"routing: {p['trace']}", "",
           f"{'layout':<9} {'stage':>5} {'dense GiB':>9} {'KV+state GiB':>12} {'expert slots':>12} {'slot MiB':>8} "
           f"{'experts GiB':>11} {'left MiB':>8} {'resident':>8} {'host GiB/node':>13} {'tok/s':>8}"]
    for stages in p["layouts"]:
        for st in stages:
            sp = st["split"]
            tok = st["projected_tokens_per_s"]
            out.append(f"{st['layout']:<9} {st['stage']:>5} {sp['dense'] / gib:>9.2f} {sp['cache'] / gib:>12.2f} "
                       f"{sp['expert_slots']:>12,} {sp['slot_bytes'] / 2**20:>8.2f} {sp['experts'] / gib:>11.2f} "
                       f"{sp['left'] / 2**20:>8.2f} {sp['expert_slots'] / sp['experts_total']:>8.0%} "
                       f"{st['host_bytes_per_node'] / gib:>13.2f} {('%.1f' % tok) if tok else '-':>8}")
    for s in p["skipped"]:
        out.append(f"{s['layout']:<9} cannot run: {s['why']}")
    out += ["", f"recommended: {p['recommended']} (the most projected tokens/s; fewer stages on a tie)"]
    return "\n".join(out)
