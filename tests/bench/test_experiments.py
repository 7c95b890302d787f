"""Each experiment's --quick mode, checked against what must hold (formulas, bounds, oracles)."""
import json
import os
import sys

import numpy as np
import pytest

from helpers import ROOT

sys.path.insert(0, os.path.join(ROOT, "bench"))


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    return tmp_path_factory.mktemp("experiments")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("expmodel"))


def _files(out, name):
    for suffix in (".md", ".json", ".png"):
        assert (out / f"{name}{suffix}").stat().st_size > 0
    return json.loads((out / f"{name}.json").read_text())


@pytest.mark.slow
def test_regimes_quick(out):
    import exp_regimes
    exp_regimes.main(["--quick", "--jobs", "1", "--outdir", str(out)])
    d = _files(out, "exp_regimes")
    rows = d["rows"]
    for r in rows:
        assert 0 <= r["hit_device"] <= 1 and r["effective_batch"] <= r["batch"] + 1e-9
        # Belady (MIN) is the bound of every demand-only policy at the same point.
        if r["policy"] != "belady" and r["prefetch"] == "none":
            bel = next(x for x in rows if x["policy"] == "belady" and
                       (x["trace"], x["capacity"], x["batch"]) == (r["trace"], r["capacity"], r["batch"]))
            assert r["hit_device"] <= bel["hit_device"] + 1e-12
    # Batch 1: one token, top-k experts per layer per step.
    assert all(r["unique_per_layer_step"] == 6 for r in rows if r["batch"] == 1)
    assert set(d["tiering_stops_paying_batch"]) == {"deepseek-v2-lite", "flame-moe-290m", "synthetic-local"}


@pytest.mark.slow
def test_k3_quick(out):
    import exp_k3
    exp_k3.main(["--quick", "--jobs", "1", "--outdir", str(out)])
    d = _files(out, "exp_k3")
    f = {k: v["value"] for k, v in d["figures"].items()}
    assert f["expert_params"] == 3 * 3584 * 3072
    for r in d["rows"]:
        if r["batch"] == 1:
            # Demand only, host holds all: every device miss of the 93 x 16 experts a token needs moves one blob.
            want = (1 - r["hit_device"]) * 93 * 16 * f["expert_bytes_mxfp4"]
            assert r["h2d_bytes_per_token"] == pytest.approx(want, rel=1e-9)
        assert r["tokens_per_s"] <= r["all_resident_tokens_per_s"] * (1 + 1e-9)
        assert 0 <= r["host_share_hybrid"] <= 1
    uni = next(r for r in d["rows"] if r["level"] == "uniform" and r["batch"] == 1)
    # Batch 1, uniform routing: the link is the bottleneck and 16 host cores take part of the misses.
    assert uni["host_share_hybrid"] > 0 and uni["tokens_per_s_hybrid"] > uni["tokens_per_s"]
    strong = next(r for r in d["rows"] if r["level"] == "strong" and r["batch"] == 1)
    assert strong["hit_device"] > uni["hit_device"]
    # Uniform routing over 896 experts with 6.4% of them resident: about that hit rate.
    assert uni["hit_device"] == pytest.approx(uni["device_slots"] / (93 * 896), abs=0.03)


def test_deepseek_v4_quick(out):
    import deepseek_v4
    deepseek_v4.main(["--quick", "--jobs", "1", "--outdir", str(out)])
    d = _files(out, "deepseek_v4")
    kinds = d["layer_kinds"]
    assert len(kinds) == 43 and kinds[:2] == ["hca", "hca"]
    # bf16, by hand: per token a 512 entry / 4 + the indexer's 128 / 4 in CSA layers, 512 / 128 in HCA layers;
    # per sequence a 128-row ring of 512 per layer and the compressors' open windows (kv and gate rows).
    csa, hca = kinds.count("csa"), kinds.count("hca")
    per_tok = csa * (512 + 128) * 2 / 4 + hca * 512 * 2 / 128
    fixed = 43 * 128 * 512 * 2 + hca * 2 * 128 * 512 * 2 + csa * (2 * 4 * 1024 + 2 * 4 * 512) * 2 \
        + csa * (2 * 4 * 256 + 2 * 4 * 128) * 2
    for r in d["cache_rows"]:
        assert r["v4_bytes"] == r["tokens"] * per_tok + fixed
        assert r["mla_bytes"] == r["tokens"] * 43 * (512 + 64) * 2      # the all-MLA twin
    assert d["expert_bytes_mxfp4"] >= 3 * 4096 * 2048 * 4.25 / 8
    for r in d["projection"]:
        assert r["tokens_per_s"] <= r["all_resident_tokens_per_s"] * (1 + 1e-9)
        if not r["hybrid"]:            # the cost model sends a miss to the host only where it pays
            h = next(x for x in d["projection"] if x["hybrid"] and (x["level"], x["batch"], x["device_fraction"]) ==
                     (r["level"], r["batch"], r["device_fraction"]))
            assert h["tokens_per_s"] >= r["tokens_per_s"] * 0.97


def test_locality_quick(out):
    import exp_locality
    exp_locality.main(["--quick", "--jobs", "1", "--outdir", str(out)])
    d = _files(out, "exp_locality")
    rows = d["rows"]
    uni = [r for r in rows if r["zipf_s"] == 0 and r["persistence"] == 0]
    # Uniform routing: unique experts per layer per step = E(1 - (1 - k/E)^B) (64 tokens, 6 of 64).
    assert np.mean([r["unique_per_layer_step"] for r in uni]) == pytest.approx(64 * (1 - (1 - 6 / 64) ** 64), rel=0.03)
    skewed = [r for r in rows if r["zipf_s"] == 3.0 and r["persistence"] == 0]
    assert min(r["hit_device"] for r in skewed) > max(r["hit_device"] for r in uni)


