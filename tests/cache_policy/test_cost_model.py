import json
import os

import numpy as np
import pytest

from cache_policy import cost_model as cm
from helpers import SHARED
from cache_policy.replay import ReplayConfig, replay_batch
from cache_policy.traces import Trace


def test_expert_bytes_match_the_h200_anchors():
    with open(os.path.join(SHARED, "hardware", "h200-anchors.json")) as f:
        anchors = json.load(f)
    p = cm.expert_params(3584, 3072)
    assert cm.expert_bytes(p, "bf16") == anchors["expert_bytes"]["bf16"]
    assert cm.expert_bytes(p, "mxfp4") == anchors["expert_bytes"]["mxfp4_4.25_bits_per_param"]
    assert cm.expert_bytes(p, "fp8") == p


def test_h200_profile_is_the_anchor_data():
    prof = cm.load_profile("h200")
    assert prof.h2d_GBps(66 * 2**20) == pytest.approx(54.4)
    assert prof.h2d_GBps(17 * 2**20) == pytest.approx(52.3)
    assert prof.compute_seconds(1, prof.reference_params) == pytest.approx(26.6e-6)
    # one K3 bf16 expert: ~1.2 ms to move (the guide's figure)
    assert prof.h2d_seconds(66060288) * 1e3 == pytest.approx(1.2, abs=0.05)


def test_profile_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown hardware profile 'tpu'; shipped: .*h200"):
        cm.load_profile("tpu")
    bad = tmp_path / "p.json"
    bad.write_text('{"disk_to_host_GBps": 1}')
    with pytest.raises(ValueError, match="lacks host_to_device_GBps_by_copy_MiB"):
        cm.load_profile(str(bad))
    bad.write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        cm.load_profile(str(bad))
    with pytest.raises(ValueError, match="does not exist"):
        cm.load_profile(str(tmp_path / "none.json"))


def test_step_time_formula_by_hand(tmp_path):
    prof_path = tmp_path / "flat.json"
    prof_path.write_text(json.dumps({
        "name": "flat", "host_to_device_GBps_by_copy_MiB": {"1": 1.0}, "disk_to_host_GBps": 0.5,
        "expert_compute_us_by_tokens": {"1": 100.0}, "reference_expert": {"params": 1000}}))
    # One sequence of 2 tokens, 1 layer, top-2 of 4 experts: step 0 loads {0,1}; step 1 needs {1,2}.
    tr = Trace(ids=np.array([[[0, 1]], [[1, 2]]]), seq_offsets=np.array([0, 2]), num_experts=4)
    r = replay_batch(tr, ReplayConfig(policy="lru", scope="global", device_capacity="2", profile=str(prof_path),
                                      expert_bytes=1_000_000, dtype="fp8"), 1)
    copy = 1e6 / 1e9                      # 1 ms per copy at 1 GB/s
    comp = 100e-6 * (1e6 / 1000)          # params scale: 1e6 params (fp8) / 1000 ref -> 0.1 s per expert
    serial = [2 * copy + 2 * comp, 1 * copy + 2 * comp]
    overlap = [max(2 * comp, 2 * copy + comp), max(2 * comp, copy + comp)]
    assert r["hits"]["device"] == 1
    assert r["projected"]["step_ms_serial"] == pytest.approx(np.mean(serial) * 1e3)
    assert r["projected"]["step_ms_overlap"] == pytest.approx(np.mean(overlap) * 1e3)
    assert r["projected"]["tokens_per_s_serial"] == pytest.approx(2 / sum(serial))
    assert r["bytes_per_token"]["host_to_device"] == pytest.approx(3 * 1e6 / 2)


