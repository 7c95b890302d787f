"""Layout projections (cache_policy/layout.py) against the step-time formula worked by hand."""
import json

import numpy as np
import pytest

from cache_policy.layout import Layout, MultiGPU, project, stage_ranges
from cache_policy.replay import ReplayConfig
from cache_policy.traces import Trace
from cache_policy import cost_model as cm


@pytest.fixture
def flat(tmp_path):
    """A profile with round numbers: a flat 1 GB/s link, 100 us per reference expert at any token count,
    an all-reduce of 10 us + bytes at 100 GB/s bus bandwidth, a 5 us stage hop, HBM read at 100 GB/s."""
    p = tmp_path / "flat.json"
    p.write_text(json.dumps({
        "name": "flat", "host_to_device_GBps_by_copy_MiB": {"1": 1.0}, "disk_to_host_GBps": 0.5,
        "expert_compute_us_by_tokens": {"1": 100.0}, "reference_expert": {"params": 1000},
        "multi_gpu": {"gpus_per_node": 8, "hbm_bytes": 10 ** 9, "host_links": 8, "hbm_read_GBps": 100.0,
                      "interconnect": {"allreduce_latency_us": 10.0, "busbw_GBps": 100.0, "p2p_latency_us": 5.0,
                                       "p2p_GBps": 100.0}}}))
    return str(p)


def _trace():
    # One sequence of 2 tokens, 2 MoE layers, top-2 of 4 experts.
    return Trace(ids=np.array([[[0, 1], [2, 3]], [[1, 2], [2, 3]]]), seq_offsets=np.array([0, 2]), num_experts=4)


def test_tensor_parallel_step_time_by_hand(flat):
    """2 slots per GPU (of slices), LRU, global: layer 0 misses {0,1} then {2} (1 stays), layer 1 misses
    {2,3} at step 0 - evicting layer 0's - and at step 1 both again... worked below step by step."""
    cfg = ReplayConfig(policy="lru", scope="global", device_capacity="2", profile=flat, expert_bytes=1_000_000,
                       dtype="fp8")
    H = 64
    for tp in (1, 2):
        r = project(_trace(), cfg, 1, Layout(tp=tp), hidden=H)
        link = 1e6 / tp / 1e9                       # one slice at 1 GB/s (flat curve: back-to-back = the same)
        comp = 100e-6 * (1e6 / tp / 1000)           # compute scales with the slice's parameters
        ar = 0.0 if tp == 1 else 2 * (10e-6 + 2 * (tp - 1) / tp * 1 * H * 2 / 100e9)   # two per layer, 1 token
        # Global pool of 2 slots (LRU). Step 0: L0 {0,1} miss 2; L1 {6,7} miss 2 (evicts 0,1).
        # Step 1: L0 {1,2} miss 2 (evicts 6,7); L1 {6,7} miss 2.
        layer = lambda n: max(2 * comp, n * link + comp) + ar
        want = 4 * layer(2)
        assert r["tokens_per_s"] == pytest.approx(2 / want), tp
        assert r["device_hit_rate"] == 0.0
        assert r["bytes_per_token_per_gpu"] == pytest.approx(8 * 1e6 / tp / 2)


def test_dense_weights_are_read_once_per_step(flat):
    """Dense weights add their bytes at the HBM read rate to every step of their stage: 2 steps x 1 MB at
    100 GB/s on top of the expert time above; per stage, each stage's own bytes."""
    cfg = ReplayConfig(policy="lru", scope="global", device_capacity="2", profile=flat, expert_bytes=1_000_000,
                       dtype="fp8")
    base = project(_trace(), cfg, 1, Layout(tp=2), hidden=64)
    r = project(_trace(), cfg, 1, Layout(tp=2), hidden=64, dense_bytes=10 ** 6)
    assert 2 / r["tokens_per_s"] == pytest.approx(2 / base["tokens_per_s"] + 2 * 1e6 / 100e9)
    base = project(_trace(), cfg, 1, Layout(pp=2), hidden=64)
    r = project(_trace(), cfg, 1, Layout(pp=2), hidden=64, dense_bytes=[10 ** 6, 3 * 10 ** 6])
    assert 2 / r["tokens_per_s"] == pytest.approx(2 / base["tokens_per_s"] + 2 * 4e6 / 100e9)


