"""Tensor parallelism: measured here (gloo ranks on this CPU) and projected on H200 nodes.

Measured (--measure, on the realistic-shape checkpoints bench/vs_llama_cpp.py builds: Qwen3-MoE, hidden 512,
8 layers, 32 experts top-4, as bf16 and MXFP4 stores): the same prompts decoded by one process and by a
group of 2 ranks (runtime/parallel), interleaved, best of 3, a device tier of 25% of the experts (per rank,
in slices), so experts really move. Reported: the bytes each rank moves per token against one process's
(goal: 1/N within 2%), CPU decode tokens/s at TP 2 vs 1 (this machine has 2 cores: no speed goal), and
that the tokens are the same.

Projected (cache_policy/layout.py, the h200 profile and its multi_gpu section): a K3-shaped MXFP4 model and
DeepSeek-V4-Flash (MXFP4 routed experts) on 1 / 2 / 4 / 8 GPUs of one node at batch 1 / 8 / 64, with
tiering (25% of the experts resident per GPU, as slices) and without it (every expert resident, where the
GPUs' memory holds them: runtime/plan.py's split says whether), over synthetic routing with locality.
Goal: at batch 1, 8 GPUs project >= 6x the tokens/s of one. Also: the all-reduce latency at which that goal
would break, and the same with GPUs sharing host links in pairs (4 links for 8 GPUs).

Usage: python bench/tensor_parallel.py [--quick] [--measure] [--workdir DIR]
"""
import dataclasses
import json
import os
import sys
import time

import exp_common as ec

from cache_policy import cost_model as cm
from cache_policy.layout import Layout, project
from cache_policy.replay import ReplayConfig
from cache_policy.synthetic import SyntheticSpec, generate
from runtime.model.config import MoEConfig
from runtime.parallel.shard import allreduces_per_layer

LEVEL = dict(zipf_s=1.0, persistence=0.6, cross_layer=0.5)      # exp_k3.py's "local" routing
GPUS = (1, 2, 4, 8)
BATCHES = (1, 8, 64)
SHAPES = {"K3 MXFP4": ("kimi-k3", "k3"), "DeepSeek-V4-Flash": ("deepseek-v4-flash", "v4flash")}


