"""Experiment 2: Kimi K3 on one H200, by simulation. K3's geometry with MXFP4 experts, the HBM,
host DRAM and disk of one node, and the bandwidths measured on an H200 node; routing from uniform
to strongly local (synthetic traces, K3 geometry); bytes moved and projected tokens/s per regime.

Usage: python bench/exp_k3.py [--quick] [--jobs 2] [--outdir bench/results]
"""
import dataclasses
import json
import math
import os
import sys
import time

import exp_common as ec
from cache_policy import cost_model as cm
from cache_policy.replay import ReplayConfig, replay_batch
from cache_policy.synthetic import GEOMETRIES, SyntheticSpec, generate

GiB = 1 << 30
LEVELS = {"uniform": dict(), "mild": dict(zipf_s=0.5, persistence=0.3, cross_layer=0.2),
          "local": dict(zipf_s=1.0, persistence=0.6, cross_layer=0.5),
          "strong": dict(zipf_s=1.5, persistence=0.9, cross_layer=0.8)}


def k3_mxfp4_blob(hidden: int, inter: int) -> int:
    """Bytes of one K3-shaped MXFP4 expert as the store writes it: a one-expert store (random codes
    and scales; the size does not depend on them), its manifest's blob size. Checked against
    4.25 bits per parameter plus the manifest's 64-byte alignment of each part."""
    import tempfile

    import torch

    from runtime.quant import blob_tensor_specs, expert_weight_specs, get_format
    from runtime.store import Manifest, StoreWriter
    weights = expert_weight_specs(hidden, inter, get_format("mxfp4"))
    with tempfile.TemporaryDirectory(prefix="tiered-moe-k3-") as d:
        w = StoreWriter(d, model="k3-expert", num_layers=1, num_experts=1, weights=weights)
        g = torch.Generator().manual_seed(0)
        w.write(0, 0, {s.name: {p.suffix: torch.randint(0, 255, p.shape, generator=g, dtype=torch.uint8)
                                for p in s.fmt.parts(s.shape)} for s in weights})
        w.close()
        blob = Manifest.read(d).blob_bytes
    want = sum(-(-math.prod(shape) * dt.itemsize // 64) * 64 for _, shape, dt in blob_tensor_specs(weights))
    if blob != want or abs(blob * 8 / (3 * hidden * inter) - 4.25) > 0.01:
        raise SystemExit(f"exp_k3: the store's K3 MXFP4 blob is {blob:,} bytes, expected {want:,} (4.25 bits/param + alignment)")
    return blob


def figures() -> dict:
    """Every number the simulation uses, with where it comes from."""
    anchors = json.load(open(os.path.join(ec.SHARED, "hardware", "h200-anchors.json")))
    L, E, k = GEOMETRIES["kimi-k3"]
    hidden, inter = cm.EXPERT_GEOMETRY["kimi-k3"]
    params = cm.expert_params(hidden, inter)
    blob = k3_mxfp4_blob(hidden, inter)
    total_params = 2.8e12
    dense_params = total_params - L * E * params
    f = {
        "layers": (L, "developers' guide: K3 has 93 layers"),
        "routed_experts": (E, "developers' guide: 896 routed experts (+2 shared, counted in the dense part)"),
        "top_k": (k, "developers' guide: 16 routed experts active per token"),
        "expert_shape": (f"latent {hidden}, intermediate {inter}, SwiGLU",
                         "h200-anchors.json expert_ffn_us.shape (K3-like latent expert); latent 3584 from the guide"),
        "expert_params": (params, "3 x 3584 x 3072"),
        "expert_bytes_mxfp4": (blob, f"a K3-shaped MXFP4 expert written by the store (runtime/quant.py mxfp4: "
                                     f"{blob * 8 / params:.4f} bits/param incl. alignment; h200-anchors.json says "
                                     f"{anchors['expert_bytes']['mxfp4_4.25_bits_per_param']:,} bytes)"),
        "total_params": (total_params, "developers' guide: 2.8T parameters"),
        "non_expert_params": (dense_params, "2.8T minus 93 x 896 routed experts (attention, shared experts, "
                                            "embeddings, latent projections)"),
        "non_expert_bytes": (dense_params * 1.0, "assumption: non-expert weights in FP8 (1 byte per parameter)"),
        "hbm_bytes": (139.8 * GiB, "h200-anchors.json gpu: H200 with 139.8 GiB"),
        "kv_reserve_bytes": (8 * GiB, "assumption: 8 GiB of KV cache (MLA-style compressed cache, batch <= 256, short contexts)"),
        "host_dram_bytes_A": (112 * GiB, "the lent H200 machine's 128 GiB of host memory (device tool README) less 16 GiB for "
                                         "the OS and process"),
        "h2d_GBps_by_MiB": (anchors["host_to_device_GBps_pinned_by_copy_MiB"],
                            "h200-anchors.json host_to_device_GBps_pinned_by_copy_MiB (pinned, 54 GB/s plateau)"),
        "h2d_us_per_mxfp4_expert": (anchors["mxfp4"]["h2d_us_per_K3_expert"], "h200-anchors.json mxfp4.h2d_us_per_K3_expert"),
        "disk_GBps": (anchors["disk"]["read_GBps_O_DIRECT_16MiB"],
                      "h200-anchors.json disk.read_GBps_O_DIRECT_16MiB (the node's virtual disk, not a datacenter NVMe)"),
        "expert_compute_us_by_tokens": (anchors["expert_ffn_us"]["cuda_graph_by_tokens"],
                                        "h200-anchors.json expert_ffn_us.cuda_graph_by_tokens (bf16 compute; MXFP4 "
                                        "dequant assumed fused, see mxfp4.note)"),
    }
    return f


_FIG = None


def _job(j):
    level, batch, scenario, policy, quick = j
    f = _FIG
    seqs = max(2 * batch, 16)
    seq_len = max(6, (512 if quick else 2048) // seqs)
    tr = generate(SyntheticSpec.with_geometry("kimi-k3", num_sequences=seqs, seq_len=seq_len, seed=7, **LEVELS[level]))
    nbytes = f["expert_bytes_mxfp4"][0]
    dev_slots = int((f["hbm_bytes"][0] - f["non_expert_bytes"][0] - f["kv_reserve_bytes"][0]) // nbytes)
    host = None if scenario == "B" else str(int(f["host_dram_bytes_A"][0] // nbytes))
    # dtype mxfp4: the blob's bytes at 4.25 bits/param give the expert's parameters, which scale its
    # compute (without it the 17.5 MB blob read as bf16 is a quarter of the expert).
    cfg = ReplayConfig(policy=policy, device_capacity=str(dev_slots), host_capacity=host, profile="h200",
                       geometry="kimi-k3", expert_bytes=nbytes, dtype="mxfp4")
    r = replay_batch(tr, cfg, batch)
    # Hybrid execution: the cost model computes some host-resident misses on the 16 host cores.
    rh = replay_batch(tr, dataclasses.replace(cfg, cpu_experts="auto"), batch)
    return {"level": level, "batch": batch, "scenario": scenario, "policy": policy, "device_slots": dev_slots,
            "host_slots": None if host is None else int(host), "tokens": tr.num_tokens,
            "hit_device": r["hit_rate"]["device"], "hit_host": r["hit_rate"]["host"],
            "served_from": r["served_from"], "unique_per_layer_step": r["unique_experts_per_layer_step"],
            "h2d_bytes_per_token": r["bytes_per_token"]["host_to_device"],
            "disk_bytes_per_token": r["bytes_per_token"]["disk_to_host"],
            "tokens_per_s": r["projected"]["tokens_per_s_overlap"],
            "tokens_per_s_serial": r["projected"]["tokens_per_s_serial"],
            "tokens_per_s_hybrid": rh["projected"]["tokens_per_s_overlap"],
            "host_share_hybrid": rh["host_compute"]["share"],
            "all_resident_tokens_per_s": r["projected"]["tokens_per_s_all_resident"],
            # Streaming bound: every expert crosses host->device once per step, shared by the batch.
            "stream_all_tokens_per_s": batch / (f["layers"][0] * f["routed_experts"][0] * r["projected"]["h2d_ms_per_expert"] / 1e3)}


def main(argv=None):
    global _FIG
    ap = ec.parser(jobs=True)
    a = ap.parse_args(argv)
    started = time.time()
    _FIG = figures()
    levels = ["uniform", "strong"] if a.quick else list(LEVELS)
    batches = [1, 8] if a.quick else [1, 8, 64, 256]
    scenarios = ["B"] if a.quick else ["A", "B"]
    policies = ["lru"] if a.quick else ["lru", "lfu"]
    jobs = [(lv, b, s, p, a.quick) for s in scenarios for p in policies for lv in levels for b in batches]
    rows = ec.pmap(_job, sorted(jobs, key=lambda j: -j[1]), a.jobs, desc="K3 simulation")
    rep = ec.Report("exp_k3", a.outdir, "python bench/exp_k3.py" + (" --quick" if a.quick else ""),
                    "Experiment 2: Kimi K3 on one H200, by simulation", started)
    f = _FIG
    rep.data.update({"figures": {k: {"value": v, "source": s} for k, (v, s) in f.items()}, "rows": rows})
    rep.add("## Figures used", "")
    rep.table(["figure", "value", "source"], [[k, json.dumps(v) if isinstance(v, dict) else
                                                (f"{v:,.0f}" if isinstance(v, float) and v > 1e6 else v), s]
                                               for k, (v, s) in f.items()])
    r0 = rows[0]
    E_all = f["layers"][0] * f["routed_experts"][0]
    rep.add(f"Device tier: {r0['device_slots']:,} experts ({r0['device_slots'] / E_all:.1%} of {E_all:,}) = HBM - "
            f"non-expert weights - KV reserve. Scenario A: host DRAM holds "
            f"{int(f['host_dram_bytes_A'][0] // f['expert_bytes_mxfp4'][0]):,} experts, the rest is read from disk. "
            f"Scenario B: host DRAM holds every expert ({E_all * f['expert_bytes_mxfp4'][0] / 1e12:.2f} TB of MXFP4 "
            f"experts: a node with >= 2 TB of DRAM). Routing: synthetic traces of K3's geometry (cache_policy/"
            f"synthetic.py), locality levels {json.dumps(LEVELS)}. Projection: the cost model of cache_policy/cost_model.py "
            f"(transfers overlapped with compute, attention and dense parts not modelled: an upper bound on tokens/s).", "")
    rep.add("Hybrid: `--cpu-experts auto` - per expert per step the cost model computes a host-resident miss on the "
            "16 host cores (0.8 ms per token for this expert, h200-anchors.json cpu_expert_ffn_us_16_threads, bf16; "
            "not measured for MXFP4, scaled by parameters: optimistic for the host) instead of moving it (0.33 ms).", "")
    rep.add("Stream-everything tokens/s: batch / (time to move all 83,328 experts host->device once), the rate of "
            "a runtime that streams every layer's experts each step - what the cache converges to once a step "
            "touches most experts.", "")
    for s in scenarios:
        for p in policies:
            rep.add(f"## Scenario {s}, policy {p}", "")
            rep.table(["locality", "batch", "device hit", "host hit", "unique experts/layer/step", "h2d MB/token",
                       "disk MB/token", "tokens/s", "tokens/s hybrid", "on host (hybrid)", "stream-everything tokens/s",
                       "all resident tokens/s", "ratio"],
                      [[r["level"], r["batch"], r["hit_device"], r["hit_host"], r["unique_per_layer_step"],
                        r["h2d_bytes_per_token"] / 1e6, r["disk_bytes_per_token"] / 1e6, r["tokens_per_s"],
                        r["tokens_per_s_hybrid"], r["host_share_hybrid"],
                        r["stream_all_tokens_per_s"], r["all_resident_tokens_per_s"], r["tokens_per_s"] / r["all_resident_tokens_per_s"]]
                       for lv in levels for b in batches for r in rows
                       if (r["scenario"], r["policy"], r["level"], r["batch"]) == (s, p, lv, b)])
    plt = ec.pyplot()
    fig, axes = plt.subplots(1, len(scenarios), figsize=(5.5 * len(scenarios), 4), squeeze=False)
    for ax, s in zip(axes[0], scenarios):
        for i, lv in enumerate(levels):
            pts = [max((r for r in rows if (r["scenario"], r["level"], r["batch"]) == (s, lv, b)),
                       key=lambda r: r["tokens_per_s"]) for b in batches]
            ax.plot(batches, [r["tokens_per_s"] for r in pts], "-o", ms=3, color=plt.cm.plasma(i / len(levels)), label=lv)
        ax.plot(batches, [pts[j]["all_resident_tokens_per_s"] for j in range(len(batches))], "k--", lw=1,
                label="all experts resident (compute only)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch")
        ax.set_ylabel("projected tokens/s")
        ax.plot(batches, [pts[j]["stream_all_tokens_per_s"] for j in range(len(batches))], "k:", lw=1,
                label="stream every expert once per step")
        ax.set_title(f"K3 on one H200, scenario {s} (best of {', '.join(policies)})", fontsize=9)
        ax.legend(fontsize=7)
    return rep.finish(fig, "K3 projected tokens/s by batch and locality")


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
