"""Replay of the real DeepSeek-V2-Lite trace against independent brute-force implementations."""
from collections import OrderedDict

import numpy as np
import pytest

import oracle
from cache_policy.replay import ReplayConfig, replay, replay_batch, static_profile


def brute_lru_batch1(trace, cap, scope):
    """Per-token LRU with an OrderedDict per pool: the token's experts, in ascending order, become
    the most recent (hits refreshed, misses loaded), then the least recent others leave."""
    L, E = trace.num_layers, trace.num_experts
    pools = [OrderedDict() for _ in range(L if scope == "layer" else 1)]
    hits = 0
    for row in trace.ids.tolist():                  # row: [L][k]
        for layer, experts in enumerate(row):
            od = pools[layer if scope == "layer" else 0]
            keys = sorted(layer * E + e for e in experts)
            for k in keys:
                if k in od:
                    hits += 1
                od.pop(k, None)
                od[k] = None
            while len(od) > cap:
                od.popitem(last=False)
    return hits


@pytest.mark.slow
@pytest.mark.parametrize("scope,cap", [("global", 166), ("layer", 12)])
def test_deepseek_lru_batch1_agrees_with_brute_force(deepseek_trace, scope, cap):
    # the first 364 of the trace's 999 sequences (32K tokens, 5M expert uses): a third of the brute force's time,
    # with the same capacities, so every layer's cache still fills and evicts many times over
    tr = deepseek_trace.subset(range(364))
    r = replay_batch(tr, ReplayConfig(policy="lru", scope=scope, device_capacity=str(cap)), 1)
    assert r["accesses"] == tr.ids.size
    assert r["hits"]["device"] == brute_lru_batch1(tr, cap, scope)


@pytest.mark.slow
def test_deepseek_batch8_and_belady_agree_with_the_oracle(deepseek_trace):
    tr = deepseek_trace.subset(range(24))
    for policy, scope, cap in (("lru", "global", 166), ("belady", "global", 166), ("belady", "layer", 8),
                               ("static", "global", 300), ("none", "layer", 30)):
        groups = oracle.groups_of(tr, 8)
        want, _, _ = oracle.replay(groups, policy=policy, cap=cap, scope=scope, L=tr.num_layers, E=tr.num_experts,
                                   static_scores=static_profile(tr))
        r = replay_batch(tr, ReplayConfig(policy=policy, scope=scope, device_capacity=str(cap)), 8)
        assert r["hits"]["device"] == want, (policy, scope)


def test_json_fields_and_per_layer_rates(flame_trace):
    rs = replay(flame_trace, ReplayConfig(policy="lru", device_capacity="0.25", host_capacity="0.5"), [1, 8, 64])
    assert [r["batch"] for r in rs] == [1, 8, 64]
    for r in rs:
        for key in ("batch", "policy", "scope", "hit_rate", "unique_experts_per_layer_step", "bytes_per_token",
                    "projected_tokens_per_s", "accesses", "wall_seconds"):
            assert key in r
        assert set(r["hit_rate"]) == {"device", "host"}
        per = np.array(r["hit_rate_per_layer"]["device"])
        assert len(per) == flame_trace.num_layers
        # Overall rate = per-layer rates weighted by each layer's accesses.
        assert 0 <= r["hit_rate"]["device"] <= 1
    # More concurrent sequences, more unique experts per layer per step.
    u = [r["unique_experts_per_layer_step"] for r in rs]
    assert u[0] == 6 and u[0] < u[1] < u[2] <= 64


def test_bad_configs_are_refused(deepseek_trace):
    with pytest.raises(ValueError, match="below top-k = 6"):
        replay_batch(deepseek_trace.subset([0]), ReplayConfig(scope="layer", device_capacity="0.05"), 1)
    with pytest.raises(ValueError, match="unknown scope"):
        ReplayConfig(scope="node")
    with pytest.raises(ValueError, match="unknown hardware profile"):
        ReplayConfig(profile="a100x")
    with pytest.raises(ValueError, match="inclusive"):
        replay_batch(deepseek_trace.subset([0]), ReplayConfig(device_capacity="0.2", host_capacity="0.1"), 1)
    with pytest.raises(ValueError, match="batch"):
        replay(deepseek_trace.subset([0]), ReplayConfig(), [0])