def shape_dirs(root: str) -> dict:
    """config.json of each shape (runtime/plan.py plans a model from its config alone)."""
    from runtime.model.synthetic import K3_FULL, k3_config
    sys.path.insert(0, ec.HERE)
    from deepseek_v4 import FLASH
    out = {}
    for name, (_, d) in SHAPES.items():
        path = os.path.join(root, d)
        os.makedirs(path, exist_ok=True)
        if d == "k3":
            cfg = k3_config(K3_FULL)
        else:   # as V4-Flash ships: FP8 dense weights with E8M0 scales, FP4 routed experts
            cfg = dict(FLASH, quantization_config={"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                                                   "scale_fmt": "ue8m0"}, expert_dtype="fp4")
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(cfg, f)
        out[name] = path
    return out


CONTEXT = 8192


def hbm_split(model_dir: str, gpus: int, batch: int) -> "dict | None":
    """runtime/plan.py's split of 90% of an H200 for TP = gpus at CONTEXT tokens x batch: expert slots per GPU
    and whether every expert is resident; None where dense weights + KV do not fit at all."""
    from runtime.plan import plan_layouts
    try:
        p = plan_layouts(model_dir, gpus=gpus, context=CONTEXT, batch=batch, expert_format="mxfp4")
    except ValueError:
        return None
    row = next((s[0] for s in p["layouts"] if s[0]["layout"] == f"TP{gpus}"), None)
    if row is None:
        return None
    sp = row["split"]
    return {"slots": sp["expert_slots"], "experts_total": sp["experts_total"], "all_resident": sp["all_resident"],
            "dense_GiB": sp["dense"] / 2 ** 30, "cache_GiB": sp["cache"] / 2 ** 30}


def step_bytes(model_dir: str, gpus: int) -> int:
    """Dense bytes one rank of TP = gpus reads per decode step (runtime/plan.py step_dense_bytes): what it
    splits as a slice, what it replicates whole."""
    import torch
    from runtime.parallel.shard import Shard, plan, shard_dense
    from runtime.plan import model_shape, step_dense_bytes
    cfg, _, meta, _ = model_shape(model_dir, "mxfp4")
    dense = shard_dense(cfg, plan(cfg, Shard(0, gpus)), dict(meta)) if gpus > 1 else dict(meta)
    return step_dense_bytes(cfg, dense, torch.bfloat16, set(range(cfg.num_layers)), True, True)


def project_shapes(quick: bool, workdir: str) -> dict:
    from tqdm import tqdm
    dirs = shape_dirs(os.path.join(workdir, "shapes"))
    seqs, seq_len = (16, 16) if quick else (128, 32)
    out = {}
    jobs = [(n, g, b) for n in SHAPES for b in BATCHES for g in GPUS]
    bar = tqdm(total=len(jobs), desc="projections", unit="cell", file=sys.stderr)
    for name, (geo, _) in SHAPES.items():
        tr = generate(SyntheticSpec.with_geometry(geo, num_sequences=seqs, seq_len=seq_len, seed=7, **LEVEL))
        hidden = cm.MODEL_HIDDEN[geo]
        mc = MoEConfig.from_hf(dirs[name])
        dense = {g: step_bytes(dirs[name], g) for g in GPUS}

        def proj(cap: str, b: int, g: int) -> dict:
            return project(tr, ReplayConfig(policy="lru", device_capacity=cap, geometry=geo, dtype="mxfp4"), b,
                           Layout(tp=g), hidden=hidden, allreduces_per_layer=allreduces_per_layer(mc, g),
                           dense_bytes=dense[g])
        rows = []
        for b in BATCHES:
            for g in GPUS:
                tier = proj("0.25", b, g)
                h = hbm_split(dirs[name], g, b)
                hbm = proj(str(max(1, min(h["slots"], h["experts_total"]))), b, g) if h else None
                res = proj("1.0", b, g)["tokens_per_s"] if h and h["all_resident"] else None
                rows.append({"batch": b, "gpus": g, "tiered_tokens_per_s": tier["tokens_per_s"],
                             "device_hit_rate": tier["device_hit_rate"],
                             "MB_per_token_per_gpu": tier["bytes_per_token_per_gpu"] / 1e6,
                             "hbm": None if h is None else {**h, "resident_share": h["slots"] / h["experts_total"],
                                                            "tokens_per_s": hbm["tokens_per_s"],
                                                            "device_hit_rate": hbm["device_hit_rate"]},
                             "all_resident_tokens_per_s": res})
                bar.update()
        out[name] = {"geometry": geo, "hidden": hidden, "rows": rows, "trace": tr.source,
                     "allreduces_per_layer_tp8": allreduces_per_layer(mc, 8),
                     "dense_GiB_read_per_step_per_gpu": {g: dense[g] / 2 ** 30 for g in GPUS}}
    bar.close()
    return out


def sensitivity(quick: bool, workdir: str) -> dict:
    """Batch 1, K3: TP8 / TP1 with the profile's numbers, with 4 host links, and the all-reduce latency at
    which the ratio falls below 6."""
    seqs, seq_len = (8, 16) if quick else (32, 32)
    tr = generate(SyntheticSpec.with_geometry("kimi-k3", num_sequences=seqs, seq_len=seq_len, seed=7, **LEVEL))
    prof = cm.load_profile("h200")
    base = ReplayConfig(policy="lru", device_capacity="0.25", geometry="kimi-k3", dtype="mxfp4")
    from runtime.model.synthetic import K3_FULL, k3_config
    k3 = MoEConfig.from_dict(k3_config(K3_FULL))
    arl = allreduces_per_layer(k3, 8)
    k3dir = shape_dirs(os.path.join(workdir, "shapes"))["K3 MXFP4"]
    d1, d8 = step_bytes(k3dir, 1), step_bytes(k3dir, 8)
    one = project(tr, base, 1, Layout(tp=1), hidden=7168, dense_bytes=d1)["tokens_per_s"]

    def ratio(**mg):
        raw = json.loads(json.dumps(prof.raw))
        raw["multi_gpu"].update({k: v for k, v in mg.items() if k == "host_links"})
        raw["multi_gpu"]["interconnect"].update({k: v for k, v in mg.items() if k != "host_links"})
        path = os.path.join(ec.HERE, "results", ".tp-profile.json")
        with open(path, "w") as f:
            json.dump(raw, f)
        try:
            cfg = dataclasses.replace(base, profile=path)
            return project(tr, cfg, 1, Layout(tp=8), hidden=7168, allreduces_per_layer=arl,
                           dense_bytes=d8)["tokens_per_s"] / one
        finally:
            os.remove(path)
    out = {"profile": ratio(), "host_links_4": ratio(host_links=4)}
    lat = [20, 50, 100, 200, 400, 800]
    out["by_allreduce_latency_us"] = {x: ratio(allreduce_latency_us=float(x)) for x in lat}
    return out


# -- measured on this CPU -------------------------------------------------------------------------------------
def measure(workdir: str, quick: bool) -> dict:
    """TP 1 and 2 on the mid checkpoint (bf16 and MXFP4 stores), interleaved, best of 3."""
    from runtime.config import RuntimeConfig
    from runtime.engine import SamplingParams
    from runtime.parallel.group import open_group
    from runtime.parallel.shard import Shard, rank_manifest
    from runtime.store import Manifest
    paths = {"bf16": os.path.join(workdir, "mid-store-bf16"), "mxfp4": os.path.join(workdir, "mid-store-mxfp4")}
    for p in paths.values():
        if not os.path.exists(os.path.join(p, "manifest.json")):
            raise SystemExit(f"{p} is missing: run python bench/vs_llama_cpp.py --workdir {workdir} first")
    tokens = 8 if quick else 32
    prompts = [[3, 17, 5, 9, 11, 2, 40, 7], [8, 1, 6, 12], [99, 98, 97], [5, 5, 5, 5, 5]]
    out = {}
    for fmt, store in paths.items():
        m = Manifest.read(store)
        slots = m.num_layers * m.num_experts // 4
        rows = {}
        for batch in (1, 4):
            ps = prompts[:batch]
            best = {1: None, 2: None}
            group = None
            try:
                for rep in range(1 if quick else 3):
                    for tp in (1, 2):
                        stride = m.blob_stride if tp == 1 else rank_manifest(m, Shard(0, 2)).blob_stride
                        cfg = RuntimeConfig(model=store, max_batch=batch, expert_budget=slots * stride, policy="lru",
                                            tensor_parallel=tp, threads=None if tp > 1 else 1)
                        if tp == 1:
                            model, st = cfg.load()
                            eng = cfg.engine(model, st)
                        else:
                            group, model, st = open_group(group, cfg)
                            eng = group.make_engine(model, st)
                        ids = [eng.add_request(p, SamplingParams(max_tokens=tokens, ignore_eos=True)) for p in ps]
                        t0 = time.perf_counter()
                        eng.run()
                        wall = time.perf_counter() - t0
                        s = eng.summary()
                        moved = [x["bytes"]["host_to_device"] for x in eng.gather("snapshot")] if tp > 1 else \
                            [st.snapshot()["bytes"]["host_to_device"]]
                        gen = s["generated_tokens"]
                        r = {"decode_tokens_per_s": s["decode_tokens_per_s"], "tokens_per_s": gen / wall,
                             "bytes_per_token_per_rank": [b / gen for b in moved],
                             "outputs": [eng.done[i].output for i in ids]}
                        st.close()
                        if best[tp] is None or r["decode_tokens_per_s"] > best[tp]["decode_tokens_per_s"]:
                            best[tp] = r
            finally:
                if group is not None:
                    group.close()
            one, two = best[1], best[2]
            rows[batch] = {"tp1": one, "tp2": two, "same_tokens": one["outputs"] == two["outputs"],
                           "bytes_ratio_per_rank": [b / one["bytes_per_token_per_rank"][0]
                                                    for b in two["bytes_per_token_per_rank"]],
                           "decode_speed_ratio": two["decode_tokens_per_s"] / one["decode_tokens_per_s"]}
        out[fmt] = {"store": store, "device_slots": slots, "rows": rows}
    return out


def plot(proj: dict, path_fig):
    plt = ec.pyplot()
    fig, axes = plt.subplots(1, len(proj), figsize=(12, 4.6))
    for ax, (name, d) in zip(axes, proj.items()):
        for b, color in zip(BATCHES, ("C0", "C1", "C2")):
            rows = [r for r in d["rows"] if r["batch"] == b]
            ax.plot([r["gpus"] for r in rows], [r["tiered_tokens_per_s"] for r in rows], "o-", color=color,
                    label=f"batch {b}, 25% resident per GPU")
            res = [(r["gpus"], r["all_resident_tokens_per_s"]) for r in rows if r["all_resident_tokens_per_s"]]
            if res:
                ax.plot(*zip(*res), "s--", color=color, label=f"batch {b}, all resident (where it fits)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(GPUS)
        ax.set_xticklabels([str(g) for g in GPUS])
        ax.set_xlabel("GPUs (tensor-parallel ranks, one H200 node)")
        ax.set_ylabel("projected tokens/s")
        ax.set_title(name, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Projected decode tokens/s by GPUs (h200 profile, cache_policy/layout.py)", fontsize=10)
    return fig


def main() -> None:
    ap = ec.parser()
    ap.add_argument("--measure", action="store_true", help="also measure TP 1 vs 2 on this CPU (needs the stores of "
                                                            "bench/vs_llama_cpp.py in --workdir)")
    ap.add_argument("--workdir", default=os.path.expanduser("~/.cache/tiered-moe/bench"))
    a = ap.parse_args()
    cmd = "python bench/tensor_parallel.py" + (" --quick" if a.quick else "") + (" --measure" if a.measure else "") + \
        (f" --workdir {a.workdir}" if a.workdir != os.path.expanduser("~/.cache/tiered-moe/bench") else "")
    rep = ec.Report("tensor_parallel", a.outdir, cmd, "Tensor parallelism: measured on this CPU, projected on H200 nodes")
    if a.measure:
        meas = measure(a.workdir, a.quick)
        rep.data["measured"] = meas
        rep.add("## Measured here: one process vs two gloo ranks", "",
                "Same prompts, greedy, a device tier of 25% of the experts per rank (slices under TP 2), LRU; "
                "interleaved, best of 3 by decode tokens/s. Bytes per rank are each rank's host->device bytes per "
                "generated token.", "")
        rows = []
        for fmt, d in meas.items():
            for b, r in d["rows"].items():
                rows.append([fmt, b, r["tp1"]["bytes_per_token_per_rank"][0] / 1e6,
                             " / ".join(f"{x / 1e6:.3f}" for x in r["tp2"]["bytes_per_token_per_rank"]),
                             " / ".join(f"{x:.4f}" for x in r["bytes_ratio_per_rank"]),
                             r["tp1"]["decode_tokens_per_s"], r["tp2"]["decode_tokens_per_s"], r["decode_speed_ratio"],
                             "yes" if r["same_tokens"] else "NO"])
        rep.table(["store", "batch", "TP1 MB/token", "TP2 MB/token per rank", "ratio per rank (goal 0.5 +- 2%)",
                   "TP1 decode tok/s", "TP2 decode tok/s", "TP2 / TP1", "same tokens"], rows)
    proj = project_shapes(a.quick, a.workdir)
    sens = sensitivity(a.quick, a.workdir)
    rep.data.update({"projected": proj, "sensitivity": sens})
    rep.add("## Projected on one H200 node", "",
            "Tensor-parallel ranks each hold their slice of every expert. Three capacities: '25%/GPU' keeps a "
            "quarter of the experts (as slices) resident on each GPU whatever its memory (the goal's setting); "
            f"'HBM' keeps what runtime/plan.py's split of 90% of an H200 leaves after the rank's dense weights and "
            f"the KV cache and state for {CONTEXT:,} tokens x the batch (bf16); 'without tiering' every expert, "
            "where that split holds them all. Synthetic routing with locality (zipf 1.0, persistence 0.6, "
            "cross-layer 0.5), LRU. Each step also reads the rank's dense weights at the measured HBM rate "
            "(4215 GB/s; attention over the cache is not charged).", "")
    for name, d in proj.items():
        rep.add(f"### {name}", "", "Dense weights read per step per GPU (GiB; split ones as slices, replicated ones "
                "whole: embeddings' rows aside): " + ", ".join(f"{g} GPU{'s' if g > 1 else ''} {v:.1f}" for g, v in
                                                              d["dense_GiB_read_per_step_per_gpu"].items()) + ".", "")
        base = {b: next(r["tiered_tokens_per_s"] for r in d["rows"] if r["batch"] == b and r["gpus"] == 1)
                for b in BATCHES}
        rep.table(["batch", "GPUs", "25%/GPU tok/s", "x 1 GPU", "device hit", "MB/token/GPU",
                   "HBM: resident", "HBM: tok/s", "without tiering tok/s"],
                  [[r["batch"], r["gpus"], r["tiered_tokens_per_s"], r["tiered_tokens_per_s"] / base[r["batch"]],
                    r["device_hit_rate"], r["MB_per_token_per_gpu"],
                    f"{r['hbm']['resident_share']:.1%}" if r["hbm"] else "dense + KV do not fit",
                    r["hbm"]["tokens_per_s"] if r["hbm"] else "-",
                    r["all_resident_tokens_per_s"] if r["all_resident_tokens_per_s"] else "does not fit"]
                   for r in d["rows"]])
    k3 = proj["K3 MXFP4"]["rows"]
    r8 = next(r["tiered_tokens_per_s"] for r in k3 if r["batch"] == 1 and r["gpus"] == 8)
    r1 = next(r["tiered_tokens_per_s"] for r in k3 if r["batch"] == 1 and r["gpus"] == 1)
    v4 = proj["DeepSeek-V4-Flash"]["rows"]
    v8 = next(r["tiered_tokens_per_s"] for r in v4 if r["batch"] == 1 and r["gpus"] == 8)
    v1 = next(r["tiered_tokens_per_s"] for r in v4 if r["batch"] == 1 and r["gpus"] == 1)
    rep.add("## Goal: 8 GPUs >= 6x one at batch 1, 25% resident per GPU", "",
            f"K3 MXFP4: {r8 / r1:.2f}x ({'met' if r8 / r1 >= 6 else 'NOT met'}); DeepSeek-V4-Flash: {v8 / v1:.2f}x "
            f"({'met' if v8 / v1 >= 6 else 'NOT met'}).", "",
            f"Sensitivity (K3, batch 1, TP8 / TP1): with the profile's figures {sens['profile']:.2f}x; with GPUs "
            f"sharing host links in pairs (4 links) {sens['host_links_4']:.2f}x; by all-reduce latency: "
            + ", ".join(f"{k} us -> {v:.2f}x" for k, v in sens["by_allreduce_latency_us"].items()) + ".", "",
            "The multi-GPU figures are not measured here (one GPU's anchors only): see the h200 profile's "
            "multi_gpu section for their sources.", "")
    from runtime.plan import format_plan, plan_layouts
    dirs = shape_dirs(os.path.join(a.workdir, "shapes"))
    rep.add("## tiered-moe plan for the two shapes (8 GPUs, 8,192 tokens x 8 sequences)", "")
    rep.data["plans"] = {}
    for name, d in dirs.items():
        p = plan_layouts(d, gpus=8, context=CONTEXT, batch=8, expert_format="mxfp4")
        rep.data["plans"][name] = p
        rep.add(f"`tiered-moe plan --model {d} --expert-format mxfp4 --gpus 8 --context {CONTEXT} --batch 8`", "",
                "```", format_plan(p), "```", "")
    rep.finish(plot(proj, None), "projected tokens/s by GPUs")


if __name__ == "__main__":
    main()
