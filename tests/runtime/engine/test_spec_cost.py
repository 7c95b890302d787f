"""choose_k: the cost rule's live inputs (runtime/engine/spec_cost.py), checked against hand-computed numbers on
engine-like fakes, and once against a real store and engine for the interface."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest

from runtime.engine.spec_cost import SpecLive, choose_k, expert_seconds, recent_counts, spec_inputs, step_warm


@dataclass
class FakeCost:
    """A cost model with round numbers: an expert computes n tokens in n ms on the device, 2n ms on the host; a
    move takes 10 ms; a layer with moves takes max(compute, moves + 1 ms) (cost_model.HybridCost.layer_seconds)."""
    t_link: float = 0.010
    c_min: float = 0.001

    def tables(self, n: int):
        return [1e-3 * i for i in range(n + 1)], [2e-3 * i for i in range(n + 1)]

    def layer_seconds(self, dev_compute, n_moved, host_compute, queued=0.0):
        D = queued + n_moved * self.t_link
        dev = max(dev_compute, D + self.c_min) if n_moved else dev_compute
        return dev + host_compute


@dataclass
class FakePool:
    resident: set
    capacity: int


@dataclass
class FakePlacement:
    pools: list

    def unique_pools(self, tier="device"):
        return self.pools


@dataclass
class FakeManifest:
    num_experts: int = 8
    num_layers: int = 2


@dataclass
class FakeStore:
    resident_by_layer: list
    host_layers: int = 0
    cost: FakeCost = field(default_factory=FakeCost)
    m: FakeManifest = field(default_factory=FakeManifest)
    placement: FakePlacement = field(default_factory=lambda: FakePlacement([FakePool(set(), 4)]))

    def resident(self, layer, tier="device"):
        return list(self.resident_by_layer[layer])

    def compute_on_host(self, layer):
        return layer < self.host_layers


@dataclass
class FakeParams:
    max_tokens: int = 100


@dataclass
class FakeReq:
    id: int
    routing: list
    params: FakeParams = field(default_factory=FakeParams)
    output: list = field(default_factory=lambda: [1, 2, 3])


@dataclass
class FakeCfg:
    num_moe_layers: int = 2


@dataclass
class FakeModel:
    cfg: FakeCfg = field(default_factory=FakeCfg)


@dataclass
class FakeEngine:
    spec_live: SpecLive
    store: FakeStore
    model: FakeModel = field(default_factory=FakeModel)


# Three routed tokens, [tokens, layers 2, top-2]: a prompt chunk of two, then one decode token.
ROUTING = [np.array([[[0, 1], [2, 3]], [[0, 2], [2, 4]]]), np.array([[[1, 2], [5, 6]]])]


def _live(method="ngram", rule="cost", k_max=2, accepted=2, times=4) -> SpecLive:
    live = SpecLive(method, rule, k_max)
    for _ in range(8):                       # 8 warm plain steps of 50 ms at batch 1: rate 20 tokens/s
        live.observe_step(1, 1, 0.05, 0, True, {"device": 3, "host": 1, "disk": 0})
    for _ in range(times):
        live.observe_verify(0, 2, accepted)
    return live


def _engine(live, resident=(range(8), range(2))) -> FakeEngine:
    return FakeEngine(live, FakeStore([set(r) for r in resident]))


def _dicts(counts) -> list:
    """counts [layers, experts] as per layer {expert: tokens} (the hand-written form)."""
    return [{e: int(c) for e, c in enumerate(row) if c} for row in counts]


def recent_union(reqs, k, L, E=8):
    return recent_counts(reqs, k, L, E)[k]


def test_recent_counts_take_the_last_k_plus_one_tokens_across_steps():
    r = FakeReq(0, ROUTING)
    assert _dicts(recent_union([r], 0, 2)) == [{1: 1, 2: 1}, {5: 1, 6: 1}]
    assert _dicts(recent_union([r], 1, 2)) == [{0: 1, 1: 1, 2: 2}, {2: 1, 4: 1, 5: 1, 6: 1}]
    assert _dicts(recent_union([r], 2, 2)) == [{0: 2, 1: 2, 2: 2}, {2: 2, 3: 1, 4: 1, 5: 1, 6: 1}]
    assert (recent_counts([r], 9, 2, 8)[9] == recent_union([r], 2, 2)).all()   # no more tokens than it routed
    every = recent_counts([r], 2, 2, 8)
    assert all((every[k] == recent_union([r], k, 2)).all() for k in range(3))  # one pass gives each k's
    both = recent_union([r, FakeReq(1, [np.array([[[7, 1], [5, 0]]])])], 0, 2)
    assert _dicts(both) == [{1: 2, 2: 1, 7: 1}, {0: 1, 5: 2, 6: 1}]         # united over the batch, tokens summed
    assert not recent_counts([FakeReq(2, [])], 2, 2, 8).any()


def test_expert_seconds_by_hand():
    # miss rate 1/4 (3 device hits of 4 accesses); layer 0's pool holds all 8 experts (no move), layer 1 two
    st = FakeStore([set(range(8)), {0, 1}])
    r = FakeReq(0, ROUTING)
    # k = 0: layer 0 computes 2 ms; layer 1: 2 ms compute vs 0.5 moves x 10 ms + 1 ms = 6 ms -> 8 ms
    assert expert_seconds(st, recent_union([r], 0, 2), 0.25) == pytest.approx(0.008)
    # k = 1: layer 0 4 ms; layer 1 max(4 ms, 1.0 x 10 + 1) = 11 ms -> 15 ms
    assert expert_seconds(st, recent_union([r], 1, 2), 0.25) == pytest.approx(0.015)
    # k = 2: layer 0 6 ms; layer 1 max(6 ms, 1.25 x 10 + 1) = 13.5 ms -> 19.5 ms
    assert expert_seconds(st, recent_union([r], 2, 2), 0.25) == pytest.approx(0.0195)
    # layer 0 computed on the host: 2 tokens x 3 experts x 2 ms, nothing moved
    st.host_layers = 1
    assert expert_seconds(st, recent_union([r], 2, 2), 0.25) == pytest.approx(0.012 + 0.0135)


def test_choose_k_by_hand_when_drafts_pay():
    live = _live()
    eng = _engine(live, (range(8), {0, 1}))
    inp = spec_inputs(eng, [FakeReq(0, ROUTING)], 2)
    # the measured 50 ms plain step + the priced extra over k = 0 (8 ms): 7 and 11.5 ms
    assert inp.verify_seconds == pytest.approx((0.05, 0.057, 0.0615))
    assert inp.draft_seconds == (0.0, 0.0, 0.0)                      # ngram: free
    # 4 steps of 2 drafts both accepted, prior 0.7 x 4: (4 + 2.8) / 8 = 0.85 at both positions
    assert inp.expected_tokens == pytest.approx((1.0, 1.85, 1 + 0.85 + 0.85 ** 2))
    assert inp.going_rate == pytest.approx(20.0)
    # surplus: 0, 1.85 - 20 x 0.057 = 0.71, 2.5725 - 20 x 0.0615 = 1.3425: k = 2
    assert choose_k(eng, [FakeReq(0, ROUTING)], 2) == [2]
    assert choose_k(eng, [FakeReq(0, ROUTING)], 1) == [1]           # k_max caps it


def test_choose_k_is_zero_when_drafts_do_not_pay():
    live = _live(accepted=0, times=36)          # position 1: (0 + 2.8) / 40 = 0.07
    eng = _engine(live, (range(8), {0, 1}))
    inp = spec_inputs(eng, [FakeReq(0, ROUTING)], 2)
    assert inp.expected_tokens[1] == pytest.approx(1.07)
    # 1.07 - 20 x 0.057 = -0.07 and 1 + 0.07 + 0.07 x 0.7 - 1.23 < 0: neither beats k = 0
    assert choose_k(eng, [FakeReq(0, ROUTING)], 2) == [0]


def test_draft_model_cost_is_measured():
    live = _live(method="draft")
    live.observe_draft(10, 0.1)                 # 10 ms a drafted token: 0.2 of the 50 ms plain step
    eng = _engine(live, (range(8), {0, 1}))
    inp = spec_inputs(eng, [FakeReq(0, ROUTING)], 2)
    assert inp.draft_seconds == pytest.approx((0.0, 0.01, 0.02))
    # surplus k = 1: 1.85 - 20 x 0.067 = 0.51; k = 2: 2.5725 - 20 x 0.0815 = 0.9425
    assert choose_k(eng, [FakeReq(0, ROUTING)], 2) == [2]
    live.observe_draft(10, 1.9)                 # now 100 ms a token: 2 plain steps - drafting never pays
    assert choose_k(eng, [FakeReq(0, ROUTING)], 2) == [0]


def test_choose_k_waits_for_the_rate_and_caps_by_tokens_left():
    live = SpecLive("ngram", "cost", 2)
    for _ in range(7):
        live.observe_step(1, 1, 0.05, 0, True)
    eng = _engine(live)
    assert choose_k(eng, [FakeReq(0, ROUTING)], 2) == [0]            # 7 warm steps: the rate is not ready
    live.observe_step(1, 1, 0.05, 0, False)
    assert choose_k(eng, [FakeReq(0, ROUTING)], 2) == [0]            # a cold step does not count
    live.observe_step(1, 1, 0.05, 0, True)
    assert choose_k(eng, [FakeReq(0, ROUTING)], 2) == [2]            # every expert resident: drafts are cheap
    short = FakeReq(0, ROUTING, FakeParams(max_tokens=5), [1, 2, 3])  # one token after the next is left
    assert choose_k(eng, [short], 2) == [1]
    fixed = _engine(SpecLive("ngram", "fixed", 3))
    assert choose_k(fixed, [FakeReq(0, ROUTING), short], 3) == [3, 1]  # fixed: k_max from the first step


def test_plain_seconds_scale_from_the_nearest_batch():
    live = SpecLive("mtp")
    assert live.plain_seconds(1) is None
    live.observe_step(2, 2, 0.1, 0, True)
    live.observe_step(2, 2, 0.3, 0, True)
    live.observe_step(2, 8, 0.5, 3, True)           # a verify step: not a plain step
    assert live.plain_seconds(2) == pytest.approx(0.2)
    assert live.plain_seconds(4) == pytest.approx(0.4)
    with pytest.raises(ValueError, match="unknown method 'eagle'"):
        SpecLive("eagle")


def test_step_warm():
    st = FakeStore([set(), set()], placement=FakePlacement([FakePool({1, 2}, 4)]))
    assert not step_warm(st, {"device": 1, "host": 0, "disk": 1})      # read from disk
    assert step_warm(st, {"device": 4, "host": 0, "disk": 0})          # every access hit the device
    assert not step_warm(st, {"device": 1, "host": 3, "disk": 0})      # the device tier is still filling
    st.placement.pools[0].resident = {0, 1, 2, 3}
    assert step_warm(st, {"device": 1, "host": 3, "disk": 0})          # full: misses are the steady state


def test_choose_k_on_a_real_store(store):
    """The interface against a real engine's store and requests: choose_k reads store.cost, store.resident,
    store.placement and the requests' routing as the engine files them."""
    from runtime.engine import Engine, SamplingParams
    from runtime.model import load_model
    model, st = load_model(store)
    try:
        eng = Engine(model, st, max_batch=1)
        eng.spec_live = live = SpecLive("ngram", "cost", 3)
        eng.add_request([5, 6, 7, 8], SamplingParams(max_tokens=24))
        while eng.has_work():
            res = eng.step_result()
            rec = res.record
            if rec.tokens == rec.batch:
                live.observe_step(rec.batch, rec.tokens, rec.seconds, 0, step_warm(st, rec.hits), rec.hits)
        r = eng.done[0]
        assert live.rate.ready and live.plain_seconds(1) > 0
        inp = spec_inputs(eng, [r], 3)
        assert inp.verify_seconds[0] == pytest.approx(live.plain_seconds(1))
        assert list(inp.verify_seconds) == sorted(inp.verify_seconds)    # more tokens never cost less
        L, E, miss = model.cfg.num_moe_layers, model.cfg.num_experts, live.miss_rate()
        assert inp.verify_seconds[3] - inp.verify_seconds[0] == pytest.approx(
            expert_seconds(st, recent_union([r], 3, L, E), miss) - expert_seconds(st, recent_union([r], 0, L, E), miss))
        r.params.max_tokens = len(r.output) + 10
        assert all(0 <= k <= 3 for k in choose_k(eng, [r], 3))
    finally:
        st.close()


