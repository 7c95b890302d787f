"""`reuse`: eviction by predicted chance of use, checked against a plain re-implementation of its
definition, its fitted statistics against naive counting, and its scan resistance."""
import numpy as np
import pytest

from cache_policy.placement import Pool, TieredPlacement
from cache_policy.policies import LIVE_POLICIES, POLICIES, Reuse, ReuseStats
from cache_policy.replay import ReplayConfig, replay_batch
from cache_policy.traces import Trace, build_groups, continuous_batches


def _trace(T, L, E, k, seed, seqs=4):
    rng = np.random.default_rng(seed)
    # Sticky routing: each token keeps most of the previous token's experts (locality to learn).
    ids = np.zeros((T, L, k), dtype=np.int64)
    for t in range(T):
        for l in range(L):
            prev = ids[t - 1, l] if t else rng.choice(E, k, replace=False)
            keep = [e for e in prev if rng.random() < 0.6]
            rest = [e for e in rng.permutation(E) if e not in keep][: k - len(keep)]
            ids[t, l] = keep + rest
    cuts = np.linspace(0, T, seqs + 1).astype(np.int64)
    return Trace(ids=ids, seq_offsets=cuts, num_experts=E)


def _naive_groups(tr, batch):
    g = build_groups(tr, continuous_batches(tr.seq_offsets, batch))
    L = g.num_layers
    return [(i // L, i % L, g.keys[g.ptr[i]:g.ptr[i + 1]].tolist()) for i in range(len(g.ptr) - 1)]


def _reference(groups, *, cap, L, E, V, W, A):
    """Plain lists, from Reuse's definition with frozen statistics: a resident of layer m is
    worth V[class][age] where age counts from its last use u to layer m's next group after its
    most recent group (step t if m <= the current layer, else t - 1) and class = how many of
    the W steps up to u used it. Evict the lowest worth, ties to the lowest key. Returns hits."""
    uses = {}                     # key -> steps used, ascending
    order = []                    # resident keys
    hits = 0
    A1 = A + 1
    for t, l, keys in groups:
        def worth(k):
            m = k // E
            tm = t if m <= l else t - 1
            u = max(s for s in uses[k] if s <= tm)
            cls = min(W, sum(1 for s in uses[k] if u - W < s <= u))
            return V[cls][min(tm + 1 - u, A1)]
        for k in keys:
            uses.setdefault(k, [])
            if not uses[k] or uses[k][-1] != t:
                uses[k].append(t)
        hit = [k for k in keys if k in order]
        hits += len(hit)
        for k in keys:
            if k in order:
                continue
            if len(order) >= cap:
                victim = min((k2 for k2 in order if k2 not in keys), key=lambda k2: (worth(k2), k2))
                order.remove(victim)
            order.append(k)
    return hits


@pytest.mark.parametrize("scope_cap,batch", [(9, 1), (14, 1), (20, 3)])
def test_reuse_matches_a_plain_reference(scope_cap, batch):
    L, E, k = 3, 8, 2
    fit = _trace(300, L, E, k, seed=1)
    test = _trace(120, L, E, k, seed=2)
    stats = ReuseStats.fit(fit, batch)
    groups = _naive_groups(test, batch)
    pol = Reuse(stats, learn=False)
    place = TieredPlacement(num_layers=L, num_experts=E, scope="global", device_slots=scope_cap, host_slots=None,
                            policy_factory=lambda: pol)
    hits = 0
    for t, l, keys in groups:
        assert len(keys) <= scope_cap, "the reference has no waves: keep the parameters' groups within the cap"
        hits += place.access(l, keys, t)[0]
    want = _reference(groups, cap=scope_cap, L=L, E=E, V=pol.V, W=stats.W, A=stats.A)
    assert hits == want
    assert 0 < hits < sum(len(g[2]) for g in groups)


def test_fit_counts_match_naive_counting():
    L, E, k = 3, 6, 2
    tr = _trace(80, L, E, k, seed=3, seqs=3)
    for batch in (1, 2):
        st = ReuseStats.fit(tr, batch)
        groups = _naive_groups(tr, batch)
        cross = np.zeros((L, E, E))
        reuse = np.zeros_like(st.reuse)
        seen = {}
        for i, (t, l, keys) in enumerate(groups):
            if i + 1 < len(groups):
                nl = groups[i + 1][1]
                for a in keys:
                    for b in groups[i + 1][2]:
                        cross[l, a - l * E, b - nl * E] += 1
            for key in keys:
                prev = seen.get(key, [])
                if prev:
                    u = prev[-1]
                    cls = min(st.W, sum(1 for s in prev if u - st.W < s <= u))
                    reuse[cls, min(t - u, st.A + 1)] += 1
                seen.setdefault(key, []).append(t)
        np.testing.assert_array_equal(st.cross_c, cross)
        np.testing.assert_array_equal(st.reuse, reuse)
        assert st.groups.tolist() == [len(groups) // L] * L


def test_online_learning_counts_what_it_sees():
    """Reuse() with no statistics learns the same reuse histogram a fit of the replayed trace gives."""
    L, E, k = 2, 8, 2
    tr = _trace(60, L, E, k, seed=4, seqs=2)
    pol = Reuse()
    place = TieredPlacement(num_layers=L, num_experts=E, scope="global", device_slots=E * L, host_slots=None,
                            policy_factory=lambda: pol)
    for t, l, keys in _naive_groups(tr, 1):
        place.access(l, keys, t)
    pol._finish()
    np.testing.assert_array_equal(pol.stats.reuse, ReuseStats.fit(tr, 1).reuse)


def _cyclic_scan(T, L, E, k, hot):
    """Each layer, each token: the same `hot` experts plus k - hot from a cycle over the rest."""
    ids = np.zeros((T, L, k), dtype=np.int64)
    cold = np.arange(hot, E)
    for t in range(T):
        for l in range(L):
            ids[t, l, :hot] = np.arange(hot)
            ids[t, l, hot:] = cold[(t * (k - hot) + np.arange(k - hot)) % len(cold)]
    return Trace(ids=ids, seq_offsets=np.array([0, T]), num_experts=E)


def test_reuse_keeps_the_hot_set_through_a_scan_that_lru_loses():
    # Global pool of 24 slots; each step needs 8 layers x 6 = 48 experts: LRU's reuse distance
    # for everything is 48 > 24, so it never hits. The 16 hot experts fit: reuse keeps them.
    L, E, k, hot = 8, 64, 6, 2
    tr = _cyclic_scan(400, L, E, k, hot)
    lru = replay_batch(tr, ReplayConfig(policy="lru", scope="global", device_capacity="24"), 1)
    re = replay_batch(tr, ReplayConfig(policy="reuse", scope="global", device_capacity="24"), 1)
    assert lru["hit_rate"]["device"] < 0.02
    assert re["hit_rate"]["device"] > 0.9 * hot / k


def test_registry_config_and_errors():
    assert POLICIES["reuse"] is Reuse and "reuse" in LIVE_POLICIES
    with pytest.raises(ValueError, match="unbound"):
        Pool(4, Reuse()).access([1, 2], 0)
    with pytest.raises(ValueError, match="cross_weight"):
        Reuse(cross_weight=2.0)
    with pytest.raises(ValueError, match="gamma"):
        Reuse(gamma=1.0)
    with pytest.raises(ValueError, match="fitted on 2 layers x 4 experts"):
        Reuse(ReuseStats(2, 4)).bind(num_layers=3, num_experts=4)
    # A fit and the cross-layer blend run end to end through replay.
    tr = _trace(60, 2, 8, 2, seed=5)
    r = replay_batch(tr, ReplayConfig(policy="reuse", scope="global", device_capacity="6", fit_trace=tr,
                                      reuse_cross_weight=0.5), 2)
    assert 0 < r["hit_rate"]["device"] < 1
