"""Closed lists are registries: a policy or a weight format registered in one place is taken by the
CLI, the replay and the live store with no other edit (issue 17). The toys: a FIFO eviction policy
checked against the brute-force oracle, and a per-row int8 expert format checked against its
definition written here."""
import json

import pytest
import torch

from cache_policy import cost_model as cm
from cache_policy.policies import POLICIES, NoCache, register_policy
from cache_policy.replay import ReplayConfig, replay_batch
from cache_policy.synthetic import SyntheticSpec, generate
from runtime import quant
from runtime.cli import build_parser, main
from runtime.engine import Engine, SamplingParams
from runtime.model import Sequence, load_model
from runtime.model.convert import convert
from runtime.model.synthetic import SyntheticModelSpec, build_checkpoint
from runtime.quant import FormatSpec, Part, WeightFormat, register_format
from runtime.store import Manifest
from helpers import feed

import oracle


class FIFO(NoCache):
    """Evict the expert loaded longest ago; a hit does not refresh it. NoCache's bookkeeping (keys in
    insertion order) without its clearing at each step."""
    name = "fifo"
    clears_each_step = False


class Int8Row(WeightFormat):
    """int8 codes with one float32 scale per output row: w[o, i] = q[o, i] * scale[o]."""
    name = "int8_row"

    def parts(self, shape):
        O, I = shape
        return [Part("q", (O, I), torch.int8), Part("scale", (O,), torch.float32)]

    def quantize(self, w):
        scale = (w.float().abs().amax(1) / 127).clamp_min(1e-12)
        return {"q": torch.round(w.float() / scale[:, None]).clamp(-127, 127).to(torch.int8), "scale": scale}

    def dequantize(self, parts, out):
        return out.copy_(parts["q"].float() * parts["scale"][:, None])


@pytest.fixture
def toys(monkeypatch):
    monkeypatch.setitem(POLICIES, "fifo", FIFO)
    monkeypatch.setitem(quant.FORMATS, "int8_row", None)       # registered below; removed after the test
    monkeypatch.setitem(cm.DTYPE_BITS, "int8row", 8.0 + 32.0 / 64)   # removed after the test
    register_policy(FIFO)
    register_format("int8_row", FormatSpec(lambda **kw: Int8Row(), "int8row", 8.0 + 32.0 / 64, quantize="int8row"))
    yield
    for k in [k for k in quant._INSTANCES if k[0] == "int8_row"]:
        del quant._INSTANCES[k]


def test_register_policy_refuses_what_is_not_a_policy():
    with pytest.raises(ValueError, match="EvictionPolicy subclass"):
        register_policy(dict)


def test_a_registered_policy_and_format_reach_the_cli(toys, capsys):
    sub = build_parser()._subparsers._group_actions[0].choices
    assert "fifo" in sub["generate"].format_help() and "fifo" in sub["serve"].format_help()
    assert "mxfp4, int4, fp8, int8, int8row" in " ".join(sub["convert"].format_help().split())
    assert main(["replay", "--synthetic", "--geometry", "small", "--sequences", "4", "--seq-len", "8",
                 "--policy", "fifo,lru", "--batch", "2", "--json"]) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert [r["policy"] for r in rows] == ["fifo", "lru"]


@pytest.mark.parametrize("scope,cap", [("layer", 3), ("global", 10)])
def test_a_registered_policy_replays_as_the_oracle_says(toys, scope, cap):
    tr = generate(SyntheticSpec(num_layers=3, num_experts=12, top_k=2, num_sequences=6, seq_len=20, zipf_s=0.9,
                                persistence=0.4, seed=5))
    r = replay_batch(tr, ReplayConfig(policy="fifo", scope=scope, device_capacity=str(cap)), 2)
    hits, misses, _ = oracle.replay(oracle.groups_of(tr, 2), policy="fifo", cap=cap, scope=scope,
                                    L=tr.num_layers, E=tr.num_experts)
    assert (r["hits"]["device"], r["accesses"]) == (hits, hits + misses)
    lru = replay_batch(tr, ReplayConfig(policy="lru", scope=scope, device_capacity=str(cap)), 2)
    assert lru["hits"]["device"] != hits      # the toy really runs, not LRU under another name


def test_a_registered_format_converts_stores_and_computes_and_the_policy_runs_live(toys, tmp_path):
    spec = SyntheticModelSpec(vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=2, num_experts=8,
                              topics=4, skew=0.5)
    build_checkpoint(str(tmp_path / "hf"), spec)
    convert(str(tmp_path / "hf"), str(tmp_path / "f32"))
    convert(str(tmp_path / "hf"), str(tmp_path / "q"), quantize="int8row")
    m = Manifest.read(str(tmp_path / "q"))
    assert m.expert_format == "int8_row"
    I, H = 64, 64
    assert m.blob_bytes >= 3 * I * H          # three int8 matrices (+ scales): a quarter of fp32
    prompt = [3, 14, 15, 9, 2, 6]
    logits = {}
    for name in ("f32", "q"):
        model, store = load_model(str(tmp_path / name))
        try:
            logits[name] = feed(model, [Sequence()], [prompt])[0]
        finally:
            store.close()
    # int8 rows: relative error of each weight <= 1/254 of its row's max; the logits stay close.
    err = (logits["q"] - logits["f32"]).abs().max() / logits["f32"].abs().max()
    assert 0 < err < 0.05
    # The policy, live: a device tier of 4 of 16 experts under FIFO; the recorded trace replays
    # (with the format's cost dtype) to the live hits.
    slots = 4
    model, store = load_model(str(tmp_path / "q"), expert_budget=slots * m.blob_stride, policy="fifo")
    try:
        eng = Engine(model, store, max_batch=2, prefill_chunk=1)
        for n in (5, 3, 7):
            eng.add_request(list(range(1, n + 1)), SamplingParams(max_tokens=5, ignore_eos=True))
        eng.run()
        live, tr = eng.summary()["hits"], eng.trace()
    finally:
        store.close()
    assert tr.expert_dtype == "int8row"
    r = replay_batch(tr, ReplayConfig(policy="fifo", scope="global", device_capacity=str(slots)), 2)
    assert live["device"] == r["hits"]["device"] and sum(live.values()) == r["accesses"]
    assert r["expert_bytes"] == m.blob_bytes     # sized from the manifest and the format's cost dtype
    assert r["expert_params"] == round(m.blob_bytes * 8 / cm.DTYPE_BITS["int8row"])
