"""The decode loop: its recorded trace replays to the same hits; sampling; bad requests."""
import pytest
import torch

from cache_policy.replay import ReplayConfig, replay_batch
from runtime.engine import Engine, SamplingParams, sample
from runtime.model import MoEConfig, load_model
from runtime.store import Manifest


@pytest.mark.parametrize("scope,frac,batch,policy", [("global", 0.25, 3, "lru"), ("layer", 0.5, 2, "lru"),
                                                    ("global", 0.1, 1, "reuse"), ("global", 0.07, 3, "reuse")])
def test_live_hits_equal_replay_of_the_recorded_trace(hf_model, scope, frac, batch, policy):
    name, ref, hf_dir, store_dir = hf_model
    m = Manifest.read(store_dir)
    k = MoEConfig.from_hf(store_dir).top_k
    slots = max(k, int(frac * (m.num_experts if scope == "layer" else m.num_layers * m.num_experts)))
    budget = slots * m.blob_stride * (m.num_layers if scope == "layer" else 1)
    model, store = load_model(store_dir, expert_budget=budget, scope=scope, policy=policy)
    try:
        # One token per sequence per step: the batching the replay simulator models.
        eng = Engine(model, store, max_batch=batch, prefill_chunk=1)
        for n in (4, 9, 2, 6, 5):
            eng.add_request(torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(n)).tolist(),
                            SamplingParams(max_tokens=6, ignore_eos=True))
        eng.run()
        live = eng.summary()["hits"]
        tr = eng.trace()
    finally:
        store.close()
    assert tr.num_sequences == 5 and tr.num_layers == model.cfg.num_moe_layers
    r = replay_batch(tr, ReplayConfig(policy=policy, scope=scope, device_capacity=str(slots)), batch)
    assert live["device"] == r["hits"]["device"], name
    assert live["device"] + live["host"] + live["disk"] == r["accesses"]


def test_sampling_is_seeded_and_respects_top_k_top_p():
    logits = torch.tensor([0.0, 5.0, 4.9, -3.0, 1.0])
    assert sample(logits, SamplingParams(), None) == 1
    draws = lambda p, seed: [sample(logits, p, torch.Generator().manual_seed(seed + i)) for i in range(200)]
    p = SamplingParams(temperature=1.0, top_k=2)
    assert set(draws(p, 0)) == {1, 2}
    assert draws(p, 0) == draws(p, 0)
    p = SamplingParams(temperature=1.0, top_p=0.3)   # the top token alone carries > 30%
    assert set(draws(p, 7)) == {1}
    hot = draws(SamplingParams(temperature=5.0), 3)
    assert len(set(hot)) >= 4


@pytest.mark.parametrize("kw,msg", [(dict(max_tokens=0), "max_tokens"), (dict(temperature=-1.0), "temperature"),
                                    (dict(top_p=0.0), "top_p"), (dict(top_k=-2), "top_k")])
def test_bad_sampling_params(kw, msg):
    with pytest.raises(ValueError, match=msg):
        SamplingParams(**kw)


def test_bad_requests_and_stop_tokens(hf_model):
    name, ref, hf_dir, store_dir = hf_model
    model, store = load_model(store_dir)
    try:
        eng = Engine(model, store)
        with pytest.raises(ValueError, match="outside the vocabulary"):
            eng.add_request([1, 500])
        with pytest.raises(ValueError, match="exceeds the context"):
            eng.add_request([1] * 250, SamplingParams(max_tokens=10))
        with pytest.raises(ValueError, match="empty"):
            eng.add_request([])
        rid = eng.add_request([3, 4, 5], SamplingParams(max_tokens=20, ignore_eos=True))
        eng.run()
        first = eng.done[rid].output[0]
        rid2 = eng.add_request([3, 4, 5], SamplingParams(max_tokens=20, stop_token_ids=(first,)))
        eng.run()
        assert eng.done[rid2].output == [first] and eng.done[rid2].finish_reason == "stop"
        assert eng.done[rid].finish_reason == "length" and len(eng.done[rid].output) == 20
    finally:
        store.close()
