"""Low-batch vs high-batch, measured on a live model: the regime comparison.

For each policy (and prefetcher) and batch size: decode many sequences with the engine, one token
per sequence per step (so the recorded trace replays to exactly the live hits), and report
unique experts per layer, hit rate per tier, bytes per token, measured tokens/s, and tokens/s
projected on a hardware profile by replaying the recorded routing through the cost model - with
the experts moved to the device, and with hybrid execution (``--cpu-experts auto``: the cost
model computes some misses on the host CPU instead; the share it computes there is reported).
"""
from __future__ import annotations

import dataclasses
import json
import os
import time

import torch

from cache_policy.layout import Layout, project
from cache_policy.replay import ReplayConfig, replay_batch

from .config import RuntimeConfig
from .engine import Engine, SamplingParams
from .model import load_model
from .model.config import MoEConfig
from .parallel.group import Group
from .parallel.shard import Shard, allreduces_per_layer, plan as shard_plan, rank_manifest, shard_dense, stage_layers
from .plan import dense_shapes, step_dense_bytes
from .quant import cost_dtype
from .store import Manifest


def _live_run(store_dir: str, m: Manifest, slots: int, *, batch: int, policy: str, prefetch: str, requests: int,
              prompt_len: int, max_tokens: int, seed: int, cache_bonus: float, schedule: str, tensor_parallel: int,
              pipeline_parallel: int) -> tuple:
    """The live engine on ``slots`` device slots (per rank, of its stage, under parallelism) ->
    (summary, trace, host-to-device bytes per rank or None, wall seconds)."""
    group = None
    if tensor_parallel * pipeline_parallel > 1:
        stride = rank_manifest(m, Shard(0, tensor_parallel)).blob_stride if tensor_parallel > 1 else m.blob_stride
        stage = max(1, int(round(slots / pipeline_parallel)))
        cfg = RuntimeConfig(model=store_dir, expert_budget=stage * stride, policy=policy, scope="global",
                            max_batch=batch, prefill_chunk=1, prefetch=prefetch, cache_bonus=cache_bonus,
                            schedule=schedule, tensor_parallel=tensor_parallel, pipeline_parallel=pipeline_parallel)
        group = Group(cfg)
        model, store = group.load()
    else:
        model, store = load_model(store_dir, expert_budget=slots * m.blob_stride, policy=policy, scope="global")
    try:
        eng = group.make_engine(model, store) if group is not None else \
            Engine(model, store, max_batch=batch, prefill_chunk=1, prefetch=prefetch, cache_bonus=cache_bonus,
                   schedule=schedule)
        g = torch.Generator().manual_seed(seed)
        V = model.cfg.vocab_size
        for i in range(max(requests, batch)):
            eng.add_request(torch.randint(0, V, (prompt_len,), generator=g).tolist(),
                            SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed * 100003 + i,
                                           ignore_eos=True))
        t0 = time.perf_counter()
        eng.run()
        wall = time.perf_counter() - t0
        s = eng.summary()
        tr = eng.trace()
        per_rank = [x["bytes"]["host_to_device"] for x in eng.gather("snapshot")] if group is not None else None
    finally:
        store.close()
        if group is not None:
            group.close()
    return s, tr, per_rank, wall


def _layout_projection(store_dir: str, tr, cfg: ReplayConfig, fraction: float, batch: int, tensor_parallel: int,
                       pipeline_parallel: int, per_rank: list) -> dict:
    """The recorded routing projected onto the parallel layout: per GPU the same ``fraction`` of its stage's
    experts, as slices (what the live ranks held)."""
    mc = MoEConfig.from_hf(store_dir)
    # dense weights one rank reads per step (rank 0: it also holds what does not divide), per stage
    meta = dense_shapes(store_dir)
    dense = shard_dense(mc, shard_plan(mc, Shard(0, tensor_parallel)), dict(meta)) if tensor_parallel > 1 \
        else dict(meta)
    dt = meta["model.embed_tokens.weight"].dtype
    step = []
    for st in range(pipeline_parallel):
        (lo, hi), _ = stage_layers(mc, pipeline_parallel, st)
        step.append(step_dense_bytes(mc, dense, dt, set(range(lo, hi)), st == 0, st == pipeline_parallel - 1))
    lay = project(tr, dataclasses.replace(cfg, device_capacity=repr(fraction)), batch,
                  Layout(tensor_parallel, pipeline_parallel), hidden=mc.hidden_size,
                  allreduces_per_layer=allreduces_per_layer(mc, tensor_parallel), dense_bytes=step)
    return {"layout": lay["layout"], "tokens_per_s": lay["tokens_per_s"],
            "MB_per_token_per_gpu": lay["bytes_per_token_per_gpu"] / 1e6,
            "measured_h2d_bytes_per_token_per_rank": [b / max(1, tr.num_tokens) for b in per_rank]}