def test_pipeline_stages_by_hand(flat):
    """Two stages of one MoE layer each, 2 slots each: nothing is evicted by the other layer now. Batch 1:
    one micro-batch, the stages in sequence plus one hop per step."""
    cfg = ReplayConfig(policy="lru", scope="global", device_capacity="2", profile=flat, expert_bytes=1_000_000,
                       dtype="fp8")
    H = 64
    r = project(_trace(), cfg, 1, Layout(tp=1, pp=2), hidden=H)
    link, comp = 1e6 / 1e9, 100e-6 * 1000
    hop = 5e-6 + 1 * H * 2 / 100e9
    # Stage 0 (layer 0): step 0 misses {0,1}; step 1 needs {1,2}: 1 hit, 1 miss. Stage 1 (layer 1): {2,3} twice.
    s0 = [max(2 * comp, 2 * link + comp), max(2 * comp, link + comp)]
    s1 = [max(2 * comp, 2 * link + comp), 2 * comp]
    want = sum(a + b + hop for a, b in zip(s0, s1))
    assert r["tokens_per_s"] == pytest.approx(2 / want)
    assert r["device_slots_per_gpu"] == [2, 2]


def test_micro_batches_overlap_the_stages(flat):
    """Batch 2 over 2 stages: 2 micro-batches of one sequence each; a step takes (m + M - 1) x the slowest
    stage's micro-batch time + one hop."""
    tr = Trace(ids=np.array([[[0, 1], [2, 3]]] * 4), seq_offsets=np.array([0, 2, 4]), num_experts=4)
    cfg = ReplayConfig(policy="lru", scope="global", device_capacity="4", profile=flat, expert_bytes=1_000_000,
                       dtype="fp8")
    r = project(tr, cfg, 2, Layout(tp=1, pp=2), hidden=8)
    assert r["micro_batches"] == 2
    comp, link = 100e-6 * 1000, 1e6 / 1e9
    hop = 5e-6 + 8 * 2 / 100e9
    # Each stage's first micro-step loads its 2 experts, the rest hit: micro-step times per stage
    first, rest = max(2 * comp, 2 * link + comp), 2 * comp
    steps = [3 * max(first, rest) + hop, 3 * rest + hop]          # 4 micro-steps = 2 steps of 2
    assert r["tokens_per_s"] == pytest.approx(4 / sum(steps))


def test_layout_errors(flat):
    cfg = ReplayConfig(policy="lru", device_capacity="2", profile=flat, expert_bytes=1_000_000, dtype="fp8")
    with pytest.raises(ValueError, match="exceeds the 8 GPUs"):
        project(_trace(), cfg, 1, Layout(tp=16), hidden=8)
    with pytest.raises(ValueError, match="3 pipeline stages for 2 MoE layers"):
        project(_trace(), cfg, 1, Layout(pp=3), hidden=8)
    with pytest.raises(ValueError, match="positive integer"):
        Layout(tp=0)
    bare = json.loads(open(flat).read())
    del bare["multi_gpu"]["hbm_read_GBps"]
    open(flat, "w").write(json.dumps(bare))
    cfg = ReplayConfig(policy="lru", device_capacity="2", profile=flat, expert_bytes=1_000_000, dtype="fp8")
    with pytest.raises(ValueError, match="hbm_read_GBps is needed"):
        project(_trace(), cfg, 1, Layout(tp=2), hidden=8, dense_bytes=1000)
    with pytest.raises(ValueError, match="no multi_gpu section"):
        MultiGPU.of(cm.load_profile("cpu"))
    assert stage_ranges(93, 4) == [(0, 23), (23, 46), (46, 70), (70, 93)]


def test_h200_multi_gpu_section_names_its_sources():
    mg = MultiGPU.of(cm.load_profile("h200"))
    assert mg.gpus_per_node == 8 and mg.host_links == 8 and "nccl-tests" in mg.source and "Not measured" in mg.source