@dataclass
class FakeRecord:
    batch: int
    tokens: int
    seconds: float
    hits: dict
    spec_drafted: int = 0
    spec_accepted: int = 0
    spec_refed: int = 0
    failed: int = 0


@dataclass
class FakeCounted(FakeReq):
    spec_drafted: int = 0
    spec_accepted: int = 0
    finished: bool = False


def test_observe_feeds_acceptance_rate_plain_steps_and_the_drafters_timing():
    from runtime.engine.spec_cost import observe
    from runtime.engine.spec_draft import DraftTiming
    spec = type("Spec", (), {"method": "draft", "rule": "cost", "num_speculative_tokens": 3})()
    eng = FakeEngine(None, FakeStore([set(range(8)), set(range(8))]))
    eng.speculative = spec
    eng.drafter = type("D", (), {"timing": DraftTiming(tokens=6, seconds=0.3)})()
    r = FakeCounted(0, ROUTING)
    hits = {"device": 4, "host": 0, "disk": 0}
    observe(eng, [r], FakeRecord(1, 5, 0.2, hits))                 # a prompt chunk: not a decode step
    assert eng.spec_live.rate.steps == 0 and not eng.spec_live.plain
    observe(eng, [r], FakeRecord(1, 1, 0.05, hits))                # a plain decode step
    assert eng.spec_live.plain_seconds(1) == pytest.approx(0.05)
    r.spec_drafted, r.spec_accepted = 3, 2                           # a verify step: 3 drafts, 2 kept
    observe(eng, [r], FakeRecord(1, 4, 0.08, hits, spec_drafted=3, spec_accepted=2))
    live = eng.spec_live
    assert live.trackers[0].tried == [1, 1, 1] and live.trackers[0].accepted == [1, 1, 0]
    assert live.rate.by_batch[1] == [2, 1 + 3, pytest.approx(0.13)]   # 1 + 3 tokens emitted in 0.13 s
    assert live.plain_seconds(1) == pytest.approx(0.05)               # the verify step is not a plain one
    observe(eng, [r], FakeRecord(1, 2, 0.3, hits, spec_refed=1))     # a kept token fed again: not plain either
    assert live.plain_seconds(1) == pytest.approx(0.05) and live.rate.by_batch[1][0] == 3
    assert live.drafted == [6, 0.3] and live.draft_cost(0.05, 2).fraction == pytest.approx(1.0)
    r.spec_drafted, r.spec_accepted, r.finished = 4, 3, True          # one more draft kept, then it finished
    observe(eng, [r], FakeRecord(1, 2, 0.05, hits, spec_drafted=1, spec_accepted=1))
    assert 0 not in live.trackers and 0 not in live.seen


