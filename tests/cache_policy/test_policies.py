"""Each policy's eviction choice, one by one, on groups small enough to check by hand."""
import math

import pytest

from cache_policy.keys import Capacity, ExpertKey, parse_bytes
from cache_policy.placement import Pool
from cache_policy.policies import LFU, LRU, Belady, Freq, NoCache, Static, check_policy_name


def run(pool, groups, aux=None):
    out = []
    for t, g in enumerate(groups):
        out.append(pool.access(g, t, None if aux is None else aux[t]))
    return out


def test_lru_evicts_least_recently_used_and_refreshes_hits_first():
    p = Pool(3, LRU())
    run(p, [[1, 2], [3], [1]])              # recency: 2, 3, 1
    n_hits, misses, ev, _ = p.access([4], 3)
    assert (n_hits, misses, list(ev)) == (0, [4], [2])
    n_hits, misses, ev, _ = p.access([3, 5], 4)   # 3 is refreshed before 5 loads: 1 goes
    assert (n_hits, misses, list(ev)) == (1, [5], [1])
    assert p.resident == {3, 4, 5}


def test_lfu_evicts_least_used_and_old_popularity_fades():
    p = Pool(2, LFU(half_life=1e9))          # no decay: plain counts
    run(p, [[1], [1], [1], [2]])
    _, _, ev, _ = p.access([3], 4)
    assert list(ev) == [2]
    q = Pool(2, LFU(half_life=1.0))          # fast decay: 3 uses long ago < 1 use now
    run(q, [[1], [1], [1]] + [[]] * 10 + [[2]])
    _, _, ev, _ = q.access([3], 14)
    assert list(ev) == [1]


def test_lfu_decayed_score_matches_the_formula():
    pol = LFU(half_life=3.0)
    p = Pool(10, pol)
    uses = {1: [0, 1, 5], 2: [2, 3, 4], 3: [7]}
    for t in range(8):
        p.access([k for k, ts in uses.items() if t in ts], t)
    now = 8
    want = {k: sum(2 ** (-(now - u) / 3.0) for u in ts) for k, ts in uses.items()}
    got = {k: pol.score[k] * math.exp(-(now - pol.t0) * pol.log_g) for k in uses}
    ratio = {k: got[k] / want[k] for k in uses}
    # Stored scores are the formula times one common factor: the same order.
    assert max(ratio.values()) == pytest.approx(min(ratio.values()), rel=1e-12)


def test_lfu_rescaling_keeps_order_over_long_runs():
    p = Pool(2, LFU(half_life=2.0))
    for t in range(5000):
        p.access([1] if t % 3 else [2], t)
    _, _, ev, _ = p.access([3], 5000)
    assert list(ev) == [2]                   # 1 is used twice as often


def test_freq_uses_router_weights():
    p = Pool(2, Freq(ema=0.1))
    run(p, [[1, 2], [1, 2]], aux=[[0.1, 0.9], [0.1, 0.9]])
    _, _, ev, _ = p.access([3], 2, [0.5])
    assert list(ev) == [1]                   # same counts, lower weight


def test_static_pins_profile_top():
    prof = {10: 5.0, 11: 4.0, 12: 3.0, 13: 1.0}
    pol = Static(prof)
    assert pol.initial_residents(range(10, 14), 2) == [10, 11]
    p = Pool(3, pol)
    p.resident.update([10, 11])
    pol.on_insert([10, 11], 0, None)
    p.access([13], 1)
    _, _, ev, _ = p.access([12], 2)          # coldest resident (13) streams, pinned ones stay
    assert list(ev) == [13]
    with pytest.raises(ValueError, match="non-empty profile"):
        Static({})


def test_belady_evicts_farthest_next_use():
    p = Pool(2, Belady())
    p.access([1, 2], 0, [5, 3])
    _, _, ev, _ = p.access([3], 1, [9])
    assert list(ev) == [1]
    p2 = Pool(2, Belady())
    p2.access([1, 2], 0, [math.inf, 3])
    _, _, ev, _ = p2.access([3], 1, [4])
    assert list(ev) == [1]                   # never used again goes first


def test_none_keeps_nothing_beyond_the_step():
    p = Pool(4, NoCache())
    p.access([1, 2], 0)
    assert p.clear() and not p.resident
    n_hits, misses, _, _ = p.access([1], 1)
    assert n_hits == 0 and misses == [1]


def test_unknown_policy():
    with pytest.raises(ValueError, match="unknown policy 'arc'; choose one of lru, lfu, freq, static, belady, none"):
        check_policy_name("arc")
    with pytest.raises(ValueError, match="half-life"):
        LFU(half_life=0)
    with pytest.raises(ValueError, match="ema"):
        Freq(ema=1.5)


def test_expert_key_and_capacity_parsing():
    assert ExpertKey(3, 5).flat(64) == 197 and ExpertKey.from_flat(197, 64) == ExpertKey(3, 5)
    assert parse_bytes("24GiB") == 24 * 2**30 and parse_bytes("1.5 MB") == 1_500_000
    c = Capacity.parse("0.1")
    assert c.kind == "fraction"
    assert c.slots(scope="global", num_layers=26, num_experts=64) == 166
    assert c.slots(scope="layer", num_layers=26, num_experts=64) == 6
    assert Capacity.parse("166").slots(scope="global", num_layers=26, num_experts=64) == 166
    assert Capacity.parse("7").slots(scope="layer", num_layers=26, num_experts=64) == 7
    assert Capacity.parse("1GiB").slots(scope="global", num_layers=26, num_experts=64, expert_bytes=2**28) == 4
    with pytest.raises(ValueError, match="needs the expert size"):
        Capacity.parse("1GiB").slots(scope="global", num_layers=2, num_experts=4)
    for bad, msg in (("abc", "cannot parse"), ("-3", "positive"), ("1.5", "above 1.0"), ("12parsecs", "cannot parse")):
        with pytest.raises(ValueError, match=msg):
            Capacity.parse(bad)
