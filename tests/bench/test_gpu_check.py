"""bench/gpu_check.py has never had a GPU in CI: its --dry-run runs every step on the CPU at toy
sizes, so an API change that would break it on the lent machine breaks here first."""
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_gpu_check_dry_run_covers_every_step(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path)}
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "gpu_check.py"), "--dry-run"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    R = json.load(open(tmp_path / "gpu_check_dry_run.json"))
    assert R["gpu"] == "dry run (cpu)"
    assert R["pinned_peak_GBps"] > 0 and R["store_stream_GBps"] > 0
    assert R["decode"]["compute_ms"] > 0 and R["decode"]["step_ms_with_prefetch"] > 0
    assert R["decode"]["stall_ms_lookahead"] >= 0 and R["decode"]["stall_ms_no_prefetch"] >= 0
    for name in ("mxfp4", "int4", "fp8"):
        q = R["quantized"][name]
        # timed separately on a CPU others share: each must be a measurement, their ratio is not checked here
        assert q["dequant_us"] > 0 and q["dequant_plus_matmul_us"] > 0 and q["bytes"] > 0
    assert R["quantized"]["mxfp4"]["bytes"] < R["quantized"]["fp8"]["bytes"]
    h = R["hybrid"]
    assert h["transfer_only_ms"] > 0 and h["hybrid_ms"] > 0 and h["resident_ms"] > 0
    assert h["host_expert_us_measured"] > 0 and h["host_expert_us_predicted"] > 0
    ha = R["hybrid_attention"]
    assert ha["tokens_equal"] and ha["max_logit_diff"] == 0.0 and ha["goal_met"]   # CPU against CPU: identical
    tp = R["tensor_parallel"]
    assert tp["ranks"] == 2 and tp["tokens_equal"] and tp["tp2"]["residency_equal"] and tp["tp2"]["host_shared"]
    assert tp["tp2"]["backend"] == "gloo" and tp["goal_met"], tp
    # without --dry-run and without CUDA it refuses with a clear message
    if not __import__("torch").cuda.is_available():
        q = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "gpu_check.py")], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=120)
        assert q.returncode != 0 and "no CUDA device here" in q.stderr
