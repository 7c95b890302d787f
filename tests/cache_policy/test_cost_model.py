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


def test_shipped_cpu_profile_loads_and_is_used_by_replay(flame_trace):
    prof = cm.load_profile("cpu")
    assert prof.disk_GBps > 0 and prof.h2d_GBps(17 * 2**20) > 0
    r = replay_batch(flame_trace, ReplayConfig(profile="cpu", device_capacity="0.2"), 1)
    assert r["profile"] == "cpu" and r["projected_tokens_per_s"] > 0
