"""The tiered-moe command, run as a real subprocess."""
import json
import subprocess
import sys

import pytest

from helpers import ROOT, shared_trace

pytestmark = pytest.mark.slow   # every test runs the command as a subprocess (seconds each)


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
            "--transition-model", out, "--prefetch-rule", "always", "--json")
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


def test_demo_builds_converts_and_compares_regimes(tmp_path):
    p = cli("demo", "--workdir", str(tmp_path), "--requests", "4", "--max-tokens", "4", "--high-batch", "4")
    assert "tiering" in p.stdout and "batch   1:" in p.stdout and "batch   4:" in p.stdout
    rows = json.load(open(tmp_path / "regimes.json"))
    assert {(r["policy"], r["prefetch"], r["batch"]) for r in rows} == {
        (p, f, b) for p, f in (("none", "none"), ("lru", "none"), ("lru", "freq")) for b in (1, 4)}
    for r in rows:
        if r["prefetch"] == "none":
            assert r["replayed_device_hits_equal_live"] is True
    assert (tmp_path / "regimes.png").stat().st_size > 10_000
    again = cli("demo", "--workdir", str(tmp_path), "--requests", "4", "--max-tokens", "4", "--high-batch", "4")
    assert "building the synthetic checkpoint" not in again.stdout


def test_demo_k3_shape_builds_an_mxfp4_hybrid_store_and_states_the_memory_it_frees(tmp_path):
    from runtime.cli import _k3_memory_table
    from runtime.model import MoEConfig
    from runtime.store import Manifest
    p = cli("demo", "--shape", "k3", "--workdir", str(tmp_path), "--build-only")
    store = p.stdout.strip().splitlines()[-1]
    assert store == str(tmp_path / "k3" / "store")
    cfg, m = MoEConfig.from_hf(store), Manifest.read(store)
    assert (cfg.top_k, cfg.num_experts, cfg.shared_intermediate // cfg.expert_intermediate) == (16, 128, 2)
    assert len(cfg.linear_layers) == 3 * len(cfg.attention_layers) and cfg.attn_res_block_layers and cfg.latent_dim
    assert m.expert_format == "mxfp4"
    table = _k3_memory_table(store, 8)
    # 6 KDA layers: 4 heads x 64 x 64 float32 + conv 768 x 3 bf16; 2 MLA layers: (64 + 16) bf16 per token
    per_seq, per_tok, full_tok = 6 * (4 * 64 * 64 * 4 + 768 * 3 * 2), 2 * 80 * 2, 8 * 80 * 2
    freed = 8 * 32768 * full_tok - 8 * (32768 * per_tok + per_seq)
    assert f"{per_seq:,} B per sequence" in table and f"{full_tok:,} B per token" in table
    assert f"{freed // m.blob_stride:,}" in table.splitlines()[3]


def test_convert_generate_roundtrip(tmp_path):
    from runtime.model.synthetic import SyntheticModelSpec, build_checkpoint
    build_checkpoint(str(tmp_path / "hf"), SyntheticModelSpec(num_layers=2, num_experts=8, hidden_size=32,
                                                               intermediate_size=32, vocab_size=64, topics=4))
    cli("convert", "--model", str(tmp_path / "hf"), "--out", str(tmp_path / "store"))
    p = cli("generate", "--model", str(tmp_path / "store"), "--prompt-ids", "1,2,3", "--max-tokens", "5",
            "--device-budget", "200KiB", "--json", "--trace-out", str(tmp_path / "t.npz"))
    out = [json.loads(x) for x in p.stdout.splitlines()]
    assert len(out[0]["tokens"]) == 5 and out[1]["generated_tokens"] == 5
    s = json.loads(cli("trace", "stats", str(tmp_path / "t.npz"), "--json").stdout)
    assert s["tokens"] == 3 + 4 and s["layers"] == 2
    bad = cli("generate", "--model", str(tmp_path / "store"), "--prompt-ids", "1", "--device-budget", "1KiB", check=False)
    assert bad.returncode == 2 and "the minimum is" in bad.stderr
    # --prompt-ids repeats like --prompt (a batch); budgets take a plain byte count
    p = cli("generate", "--model", str(tmp_path / "store"), "--prompt-ids", "1,2,3", "--prompt-ids", "4,5",
            "--max-tokens", "3", "--device-budget", str(200 * 1024), "--json")
    out = [json.loads(x) for x in p.stdout.splitlines()]
    assert [len(o["tokens"]) for o in out[:2]] == [3, 3] and out[2]["generated_tokens"] == 6
    # --max-active applies to generate's own batch (the prompts), not the default --max-batch of 16
    p = cli("generate", "--model", str(tmp_path / "store"), "--prompt-ids", "1,2,3", "--max-tokens", "3",
            "--max-active", "4", "--json")
    assert len(json.loads(p.stdout.splitlines()[0])["tokens"]) == 3
    bad = cli("generate", "--model", str(tmp_path / "store"), "--prompt-ids", "1", "--device-budget", "12 apples",
              check=False)
    assert bad.returncode == 2 and "give bytes (200000) or a size" in bad.stderr