def run_one(store_dir: str, *, batch: int, policy: str, prefetch: str, device_fraction: float, requests: int,
            prompt_len: int, max_tokens: int, profile: str, geometry: "str | None", seed: int,
            cache_bonus: float = 0.0, schedule: str = "fcfs", dtype: "str | None" = None,
            expert_budget_bytes: "int | None" = None, tensor_parallel: int = 1, pipeline_parallel: int = 1) -> dict:
    """``dtype``: the projection's expert dtype with ``geometry`` (default bf16; without a geometry the
    store's own format and blob bytes);
    ``expert_budget_bytes``: the device tier in bytes instead of ``device_fraction`` of the experts.
    ``tensor_parallel`` / ``pipeline_parallel``: run the live part on a group of ranks (runtime/parallel:
    ``device_fraction`` is then per rank, in slices, of its stage's experts) and project that layout too."""
    m = Manifest.read(store_dir)
    total = m.num_layers * m.num_experts
    slots = max(1, int(round(device_fraction * total))) if expert_budget_bytes is None else \
        max(1, min(total, expert_budget_bytes // m.blob_stride))
    s, tr, per_rank, wall = _live_run(store_dir, m, slots, batch=batch, policy=policy, prefetch=prefetch,
                                      requests=requests, prompt_len=prompt_len, max_tokens=max_tokens, seed=seed,
                                      cache_bonus=cache_bonus, schedule=schedule, tensor_parallel=tensor_parallel,
                                      pipeline_parallel=pipeline_parallel)
    # The projection replays the recorded routing with the same policy and (where replay has it)
    # the same prefetcher; lookahead needs hidden states, so its projection counts demand loads only.
    cfg = ReplayConfig(policy=policy, prefetch=prefetch if prefetch in ("freq", "transition") else "none",
                       scope="global", device_capacity=str(slots),
                       profile=profile, geometry=geometry, expert_bytes=None if geometry else m.blob_bytes,
                       dtype=dtype or ("bf16" if geometry else (cost_dtype(m.expert_format) or "fp32")))
    r = replay_batch(tr, cfg, batch)
    rh = replay_batch(tr, dataclasses.replace(cfg, cpu_experts="auto"), batch)
    need = sum(s["hits"].values())
    layout = None if per_rank is None else _layout_projection(store_dir, tr, cfg, slots / total, batch, tensor_parallel,
                                                              pipeline_parallel, per_rank)
    return {
        "batch": batch, "policy": policy, "prefetch": prefetch, "device_fraction": slots / total, "device_slots": slots,
        "requests": max(requests, batch), "generated_tokens": s["generated_tokens"], "wall_seconds": wall,
        "measured_tokens_per_s": s["generated_tokens"] / wall,
        "hit_rate": {"device": s["hits"]["device"] / need, "host": 1.0 if need == s["hits"]["device"] else
                     s["hits"]["host"] / (need - s["hits"]["device"])},
        "replayed_device_hits_equal_live": r["hits"]["device"] == s["hits"]["device"] if prefetch == "none" else None,
        "unique_experts_per_layer_step": r["unique_experts_per_layer_step"],
        "bytes_per_token": {"host_to_device": s["bytes"]["host_to_device"] / max(1, tr.num_tokens)},
        "stall_seconds": s["stall_seconds"], "prefetch_precision": s["prefetch"]["precision"],
        "prefetch_recall": s["prefetch"]["recall"],
        "projected": {"profile": r["profile"], "expert_bytes": r["expert_bytes"], "source": r["expert_size_source"],
                      "tokens_per_s": r["projected"]["tokens_per_s_overlap"],
                      "tokens_per_s_all_resident": r["projected"]["tokens_per_s_all_resident"],
                      "tokens_per_s_hybrid": rh["projected"]["tokens_per_s_overlap"],
                      "host_share_hybrid": rh["host_compute"]["share"],
                      "h2d_MB_per_token_hybrid": rh["bytes_per_token"]["host_to_device"] / 1e6,
                      "note": "replay of the recorded routing through the cost model"},
        "device_is_stand_in": s["device_is_stand_in"],
        "layout": layout,
    }


def format_rows(rows: list) -> str:
    head = ["batch", "policy", "prefetch", "dev %", "uniq/layer", "dev hit", "MB/tok h2d", "stall s", "tok/s measured",
            "tok/s projected", "projected hybrid", "on host", "projected resident"]
    if any(r.get("layout") for r in rows):
        head += ["layout", "projected layout", "MB/tok/rank measured"]
    out = [head]
    for r in rows:
        out.append([str(r["batch"]), r["policy"], r["prefetch"], f"{100 * r['device_fraction']:.0f}",
                    f"{r['unique_experts_per_layer_step']:.1f}", f"{r['hit_rate']['device']:.3f}",
                    f"{r['bytes_per_token']['host_to_device'] / 1e6:.2f}", f"{r['stall_seconds']:.2f}",
                    f"{r['measured_tokens_per_s']:.1f}", f"{r['projected']['tokens_per_s']:.1f}",
                    f"{r['projected']['tokens_per_s_hybrid']:.1f}", f"{r['projected']['host_share_hybrid']:.2f}",
                    f"{r['projected']['tokens_per_s_all_resident']:.1f}"]
                   + ([r["layout"]["layout"], f"{r['layout']['tokens_per_s']:.1f}",
                       "/".join(f"{b / 1e6:.2f}" for b in r["layout"]["measured_h2d_bytes_per_token_per_rank"])]
                      if r.get("layout") else []))
    w = [max(len(x[i]) for x in out) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w[i]) if i >= 3 or i == 0 else c.ljust(w[i]) for i, c in enumerate(row)) for row in out]
    lines.insert(1, "  ".join("-" * x for x in w))
    return "\n".join(lines)