def test_prefetch_stall_by_hand(tmp_path):
    """Two layers, one step: layer 0 computes 5 ms with 2 ms of demand copies, so the link idles 3 ms; layer 1's
    4 ms prefetch, issued when layer 0 routes, stalls 1 ms; issued after layer 0's combine, all 4 ms."""
    prof_path = tmp_path / "flat.json"
    prof_path.write_text(json.dumps({
        "name": "flat", "host_to_device_GBps_by_copy_MiB": {"1": 1.0}, "disk_to_host_GBps": 0.5,
        "expert_compute_us_by_tokens": {"1": 100.0}, "reference_expert": {"params": 1000}}))
    prof = cm.load_profile(str(prof_path))
    a = lambda *x: np.array(x, dtype=np.float64)
    t = cm.project_step_times(profile=prof, params=1000, nbytes=1_000_000, num_layers=2, compute_s=a(5e-3, 1e-3),
                              demand_h2d=a(2, 0), demand_disk=a(0, 0), pref_h2d=a(0, 4), pref_disk=a(0, 0))
    assert t["stall"] == pytest.approx([1e-3]) and t["stall_after_combine"] == pytest.approx([4e-3])
    assert t["overlap"] == pytest.approx([1e-3 + 5e-3 + 1e-3])


@pytest.mark.slow
def test_shipped_cpu_profile_loads_and_is_used_by_replay(flame_trace):
    prof = cm.load_profile("cpu")
    assert prof.disk_GBps > 0 and prof.h2d_GBps(17 * 2**20) > 0
    r = replay_batch(flame_trace, ReplayConfig(profile="cpu", device_capacity="0.2"), 1)
    assert r["profile"] == "cpu" and r["projected_tokens_per_s"] > 0


def _flat_profile(tmp_path, **extra):
    p = tmp_path / "hyb.json"
    p.write_text(json.dumps({
        "name": "hyb", "host_to_device_GBps_by_copy_MiB": {"1": 1.0}, "disk_to_host_GBps": 0.5,
        "expert_compute_us_by_tokens": {"1": 100.0, "8": 300.0}, "reference_expert": {"params": 1000}, **extra}))
    return str(p)


def _brute_force_split(cost, hit_counts, miss_counts):
    """Every subset of the misses on the host: the best layer time (written from the docstring's model)."""
    import itertools
    dev, host = cost.tables(max(list(hit_counts) + list(miss_counts)))
    best = None
    for r in range(len(miss_counts) + 1):
        for sub in itertools.combinations(range(len(miss_counts)), r):
            c = sum(dev[n] for n in hit_counts) + sum(dev[n] for i, n in enumerate(miss_counts) if i not in sub)
            h = sum(host[miss_counts[i]] for i in sub)
            moved = len(miss_counts) - r
            D = moved * cost.t_link
            d = max(c, D + cost.c_min) if moved else c
            t = max(d, h) if cost.concurrent else d + h
            best = t if best is None else min(best, t)
    return best


@pytest.mark.parametrize("concurrent", [True, False])
def test_hybrid_split_is_the_brute_force_optimum(tmp_path, concurrent):
    rng = np.random.default_rng(0)
    prof = cm.load_profile(_flat_profile(tmp_path, host_expert_compute_us_by_tokens={"1": 900.0, "8": 1500.0},
                                         host_concurrent=concurrent))
    cost = cm.HybridCost(prof, params=1000, nbytes=1_000_000)    # 1 ms to move, 0.1 ms on the device, 0.9 on the host
    for _ in range(60):
        hits = [1] * int(rng.integers(0, 4))
        m = int(rng.integers(1, 8))
        for misses in ([1] * m, rng.integers(1, 9, m).tolist()):
            sel = cost.split(hits, misses)
            dev, host = cost.tables(8)
            moved = [n for i, n in enumerate(misses) if i not in sel]
            c = sum(dev[n] for n in hits + moved)
            t = cost.layer_seconds(c, len(moved), sum(host[misses[i]] for i in sel))
            opt = _brute_force_split(cost, hits, misses)
            all_dev = cost.layer_seconds(sum(dev[n] for n in hits + misses), len(misses), 0.0)
            all_host = cost.layer_seconds(sum(dev[n] for n in hits), 0, sum(host[n] for n in misses))
            assert t <= min(all_dev, all_host) * (1 + 1e-9)
            if len(set(misses)) == 1:       # equal token counts (batch 1): the exact optimum
                assert t == pytest.approx(opt)
            else:                           # mixed counts: a ranking's best prefix, close to it
                assert t <= opt * 1.5
    # Batch 1 on the H200 anchors: 1.22 ms to move a K3 bf16 expert, 0.8 ms on 16 host cores ->
    # of 6 misses the host takes 4: max(2 x 1.22 + 0.03, 4 x 0.81) = 3.23 ms beats 3 on the host
    # (3 x 1.22 + 0.03 = 3.68 ms) and 5 (5 x 0.81 = 4.04 ms).
    h200 = cm.HybridCost(cm.load_profile("h200"), cm.expert_params(3584, 3072), 66060288)
    assert len(h200.split([], [1] * 6)) == 4
    # MXFP4 moves in 0.33 ms: moving wins for most of them.
    mx = cm.HybridCost(cm.load_profile("h200"), cm.expert_params(3584, 3072), 17547264)
    assert len(mx.split([], [1] * 6)) <= 2


