"""DeepSeek-V4-Flash at its real shape, from the code that runs it: (1) the sequence cache its layers
declare (runtime/model/layers/v4_attention.py ``CompressedCacheSpec``: a 128-token K=V window per layer,
one compressed entry per 4 tokens in CSA layers with the indexer's key, one per 128 in HCA layers, the
compressors' open windows) against an all-MLA twin (every layer DeepSeek-V3's MLA cache: a 512 latent +
64 rotary key per token), at 4k / 32k / 128k / 1M tokens; (2) projected decode tokens/s on the h200
profile at batch 1 / 8 / 64 with 10% / 25% of the routed experts in HBM (MXFP4, as V4-Flash ships them),
with and without ``--cpu-experts auto``.

The model config is V4-Flash's as transformers 5.24's ``DeepseekV4Config`` defaults describe it (hidden 4096,
43 layers, 64 heads of 512, rotary 64, window 128, CSA rate 4 / HCA rate 128, indexer 64 x 128, 256 experts
top-6 of width 2048, 3 hash-routed layers, hc_mult 4) read through ``MoEConfig.from_dict``; its layer kinds
are that class's default schedule (two HCA layers, then CSA / HCA alternating) - the released
config.json's own ``compress_ratios`` may differ, and the cache figures move with it.

Routing for the projection: synthetic traces of V4-Flash's geometry (cache_policy/synthetic.py, two
locality levels); the first three layers of the real model are hash-routed (their experts known from the
token, exactly predictable), which the synthetic traces do not model: a lower bound for those layers.

Usage: python bench/deepseek_v4.py [--quick] [--outdir bench/results]
"""
import dataclasses
import sys
import time

import exp_common as ec
import torch

from cache_policy.replay import ReplayConfig, replay_batch
from cache_policy.synthetic import SyntheticSpec, generate
from exp_k3 import k3_mxfp4_blob

FLASH = dict(model_type="deepseek_v4", vocab_size=129280, hidden_size=4096, num_hidden_layers=43,
             num_attention_heads=64, num_key_value_heads=1, head_dim=512, q_lora_rank=1024, o_groups=8,
             o_lora_rank=1024, n_routed_experts=256, num_experts_per_tok=6, moe_intermediate_size=2048,
             index_n_heads=64, index_head_dim=128, index_topk=512, sliding_window=128, num_hash_layers=3,
             hc_mult=4, partial_rotary_factor=0.125, max_position_embeddings=1048576)
TOKENS = (4096, 32768, 131072, 1048576)
LEVELS = {"uniform": dict(), "local": dict(zipf_s=1.0, persistence=0.6, cross_layer=0.5)}
GiB = 1 << 30


def caches() -> tuple:
    """(rows, V4 config, twin config): bytes per sequence of V4-Flash and of its all-MLA twin (bf16)."""
    from runtime.model.config import MoEConfig
    from runtime.model.layers.kinds import kv_bytes_per_token, state_bytes_per_sequence
    v4 = MoEConfig.from_dict(dict(FLASH))
    # The twin: the same 43 layers with DeepSeek-V3's MLA (kv_lora_rank 512, rotary 64, one cached "head" per token).
    twin = dataclasses.replace(v4, model_type="deepseek_v3", attention="mla", kv_lora_rank=512, qk_rope_head_dim=64,
                               qk_nope_head_dim=128, v_head_dim=128, q_lora_rank=1536, hc_mult=0, v4_kinds=[],
                               compress_rates={}, hash_layers=[], router="sigmoid_group")
    rows = []
    for dt in (torch.bfloat16,):
        per_tok, per_seq = kv_bytes_per_token(v4, dt), state_bytes_per_sequence(v4, dt)
        t_tok = kv_bytes_per_token(twin, dt)
        for n in TOKENS:
            rows.append({"tokens": n, "v4_bytes": n * per_tok + per_seq, "v4_per_token": per_tok, "v4_fixed": per_seq,
                         "mla_bytes": n * t_tok, "mla_per_token": t_tok})
    return rows, v4, twin


_BLOB = None


