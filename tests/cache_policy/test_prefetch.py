import numpy as np
import torch
import pytest

import oracle
from cache_policy.prefetch import FreqPrefetcher, GateLookaheadPrefetcher, TransitionPrefetcher, make_prefetcher
from cache_policy.replay import ReplayConfig, replay_batch
from cache_policy.synthetic import SyntheticSpec, generate


def test_transition_fit_counts_match_brute_force(flame_trace):
    tr = flame_trace.subset(range(3))
    p = TransitionPrefetcher(tr.num_layers, tr.num_experts).fit(tr)
    want = np.zeros_like(p.counts)
    so = tr.seq_offsets
    for t in range(tr.num_tokens):
        for l in range(tr.num_layers):
            if l + 1 < tr.num_layers:
                nxt = tr.ids[t, l + 1]
            elif t + 1 not in so:
                nxt = tr.ids[t + 1, 0]
            else:
                continue
            for i in tr.ids[t, l]:
                for j in nxt:
                    want[l, i, j] += 1
    assert np.array_equal(p.counts, want)


def test_transition_predicts_and_roundtrips(tmp_path):
    p = TransitionPrefetcher(2, 4)
    p.counts[0, 1, 3] = 5
    p.counts[0, 1, 2] = 1
    p.popularity[1] = [0, 0, 1, 0]
    assert p.predict(1, [1], 2) == [3, 2]
    assert p.predict(1, [0], 1) == [2]          # unseen row: popularity fallback
    path = str(tmp_path / "tm.npz")
    p.save(path)
    q = TransitionPrefetcher.load(path)
    assert np.array_equal(q.counts, p.counts) and q.predict(1, [1], 2) == [3, 2]
    with pytest.raises(ValueError, match="does not exist"):
        TransitionPrefetcher.load(str(tmp_path / "x.npz"))
    (tmp_path / "bad.npz").write_bytes(b"zz")
    with pytest.raises(ValueError, match="not a transition model"):
        TransitionPrefetcher.load(str(tmp_path / "bad.npz"))


def test_freq_prefetcher_ranks_by_ema():
    p = FreqPrefetcher(1, 5, ema=0.5)
    p.observe(0, [0, 1], [1.0, 1.0], 0)
    p.observe(0, [2], [1.0], 5)              # recent beats old
    assert p.predict(0, [], 2) == [2, 0]


def test_lookahead_needs_a_model_and_uses_the_gate():
    with pytest.raises(ValueError, match="needs hidden states"):
        make_prefetcher("lookahead", num_layers=2, num_experts=4)
    with pytest.raises(ValueError, match="needs hidden states"):
        ReplayConfig(prefetch="lookahead")
    # The preview's expert ids per token: expert 1 chosen by both tokens, 0 and 3 by one (ties: lower id).
    g = GateLookaheadPrefetcher(lambda layer, h: np.array([[1, 3], [0, 1]]), num_experts=4)
    g.set_hidden(object())
    assert g.predict(1, [], 2) == [1, 0]
    # The live model's preview is a tensor on its device (CUDA): it is brought to the host first.

    class OnDevice:                 # numpy cannot read it; .cpu() gives a host copy
        def __array__(self, *a, **k):
            raise TypeError("can't convert cuda tensor to numpy")

        def cpu(self):
            return torch.tensor([[1, 3], [0, 1]])
    g = GateLookaheadPrefetcher(lambda layer, h: OnDevice(), num_experts=4)
    g.set_hidden(object())
    assert g.predict(1, [], 2) == [1, 0]
    with pytest.raises(ValueError, match="unknown prefetcher 'magic'"):
        make_prefetcher("magic", num_layers=1, num_experts=1)


def _trace():
    return generate(SyntheticSpec(num_layers=4, num_experts=16, top_k=2, num_sequences=8, seq_len=24,
                                  zipf_s=0.8, persistence=0.3, cross_layer=0.6, seed=3))


def test_oracle_prefetch_predictions_are_exact_and_accounting_adds_up():
    tr = _trace()
    r = replay_batch(tr, ReplayConfig(policy="lru", scope="layer", device_capacity="6", prefetch="oracle",
                                      prefetch_budget=16, prefetch_rule="always"), 1)
    ps = r["prefetch_stats"]
    assert ps["prediction_precision"] == 1.0 and ps["prediction_recall"] == 1.0
    assert ps["issued"] == ps["used"] + ps["wasted"] + ps["unused_at_end"]
    assert ps["wasted"] == 0
    # Every need after the very first group is prefetched: only the first group misses.
    assert r["accesses"] - r["hits"]["device"] == len(oracle.groups_of(tr, 1)[0][2])


