"""Cache-aware routing and expert-aware batching (issue 5's runtime options)."""
import numpy as np
import pytest
import torch

from runtime.engine import Engine, SamplingParams
from runtime.model import MoEConfig, load_model, route
from runtime.store import Manifest


def _cfg(router, k=2, E=8, norm=True):
    c = MoEConfig.__new__(MoEConfig)
    c.router, c.top_k, c.num_experts, c.norm_topk_prob, c.routed_scaling_factor = router, k, E, norm, 1.0
    c.n_group, c.topk_group = 1, 1
    return c


@pytest.mark.parametrize("router", ["softmax_topk", "topk_softmax", "sigmoid_group"])
def test_bonus_changes_the_choice_not_the_weights(router):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 8, generator=g)
    bonus = torch.zeros(8)
    bonus[[1, 5]] = 0.7
    cfg = _cfg(router)
    ids, w = route(logits, cfg, bonus=bonus)
    # Reference, in numpy: choose by logits + bonus (scores + bonus for sigmoid), weigh by the unbiased router.
    L = logits.numpy().astype(np.float64)
    for t in range(16):
        score = 1 / (1 + np.exp(-L[t])) if router == "sigmoid_group" else L[t]
        want = set(np.argsort(-(score + bonus.numpy()))[:2].tolist())
        assert set(ids[t].tolist()) == want
        if router == "softmax_topk":
            p = np.exp(L[t] - L[t].max())
            p /= p.sum()
            ref = p[ids[t].numpy()] / p[ids[t].numpy()].sum()
        elif router == "topk_softmax":
            x = L[t][ids[t].numpy()]
            ref = np.exp(x - x.max()) / np.exp(x - x.max()).sum()
        else:
            s = 1 / (1 + np.exp(-L[t][ids[t].numpy()]))
            ref = s / s.sum()
        np.testing.assert_allclose(w[t].numpy(), ref, rtol=1e-5)
    # No bonus: the plain router.
    assert torch.equal(route(logits, cfg, bonus=torch.zeros(8))[0].sort(1).values, route(logits, cfg)[0].sort(1).values)


def _run(store, *, bonus=0.0, schedule="fcfs", max_batch=4, max_active=None, n=12, tokens=10, frac=0.25):
    m = Manifest.read(store)
    slots = max(2, int(frac * m.num_layers * m.num_experts))
    model, st = load_model(store, expert_budget=slots * m.blob_stride)
    try:
        eng = Engine(model, st, max_batch=max_batch, prefill_chunk=1, cache_bonus=bonus, schedule=schedule,
                     max_active=max_active)
        g = torch.Generator().manual_seed(1)
        ids = [eng.add_request(torch.randint(0, 512, (6,), generator=g).tolist(),
                               SamplingParams(max_tokens=tokens, ignore_eos=True)) for _ in range(n)]
        eng.run()
        return eng, [eng.done[i].output for i in ids], eng.summary(), eng.trace()
    finally:
        st.close()


def test_cache_bonus_raises_hits_and_zero_is_off(tiny_store):
    _, out0, s0, _ = _run(tiny_store[1])
    _, out0b, _, _ = _run(tiny_store[1], bonus=0.0)
    assert out0 == out0b
    _, out_big, s_big, tr = _run(tiny_store[1], bonus=50.0)
    assert s_big["hit_rate_device"] > s0["hit_rate_device"]
    # The recorded routing is what really ran (biased choices included): it replays to the live hits.
    from cache_policy.replay import ReplayConfig, replay_batch
    m = Manifest.read(tiny_store[1])
    r = replay_batch(tr, ReplayConfig(policy="lru", device_capacity=str(max(2, int(0.25 * m.num_layers * m.num_experts)))), 4)
    assert r["hits"]["device"] == s_big["hits"]["device"]


@pytest.mark.slow
def test_expert_aware_batching_keeps_outputs_and_bounds(tiny_store):
    _, fcfs, s_f, _ = _run(tiny_store[1], n=16)
    eng, aware, s_a, _ = _run(tiny_store[1], schedule="expert-aware", max_active=12, n=16)
    assert aware == fcfs   # who runs with whom never changes a greedy sequence's tokens
    assert all(s.batch <= 4 for s in eng.steps)
    assert sum(s.batch for s in eng.steps) == sum(s.batch for s in _run(tiny_store[1], n=16)[0].steps)
    # Fewer distinct experts per step at the same batch size.
    full = [s for s in eng.steps if s.batch == 4]
    assert full and s_a["mean_unique_experts_per_layer"] <= s_f["mean_unique_experts_per_layer"]


def test_bad_options():
    with pytest.raises(ValueError, match="schedule"):
        Engine.__init__(object.__new__(Engine), None, None, schedule="random")
    with pytest.raises(ValueError, match="max_active"):
        Engine.__init__(object.__new__(Engine), None, None, max_batch=8, max_active=4)
    with pytest.raises(ValueError, match="cache_bonus"):
        Engine.__init__(object.__new__(Engine), None, None, cache_bonus=-1)
