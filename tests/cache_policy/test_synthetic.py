import numpy as np
import pytest

from cache_policy.replay import ReplayConfig, replay_batch
from cache_policy.synthetic import GEOMETRIES, SyntheticSpec, generate
from cache_policy.traces import trace_stats


def test_same_seed_same_trace_other_seed_other_trace():
    spec = SyntheticSpec(num_layers=4, num_experts=32, top_k=4, num_sequences=8, seq_len=16, zipf_s=1.0,
                         persistence=0.4, cross_layer=0.3, seed=5)
    a, b = generate(spec), generate(spec)
    assert np.array_equal(a.ids, b.ids) and np.array_equal(a.weights, b.weights)
    c = generate(SyntheticSpec(**{**spec.__dict__, "seed": 6}))
    assert not np.array_equal(a.ids, c.ids)


@pytest.mark.parametrize("B", [1, 2, 4, 8, 16, 32, 64, 128, 256])
def test_uniform_unique_experts_follow_the_formula(B):
    E, k, L = 64, 6, 4
    spec = SyntheticSpec(num_layers=L, num_experts=E, top_k=k, num_sequences=max(2 * B, 64),
                         seq_len=max(8, 4096 // max(2 * B, 64)), seed=B)
    tr = generate(spec)
    r = replay_batch(tr, ReplayConfig(policy="lru", scope="global", device_capacity="1.0"), B)
    # Only full steps: the tail of the schedule runs with fewer sequences.
    expected = E * (1 - (1 - k / E) ** B)
    assert r["mean_batch"] == pytest.approx(B, rel=0.15)
    from cache_policy.traces import build_groups, continuous_batches
    g = build_groups(tr, continuous_batches(tr.seq_offsets, B))
    sizes = np.diff(g.ptr).reshape(-1, L)
    full = g.batch_sizes == B
    measured = sizes[full].mean()
    assert measured == pytest.approx(expected, rel=0.02)


def test_knobs_change_locality_in_the_expected_direction():
    base = dict(num_layers=4, num_experts=64, top_k=4, num_sequences=16, seq_len=64, seed=1)
    uni = trace_stats(generate(SyntheticSpec(**base)))
    skew = trace_stats(generate(SyntheticSpec(**base, zipf_s=1.2)))
    pers = trace_stats(generate(SyntheticSpec(**base, persistence=0.7)))
    assert uni["top10pct_share_mean"] == pytest.approx(0.1, abs=0.03)
    assert skew["top10pct_share_mean"] > 0.35
    # Each slot kept with p, else re-drawn (and may land on a previous expert by chance).
    assert pers["persistence"] == pytest.approx(0.7 + 0.3 * 4 / 64, abs=0.04)
    assert uni["persistence"] == pytest.approx(4 / 64, abs=0.02)


def test_cross_layer_paths_are_predictable():
    from cache_policy.prefetch import TransitionPrefetcher
    def top_share(cross):
        tr = generate(SyntheticSpec(num_layers=3, num_experts=32, top_k=2, num_sequences=32, seq_len=32,
                                    cross_layer=cross, seed=2))
        c = TransitionPrefetcher(3, 32).fit(tr).counts[0]
        return (c.max(1) / c.sum(1)).mean()
    # Pairs are counted over both slots (k x k), so a slot that follows its path with p = 0.9
    # makes its successor about 0.9 / k = 0.45 of the row; uniform routing gives ~ a few %.
    assert top_share(0.9) == pytest.approx(0.45, abs=0.05)
    assert top_share(0.0) < 0.15


def test_kimi_k3_geometry_and_bad_specs():
    tr = generate(SyntheticSpec.with_geometry("kimi-k3", num_sequences=2, seq_len=2))
    assert tr.ids.shape == (4, 93, 16) and tr.num_experts == 896 and tr.ids.max() < 896
    assert GEOMETRIES["kimi-k3"] == (93, 896, 16)
    with pytest.raises(ValueError, match="top_k 9 exceeds num_experts 8"):
        SyntheticSpec(num_experts=8, top_k=9)
    with pytest.raises(ValueError, match="persistence must be in"):
        SyntheticSpec(persistence=1.5)
    with pytest.raises(ValueError, match="unknown geometry"):
        SyntheticSpec.with_geometry("gpt-5")