def test_the_unpriced_part_of_a_verify_step_is_learned():
    """A verify step that took longer than the plain step + the priced extra: the rest is charged to later
    candidates, and the rule stops drafting when it no longer pays."""
    from runtime.engine.spec_cost import observe
    live = _live()
    eng = _engine(live, (range(8), {0, 1}))
    r = FakeCounted(0, ROUTING)
    assert choose_k(eng, [r], 2) == [2]                              # as by hand above
    assert live.last.k == 2 and live.last.priced_extra == pytest.approx(0.0115)
    r.spec_drafted, r.spec_accepted = 2, 2
    hits = {"device": 3, "host": 1, "disk": 0}
    eng.store.placement.pools[0].resident = {0, 1, 2, 3}               # a full tier: a warm step
    observe(eng, [r], FakeRecord(1, 3, 0.2, hits, spec_drafted=2, spec_accepted=2))
    # 0.2 s - 0.05 (plain) - 0.0115 (priced) - 0 (ngram drafts) = 0.1385 s unpriced at k = 2
    assert live.residual == {2: [1, pytest.approx(0.1385)]}
    inp = spec_inputs(eng, [r], 2)
    # k = 1 is charged k = 2's residual (the nearest measured): 0.05 + 0.007 + 0.1385
    assert inp.verify_seconds == pytest.approx((0.05, 0.1955, 0.2))
    assert choose_k(eng, [r], 2) == [0]                              # 1.85 - 20 x 0.1955 < 0
    assert live.residual_for(0) == 0.0 and live.residual_for(5) == pytest.approx(0.1385)