def _job(j):
    level, batch, frac, hybrid, quick = j
    seqs = max(2 * batch, 16)
    seq_len = max(6, (256 if quick else 1024) // seqs)
    tr = generate(SyntheticSpec.with_geometry("deepseek-v4-flash", num_sequences=seqs, seq_len=seq_len, seed=11,
                                              **LEVELS[level]))
    L, E = tr.num_layers, tr.num_experts
    cfg = ReplayConfig(policy="reuse", device_capacity=str(int(frac * L * E)), profile="h200",
                       geometry="deepseek-v4-flash", expert_bytes=_BLOB, dtype="mxfp4",
                       cpu_experts="auto" if hybrid else "0")
    r = replay_batch(tr, cfg, batch)
    return {"level": level, "batch": batch, "device_fraction": frac, "hybrid": hybrid, "tokens": tr.num_tokens,
            "hit_device": r["hit_rate"]["device"], "h2d_bytes_per_token": r["bytes_per_token"]["host_to_device"],
            "tokens_per_s": r["projected"]["tokens_per_s_overlap"],
            "all_resident_tokens_per_s": r["projected"]["tokens_per_s_all_resident"],
            "host_share": r["host_compute"]["share"] if hybrid else 0.0}


def main(argv=None):
    global _BLOB
    ap = ec.parser(jobs=True)
    a = ap.parse_args(argv)
    started = time.time()
    rows, v4, twin = caches()
    _BLOB = k3_mxfp4_blob(v4.hidden_size, v4.expert_intermediate)
    batches = [1, 8] if a.quick else [1, 8, 64]
    levels = ["uniform"] if a.quick else list(LEVELS)
    jobs = [(lv, b, f, h, a.quick) for lv in levels for b in batches for f in (0.10, 0.25) for h in (False, True)]
    proj = ec.pmap(_job, sorted(jobs, key=lambda j: -j[1]), a.jobs, desc="V4-Flash projection")
    rep = ec.Report("deepseek_v4", a.outdir, "python bench/deepseek_v4.py" + (" --quick" if a.quick else ""),
                    "DeepSeek-V4-Flash: sequence cache and projected decode on one H200", started)
    kinds = {k: v4.v4_kinds.count(k) for k in ("sliding", "csa", "hca")}
    rep.data.update({"config": FLASH, "layer_kinds": v4.v4_kinds, "cache_rows": rows, "projection": proj,
                     "expert_bytes_mxfp4": _BLOB})
    rep.add("## The sequence cache, from the layers' cache specs (bf16)", "")
    rep.add(f"V4-Flash: {v4.num_layers} layers - {kinds['hca']} HCA (an entry per {v4.compress_rates['hca']} tokens), "
            f"{kinds['csa']} CSA (an entry per {v4.compress_rates['csa']} tokens + the indexer's "
            f"{v4.index_head_dim}-wide key), {kinds['sliding']} sliding-only; every layer a ring of its last "
            f"{v4.sliding_window} K=V rows of {v4.head_dim}. Per sequence: {rows[0]['v4_fixed']:,} B fixed (rings and "
            f"the compressors' open windows) + {rows[0]['v4_per_token']:,.0f} B per token. The all-MLA twin (the same "
            f"{v4.num_layers} layers as DeepSeek-V3's MLA: {twin.kv_lora_rank} + {twin.qk_rope_head_dim} per token per "
            f"layer): {rows[0]['mla_per_token']:,} B per token.", "")
    rep.table(["context tokens", "V4-Flash bytes / sequence", "all-MLA twin bytes / sequence", "V4 / MLA",
               "sequences of this length in 32 GiB: V4", "MLA"],
              [[f"{r['tokens']:,}", f"{r['v4_bytes']:,.0f}", f"{r['mla_bytes']:,}", r["v4_bytes"] / r["mla_bytes"],
                int(32 * GiB // r["v4_bytes"]), int(32 * GiB // r["mla_bytes"])] for r in rows])
    rep.add("", "## Projected decode tokens/s on the h200 profile (MXFP4 experts, the default reuse policy)", "")
    rep.add(f"One MXFP4 expert of V4-Flash: {_BLOB:,} bytes as the store writes it (3 x 4096 x 2048 at 4.25 bits/param "
            f"+ alignment). Device tier: 10% / 25% of the {v4.num_moe_layers * v4.num_experts:,} routed experts "
            f"({0.10 * v4.num_moe_layers * v4.num_experts * _BLOB / 1e9:.0f} / "
            f"{0.25 * v4.num_moe_layers * v4.num_experts * _BLOB / 1e9:.0f} GB of HBM); the host holds every expert. "
            "Hybrid: `--cpu-experts auto` computes a miss on the host's 16 cores where the cost model says that "
            "beats moving it. Projection: cache_policy/cost_model.py (transfers overlapped with expert compute; "
            "attention and dense parts not modelled: an upper bound).", "")
    rep.table(["routing", "batch", "device tier", "hybrid", "device hit", "h2d MB/token", "tokens/s",
               "on host", "all resident tokens/s"],
              [[r["level"], r["batch"], f"{r['device_fraction']:.0%}", "auto" if r["hybrid"] else "0", r["hit_device"],
                r["h2d_bytes_per_token"] / 1e6, r["tokens_per_s"], r["host_share"], r["all_resident_tokens_per_s"]]
               for lv in levels for b in batches for f in (0.10, 0.25) for h in (False, True) for r in proj
               if (r["level"], r["batch"], r["device_fraction"], r["hybrid"]) == (lv, b, f, h)])
    plt = ec.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    ax = axes[0]
    ax.plot([r["tokens"] for r in rows], [r["v4_bytes"] / GiB for r in rows], "-o", label="V4-Flash (cache specs)")
    ax.plot([r["tokens"] for r in rows], [r["mla_bytes"] / GiB for r in rows], "-s", label="all-MLA twin")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context tokens")
    ax.set_ylabel("GiB per sequence (bf16)")
    ax.set_title("sequence cache", fontsize=9)
    ax.legend(fontsize=8)
    ax = axes[1]
    for i, (f, h) in enumerate([(0.10, False), (0.10, True), (0.25, False), (0.25, True)]):
        pts = [next(r for r in proj if (r["level"], r["batch"], r["device_fraction"], r["hybrid"]) == (levels[-1], b, f, h))
               for b in batches]
        ax.plot(batches, [r["tokens_per_s"] for r in pts], "-o", ms=3, color=plt.cm.viridis(i / 4),
                label=f"{f:.0%} on device{', cpu-experts auto' if h else ''}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch")
    ax.set_ylabel("projected tokens/s")
    ax.set_title(f"V4-Flash on one H200, {levels[-1]} routing", fontsize=9)
    ax.legend(fontsize=7)
    return rep.finish(fig, "V4-Flash: cache bytes per sequence and projected decode tokens/s")


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