def test_hybrid_projection_by_hand(tmp_path):
    # CPU-like profile (host = device curve, not concurrent): moving costs the copy and saves nothing,
    # so every miss is computed from host memory and a step is the compute of its experts.
    prof = _flat_profile(tmp_path)
    tr = Trace(ids=np.array([[[0, 1]], [[1, 2]]]), seq_offsets=np.array([0, 2]), num_experts=4)
    r = replay_batch(tr, ReplayConfig(policy="lru", scope="global", device_capacity="2", profile=prof,
                                      expert_bytes=1_000_000, dtype="fp8", cpu_experts="auto"), 1)
    comp = 100e-6 * (1e6 / 1000)
    assert r["host_compute"]["experts"] == 4 and r["host_compute"]["share"] == 1.0
    assert r["bytes_per_token"]["host_to_device"] == 0 and r["hits"]["device"] == 0
    assert r["projected"]["step_ms_overlap"] == pytest.approx(2 * comp * 1e3)
    # The same with a concurrent host 9x slower than the device and a 1 ms link: step 0 needs {0, 1},
    # both missing; best split: one moved (max(1 ms + 0.1 s, ...)) vs host 0.9 s each ...
    prof2 = _flat_profile(tmp_path, host_expert_compute_us_by_tokens={"1": 900.0}, host_concurrent=True)
    r2 = replay_batch(tr, ReplayConfig(policy="lru", scope="global", device_capacity="2", profile=prof2,
                                       expert_bytes=1_000_000, dtype="fp8", cpu_experts="auto"), 1)
    # ... moving both (1 ms + 2 x 0.1 s device compute) beats any host share (0.9 s): nothing on the host.
    assert r2["host_compute"]["experts"] == 0
    r3 = replay_batch(tr, ReplayConfig(policy="lru", scope="global", device_capacity="2", profile=prof2,
                                       expert_bytes=1_000_000, dtype="fp8"), 1)
    assert r2["projected"]["step_ms_overlap"] == pytest.approx(r3["projected"]["step_ms_overlap"])


def test_cpu_experts_parse_and_errors():
    from cache_policy.keys import CpuExperts
    assert CpuExperts.parse("auto").auto and CpuExperts.parse("3").layers == 3 and not CpuExperts.parse("0").enabled
    with pytest.raises(ValueError, match="neither 'auto' nor a number"):
        CpuExperts.parse("half")
    with pytest.raises(ValueError, match="has 4 MoE layers"):
        CpuExperts.parse("5", num_layers=4)
    tr = Trace(ids=np.array([[[0, 1]], [[1, 2]]]), seq_offsets=np.array([0, 2]), num_experts=4)
    with pytest.raises(ValueError, match="--cpu-experts 2: the trace has 1 MoE layers"):
        replay_batch(tr, ReplayConfig(device_capacity="2", cpu_experts="2"), 1)