@pytest.mark.slow
def test_cache_routing_quick(out, workdir):
    import exp_cache_routing
    exp_cache_routing.main(["--quick", "--outdir", str(out), "--workdir", workdir])
    rows = _files(out, "exp_cache_routing")["rows"]
    base = rows[0]
    assert base["delta"] == 0 and base["kl_mean"] == 0 and base["greedy_agreement"] == 1
    assert base["reference_argmax_match"] == 1.0   # teacher forcing reproduces the greedy text
    assert rows[1]["hit_device"] >= base["hit_device"] and rows[1]["kl_mean"] >= 0


@pytest.mark.slow
def test_batching_quick(out, workdir):
    import exp_batching
    exp_batching.main(["--quick", "--outdir", str(out), "--workdir", workdir])
    d = _files(out, "exp_batching")
    assert d["outputs_identical"]
    f, e = d["rows"]
    assert (f["schedule"], e["schedule"]) == ("fcfs", "expert-aware")
    assert e["unique_per_layer_full_steps"] <= f["unique_per_layer_full_steps"]


@pytest.mark.slow
def test_prediction_quick(out, workdir):
    import exp_common as ec
    import exp_prediction
    exp_prediction.main(["--quick", "--outdir", str(out), "--workdir", workdir])
    d = _files(out, "exp_prediction")
    rows = {r["prefetcher"]: r for r in d["rows"]}
    # Brute-force oracle for the static baseline: the 6 most used experts per layer in the fit
    # prompts, scored against every (token, layer >= 1) of the held-out prompts.
    ds = ec.shared_trace("deepseek-v2-lite-train.npz")
    train = ec.subset(ds, sequences=40, max_len=16)
    cut = int(0.8 * ds.num_sequences)
    test = ec.subset(ds, start=cut, sequences=10, max_len=16)
    hits = 0
    for l in range(1, ds.num_layers):
        counts = {}
        for e in train.ids[:, l].reshape(-1).tolist():
            counts[e] = counts.get(e, 0) + 1
        top = set(sorted(counts, key=lambda e: (-counts[e], e))[:6])
        hits += sum(len(top & set(row.tolist())) for row in test.ids[:, l])
    want = hits / (test.num_tokens * (ds.num_layers - 1) * 6)
    assert rows["popularity (fitted)"]["precision"] == pytest.approx(want)
    assert rows["transition (fitted)"]["precision"] > 6 / 64
    assert {r["prefetcher"] for r in d["live"]} == {"freq", "transition", "lookahead"}


def test_runner_lists_every_experiment():
    import run_experiments
    names = {n for n, _ in run_experiments.EXPERIMENTS}
    scripts = {f[:-3] for f in os.listdir(os.path.join(ROOT, "bench")) if f.startswith("exp_") and f.endswith(".py")}
    assert names == scripts - {"exp_common", "exp_live_common"}


@pytest.mark.slow
@pytest.mark.parametrize("model", ["moe", "k3"])
def test_prefix_cache_quick(out, tmp_path, model):
    """A live server with and without prefix caching on a shared system prompt: the same texts, and the
    prefill computed drops by what the cache served (prompt tokens - hits, from /metrics). k3: a KDA + MLA
    hybrid, whose recurrent state comes back from the prefix cache's snapshots."""
    import prefix_cache
    prefix_cache.main(["--quick", "--repeats", "1", "--outdir", str(out), "--workdir", str(tmp_path),
                       "--model", model])
    d = _files(out, "prefix_cache" + ("_k3" if model == "k3" else ""))
    assert d["same_texts"]
    off, on = d["off"], d["on"]
    assert off["prefix_hits"] == 0 and off["prefill_computed"] == off["prompt_tokens"] == on["prompt_tokens"]
    # 8 requests share the system prompt: all but the first find its whole blocks cached (a hybrid: all but the
    # first two, at worst - the second files the state where the shared blocks end)
    block = 16
    shared = d["system_prompt_tokens"] // block * block
    assert on["prefix_hits"] >= (7 if model == "moe" else 6) * (shared - block)
    assert on["prefill_computed"] == on["prompt_tokens"] - on["prefix_hits"]


def _quick(out, name):
    """Run experiment ``name`` in its --quick mode into ``out``; its JSON."""
    import importlib
    importlib.import_module(name).main(["--quick", "--jobs", "1", "--outdir", str(out)])
    return _files(out, name)


@pytest.mark.slow
def test_speculation_quick(out):
    rows = _quick(out, "exp_speculation")["rows"]
    for r in rows:
        assert r["steps"] == sum(r["k_histogram"]) and r["accepted"] <= r["drafted"]
        if r["variant"] == "none":      # no speculation: one token per request and step, top-k experts at batch 1
            assert r["mean_k"] == 0 and r["drafted"] == 0
            if r["batch"] == 1:
                assert r["experts_per_layer_per_step"] == (16 if r["model"] == "kimi-k3" else
                                                           8 if r["model"] == "deepseek-v3" else 6)
    # Batch 1 on the V3 and K3 shapes: the cost rule never projects fewer tokens/s than no speculation.
    for m in ("deepseek-v3", "kimi-k3"):
        for acc in (0.5, 0.85):
            got = {r["variant"]: r["tokens_per_s"] for r in rows
                   if (r["model"], r["batch"], r["acceptance"]) == (m, 1, acc)}
            assert got["cost k<=4"] >= got["none"] and got["cost k<=4 other"] >= got["none"]