def plot(rows: list, path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(2, 2, figsize=(11, 7.5))
    keys = sorted({(r["policy"], r["prefetch"]) for r in rows})
    panels = [("unique experts per layer per step", lambda r: r["unique_experts_per_layer_step"]),
              ("device hit rate", lambda r: r["hit_rate"]["device"]),
              ("host->device MB per token", lambda r: r["bytes_per_token"]["host_to_device"] / 1e6),
              ("tokens/s projected (solid) and measured (dashed)", lambda r: r["projected"]["tokens_per_s"])]
    for a, (name, f) in zip(ax.flat, panels):
        for k in keys:
            sel = sorted((r for r in rows if (r["policy"], r["prefetch"]) == k), key=lambda r: r["batch"])
            xs = [r["batch"] for r in sel]
            line, = a.plot(xs, [f(r) for r in sel], marker="o", label=f"{k[0]}+{k[1]}" if k[1] != "none" else k[0])
            if name.startswith("tokens/s"):
                a.plot(xs, [r["measured_tokens_per_s"] for r in sel], ls="--", color=line.get_color())
        a.set_xscale("log", base=2)
        a.set_xlabel("batch (concurrent sequences)")
        a.set_title(name, fontsize=10)
        if name.startswith("tokens/s"):
            a.set_yscale("log")
        a.grid(alpha=0.3)
    ax[0, 0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_regimes(store_dir: str, *, batches, configs, device_fraction: float, requests: int, prompt_len: int,
                max_tokens: int, profile: str = "h200", geometry: "str | None" = None, seed: int = 0,
                out_prefix: "str | None" = None, progress: bool = False, cache_bonus: float = 0.0,
                tensor_parallel: int = 1, pipeline_parallel: int = 1) -> list:
    rows = []
    jobs = [(p, pf, b) for p, pf in configs for b in batches]
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(jobs), desc="regimes", unit="run")
    for p, pf, b in jobs:
        rows.append(run_one(store_dir, batch=b, policy=p, prefetch=pf, device_fraction=device_fraction,
                            requests=requests, prompt_len=prompt_len, max_tokens=max_tokens, profile=profile,
                            geometry=geometry, seed=seed, cache_bonus=cache_bonus, tensor_parallel=tensor_parallel,
                            pipeline_parallel=pipeline_parallel))
        if bar:
            bar.update()
    if bar:
        bar.close()
    if out_prefix:
        os.makedirs(os.path.dirname(os.path.abspath(out_prefix)), exist_ok=True)
        with open(out_prefix + ".json", "w") as f:
            json.dump(rows, f, indent=1)
        plot(rows, out_prefix + ".png", f"{os.path.basename(os.path.abspath(store_dir))}: device tier "
                                         f"{device_fraction:.0%} of experts; projections on {profile}")
    return rows