@pytest.mark.parametrize("name", ["freq", "transition"])
def test_prefetch_precision_recall_are_measured(name):
    tr = _trace()
    r0 = replay_batch(tr, ReplayConfig(policy="lru", scope="global", device_capacity="12"), 1)
    r = replay_batch(tr, ReplayConfig(policy="lru", scope="global", device_capacity="12", prefetch=name,
                                      prefetch_rule="always"), 1)
    ps = r["prefetch_stats"]
    assert ps["issued"] == ps["used"] + ps["wasted"] + ps["unused_at_end"]
    assert 0 < ps["precision"] <= 1 and 0 < ps["recall"] <= 1
    assert ps["wasted_bytes"] == ps["wasted"] * r["expert_bytes"]
    moved = r["bytes_per_token"]["host_to_device"] * r["tokens"] / r["expert_bytes"]
    assert moved == pytest.approx(r["accesses"] - r["hits"]["device"] + ps["issued"])
    assert r0["prefetch_stats"]["issued"] == 0


@pytest.mark.slow
def test_transition_fitted_on_train_split_only(deepseek_trace):
    train, test = deepseek_trace.subset(range(40)).split(0.8)
    assert train.num_sequences == 32 and test.num_sequences == 8
    assert not np.shares_memory(train.ids, test.ids)
    r = replay_batch(test, ReplayConfig(policy="lru", scope="global", device_capacity="0.1", prefetch="transition",
                                        fit_trace=train), 1)
    assert r["prefetch_stats"]["prediction_precision"] > 0.2


def test_gate_calibrates_by_rank_and_moves_only_what_pays():
    from cache_policy.prefetch import PrefetchGate
    g = PrefetchGate(budget=3, link_s=1.0)
    assert g.select([10, 11, 12], free_s=10.0) == []      # no track record yet: nothing moves
    for _ in range(98):
        g.observe([10, 11, 12], {10, 12})          # rank 0 always needed, rank 1 never, rank 2 always
    p = g.probabilities()
    assert p[0] == pytest.approx(98 / 100) and p[1] == 0.0 and p[2] == pytest.approx(98 / 100)
    # A free window of 1.5 links: the first move is free, the second spills 0.5 - worth it at p=0.99.
    assert g.select([10, 11, 12], free_s=1.5) == [10, 12]
    # No idle link: each move spills a whole link time, never worth it at p < 1.
    assert g.select([10, 11, 12], free_s=0.0) == []
    # Resident candidates cost nothing and are not moved; spill counts only what is moved. In a full
    # pool a move evicts: rank 1 (p = 0) is not worth a victim needed again with probability 0.3.
    assert g.select([10, 11, 12], free_s=1.0, resident={10}, evict_p=0.3) == [12]
    assert g.select([10, 11, 12], free_s=2.0, resident={10}, evict_p=0.0) == [12]   # p = 0 never pays
    with pytest.raises(ValueError, match="budget must be at least 1"):
        PrefetchGate(0, 1.0)


@pytest.mark.parametrize("prefetch", ["freq", "transition", "oracle"])
@pytest.mark.parametrize("profile", ["h200", "cpu"])
def test_cost_rule_prefetch_is_never_worse_than_none(prefetch, profile):
    tr = _trace()
    for cap in ("0.1", "0.2", "0.5"):
        for batch in (1, 4):
            base = dict(policy="lru", scope="global", device_capacity=cap, profile=profile)
            r0 = replay_batch(tr, ReplayConfig(**base), batch)
            r = replay_batch(tr, ReplayConfig(**base, prefetch=prefetch), batch)
            assert r["projected_tokens_per_s"] >= r0["projected_tokens_per_s"] * (1 - 1e-9), (cap, batch)
            ps = r["prefetch_stats"]
            assert ps["issued"] == ps["gate_moved"] - (ps["gate_moved"] - ps["issued"])   # nothing beyond the gate
            assert ps["issued"] <= ps["gate_moved"]
