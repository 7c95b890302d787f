"""The tiered-moe command, run as a real subprocess."""
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, shared_trace


def cli(*args, check=True):
    p = subprocess.run([sys.executable, "-m", "runtime.cli", *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    if check and p.returncode != 0:
        raise AssertionError(f"exit {p.returncode}: {p.stderr}")
    return p


def test_replay_json_one_object_per_batch():
    p = cli("replay", "--trace", shared_trace("flame-moe-290m.npz"), "--policy", "lru", "--scope", "global",
            "--device-capacity", "0.1", "--host-capacity", "0.5", "--batch", "1,8,64", "--json")
    rows = [json.loads(x) for x in p.stdout.splitlines()]
    assert [r["batch"] for r in rows] == [1, 8, 64]
    for r in rows:
        assert {"batch", "policy", "scope", "hit_rate", "unique_experts_per_layer_step", "bytes_per_token",
                "projected_tokens_per_s", "accesses", "wall_seconds"} <= set(r)
        assert set(r["hit_rate"]) == {"device", "host"}


def test_replay_table_and_synthetic():
    p = cli("replay", "--synthetic", "--geometry", "small", "--zipf", "1.0", "--persistence", "0.5",
            "--sequences", "8", "--seq-len", "16", "--policy", "lru,belady", "--batch", "1,4")
    lines = p.stdout.splitlines()
    assert lines[0].split()[:4] == ["batch", "policy", "scope", "prefetch"]
    assert sum(1 for x in lines if x.startswith(("1 ", "4 "))) == 4
    assert "expert:" in p.stdout and "profile: h200" in p.stdout


def test_trace_stats():
    p = cli("trace", "stats", shared_trace("deepseek-v2-lite-train.npz"))
    assert "tokens         94,165" in p.stdout and "sequences      999" in p.stdout
    assert "top-k          6" in p.stdout and "reuse distance" in p.stdout
    s = json.loads(cli("trace", "stats", shared_trace("flame-moe-290m.npz"), "--json").stdout)
    assert s["layers"] == 8 and s["experts"] == 64 and s["has_weights"]


def test_prefetch_fit_then_replay(tmp_path):
    out = str(tmp_path / "tm.npz")
    cli("prefetch", "fit", "--trace", shared_trace("flame-moe-290m.npz"), "--out", out)
    p = cli("replay", "--trace", shared_trace("flame-moe-290m.npz"), "--prefetch", "transition",
            "--transition-model", out, "--json")
    assert json.loads(p.stdout)["prefetch_stats"]["issued"] > 0


@pytest.mark.parametrize("args,msg", [
    (["replay", "--trace", "/nonexistent.npz"], "trace file '/nonexistent.npz' does not exist"),
    (["replay", "--synthetic", "--policy", "arc"], "unknown policy 'arc'"),
    (["replay", "--synthetic", "--profile", "tpu9"], "unknown hardware profile 'tpu9'"),
    (["replay", "--synthetic", "--scope", "layer", "--device-capacity", "3"], "below top-k = 6"),
    (["replay", "--synthetic", "--batch", "1,x"], "--batch"),
    (["replay"], "exactly one of --trace"),
    (["replay", "--synthetic", "--device-capacity", "lots"], "--device-capacity: cannot parse 'lots'"),
    (["replay", "--synthetic", "--prefetch", "lookahead"], "needs hidden states"),
])
def test_bad_input_gets_a_clear_error(args, msg):
    p = cli(*args, check=False)
    assert p.returncode == 2
    assert msg in p.stderr and "Traceback" not in p.stderr


def test_bad_trace_file_named(tmp_path):
    import numpy as np
    f = tmp_path / "big.npz"
    np.savez(f, ids=np.full((2, 1, 2), 9, dtype=np.uint8), seq_offsets=np.array([0, 2]), num_experts=8)
    p = cli("replay", "--trace", str(f), check=False)
    assert p.returncode == 2 and "big.npz" in p.stderr and "expert id 9 >= num_experts 8" in p.stderr


def test_replay_does_not_import_torch():
    code = ("import sys, runtime.cli as c; c.main(['replay','--synthetic','--sequences','2','--seq-len','4','--json']);"
            "assert 'torch' not in sys.modules, 'replay imported torch'")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True, timeout=120)
