"""Placement against the brute-force oracle, capacities, Belady's bound, inclusive tiers."""
import pytest
from hypothesis import assume, given, settings, strategies as st

from cache_policy.placement import Pool, TieredPlacement
from cache_policy.policies import LRU
from cache_policy.replay import ReplayConfig, replay_batch, static_profile
from cache_policy.synthetic import SyntheticSpec, generate

import oracle


def small_trace(seed, L=3, E=12, k=3, S=6, N=10, zipf=0.7, pers=0.3):
    return generate(SyntheticSpec(num_layers=L, num_experts=E, top_k=k, num_sequences=S, seq_len=N,
                                  seq_len_min=2, zipf_s=zipf, persistence=pers, seed=seed))


CASES = [  # (policy, scope, capacity as count, batch)
    ("lru", "global", 8, 1), ("lru", "global", 8, 4), ("lru", "layer", 4, 3), ("lru", "global", 5, 6),
    ("belady", "global", 8, 1), ("belady", "layer", 4, 4), ("belady", "global", 5, 6),
    ("static", "global", 9, 1), ("static", "layer", 4, 5), ("static", "global", 4, 6),
    ("none", "global", 9, 2), ("none", "layer", 3, 5),
]


@pytest.mark.parametrize("policy,scope,cap,batch", CASES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_replay_matches_brute_force(policy, scope, cap, batch, seed):
    tr = small_trace(seed)
    cfg = ReplayConfig(policy=policy, scope=scope, device_capacity=str(cap))
    r = replay_batch(tr, cfg, batch)
    groups = oracle.groups_of(tr, batch)
    hits, misses, max_res = oracle.replay(groups, policy=policy, cap=cap, scope=scope, L=tr.num_layers,
                                          E=tr.num_experts, static_scores=static_profile(tr))
    assert r["accesses"] == hits + misses
    assert r["hits"]["device"] == hits
    assert r["steps"] == len(groups) // tr.num_layers
    assert r["unique_experts_per_layer_step"] == pytest.approx((hits + misses) / len(groups))


def test_waves_are_counted_when_a_layer_needs_more_than_the_pool():
    tr = small_trace(3, E=12, k=3)
    r = replay_batch(tr, ReplayConfig(policy="lru", scope="layer", device_capacity="3"), 6)
    assert r["waves"]["groups_over_capacity"] > 0
    groups = oracle.groups_of(tr, 6)
    over = sum(1 for _, _, need in groups if len(need) > 3)
    extra = sum(-(-len(need) // 3) - 1 for _, _, need in groups if len(need) > 3)
    assert r["waves"]["groups_over_capacity"] == over
    # Extra waves: at least ceil(n / cap) - 1 per overflowing group (more when hits are fewer than a wave).
    assert r["waves"]["extra_waves"] >= extra


@pytest.mark.slow
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), cap=st.integers(3, 20), batch=st.integers(1, 6),
       scope=st.sampled_from(["global", "layer"]))
def test_belady_is_never_beaten_by_an_online_policy(seed, cap, batch, scope):
    tr = small_trace(seed, E=10, k=3)
    if scope == "layer":
        cap = min(max(cap, 3), 10)
    base = dict(scope=scope, device_capacity=str(cap))
    rb = replay_batch(tr, ReplayConfig(policy="belady", **base), batch)
    # MIN is the optimum when each miss may evict any resident not needed now. A group larger than
    # the pool runs in waves, whose order (not the policy) decides what stays: no bound there.
    assume(rb["waves"]["groups_over_capacity"] == 0)
    best = rb["hits"]["device"]
    # static is left out: it starts with its pinned experts loaded (reported as warm_start),
    # while MIN bounds demand loading from an empty cache.
    for policy in ("lru", "lfu", "freq", "none", "reuse"):
        h = replay_batch(tr, ReplayConfig(policy=policy, **base), batch)["hits"]["device"]
        assert h <= best, (policy, h, best)


@pytest.mark.parametrize("policy", ["lru", "lfu", "freq", "static", "belady", "none", "reuse"])
@pytest.mark.parametrize("prefetch", ["none", "freq", "transition", "oracle"])
def test_capacity_is_never_exceeded(policy, prefetch, monkeypatch):
    tr = small_trace(7, L=4, E=16, k=4, S=8, N=12)
    seen = []
    orig_access, orig_pref = Pool.access, Pool.prefetch

    def access(self, keys, t, aux=None, detail=True):
        out = orig_access(self, keys, t, aux, detail)
        seen.append((len(self.resident), self.capacity))
        return out

    def checked_prefetch(self, keys, t, protected):
        out = orig_pref(self, keys, t, protected)
        seen.append((len(self.resident), self.capacity))
        assert not (set(out[1]) & protected), "prefetch evicted an expert the current layer needs"
        return out

    monkeypatch.setattr(Pool, "access", access)
    monkeypatch.setattr(Pool, "prefetch", checked_prefetch)
    for scope, cap, host in (("global", "10", "20"), ("layer", "4", "6"), ("global", "0.2", None)):
        replay_batch(tr, ReplayConfig(policy=policy, scope=scope, device_capacity=cap, host_capacity=host,
                                      prefetch=prefetch), 3)
    assert seen and all(n <= c for n, c in seen)


def test_inclusive_host_tier_and_disk_counts():
    tr = small_trace(11, L=3, E=12, k=3, S=8, N=12)
    r = replay_batch(tr, ReplayConfig(policy="lru", scope="global", device_capacity="6", host_capacity="12"), 2)
    groups = oracle.groups_of(tr, 2)
    # Host tier alone is an LRU over the same groups with 12 slots (LRU is a stack algorithm, so
    # device contents stay inside it): its hits are device hits + host hits.
    hh, _, _ = oracle.replay(groups, policy="lru", cap=12, scope="global", L=3, E=12)
    dh, dm, _ = oracle.replay(groups, policy="lru", cap=6, scope="global", L=3, E=12)
    assert r["hits"]["device"] == dh
    assert r["hits"]["device"] + r["hits"]["host"] == hh
    assert r["hits"]["disk"] == r["accesses"] - hh
    assert r["bytes_per_token"]["disk_to_host"] * r["tokens"] == pytest.approx(r["hits"]["disk"] * r["expert_bytes"])
    assert r["bytes_per_token"]["host_to_device"] * r["tokens"] == pytest.approx(dm * r["expert_bytes"])


def test_back_invalidation_keeps_tiers_inclusive():
    place = TieredPlacement(num_layers=1, num_experts=8, scope="global", device_slots=2, host_slots=3,
                            policy_factory=LRU, host_policy_factory=LRU)
    place.access(0, [0, 1], 0)
    place.prefetch(0, [2], 0, set())         # device {.., 2}; host {0, 1, 2}
    place.access(0, [3, 4, 5], 1)            # waves on the device; host must drop older experts
    dev = place.device[0].resident
    host = place.host[0].resident
    assert dev <= host
    assert len(dev) <= 2 and len(host) <= 3


def test_prefetch_accounting_used_and_wasted():
    place = TieredPlacement(num_layers=2, num_experts=4, scope="layer", device_slots=2, host_slots=None,
                            policy_factory=LRU)
    place.access(0, [0, 1], 0)
    assert place.prefetch(1, [4 + 2, 4 + 3], 0, {0, 1}) == (2, 0)
    hits, host, disk, waves, used, on_host = place.access(1, [4 + 2, 4 + 0], 0)
    assert (hits, host, used) == (1, 1, 1)          # expert 2 came from the prefetch, 0 did not
    assert place.prefetch_wasted == 1               # expert 3 was evicted unused to make room for 0
    assert place.prefetch_issued == 2 and place.prefetch_used == 1


def test_pool_rejects_empty_capacity_and_host_below_device():
    with pytest.raises(ValueError, match="at least 1 slot"):
        Pool(0, LRU())
    with pytest.raises(ValueError, match="inclusive"):
        TieredPlacement(num_layers=2, num_experts=4, scope="layer", device_slots=3, host_slots=2, policy_factory=LRU)


def test_prefetch_accounting_adds_up_with_a_small_host_tier():
    from cache_policy.synthetic import SyntheticSpec, generate
    tr = generate(SyntheticSpec(num_layers=4, num_experts=16, top_k=3, num_sequences=8, seq_len=20, zipf_s=0.5,
                                cross_layer=0.5, seed=4))
    for pf in ("transition", "oracle", "freq"):
        r = replay_batch(tr, ReplayConfig(policy="lru", scope="global", device_capacity="8", host_capacity="12",
                                          prefetch=pf, prefetch_budget=4), 2)
        ps = r["prefetch_stats"]
        assert ps["issued"] == ps["used"] + ps["wasted"] + ps["unused_at_end"], pf


def test_a_host_computed_layer_prefetches_into_the_host_tier_only():
    """cpu_layers (and one memory on a CPU): a prediction for a layer computed on the host is read from disk into
    the host tier; the device tier is never touched, and a demand access then finds it on the host."""
    place = TieredPlacement(num_layers=2, num_experts=8, scope="global", device_slots=2, host_slots=3,
                            policy_factory=LRU, cpu_layers=2)
    d = place.prefetch_detail(0, [1, 2], 0, set())
    assert d.loaded == () and set(d.from_disk) == {1, 2} and not place.device[0].resident
    assert place.compute_capacity(0) == 3 and place.device_capacity(0) == 2
    got = place.access_detail(0, [1, 2], 1)
    assert set(got.host) == {1, 2} and got.moves.from_disk == () and got.misses == ()   # both on the host already
    d = place.prefetch_detail(0, [1], 2, set())
    assert d.from_disk == ()                                                     # already there: nothing to read
    full = TieredPlacement(num_layers=2, num_experts=8, scope="global", device_slots=2, host_slots=None,
                           policy_factory=LRU, cpu_layers=2)
    assert full.prefetch_detail(0, [1, 2], 0, set()).from_disk == () and full.compute_capacity(0) is None
