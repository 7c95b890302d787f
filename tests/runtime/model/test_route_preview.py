"""Lookahead prefetch predicts with the model's own router: for every architecture, the preview of a
MoE layer on a hidden state equals the routing that layer's forward chose for that hidden state
(correction-bias names, router biases and group-limited top-k included)."""
import torch

from runtime.engine import Engine, SamplingParams
from runtime.model import Sequence, StepHooks, load_model
from helpers import feed


def test_route_preview_equals_the_layers_routing(hf_model):
    name, ref, hf_dir, store_dir = hf_model
    model, store = load_model(store_dir)
    try:
        # The dense-name table convert reads is the layers' own declaration: every tensor it lists
        # was taken by a layer (one not taken would stay here; one not listed fails the load).
        assert model.unused == [], (name, model.unused)
        routed, inputs = {}, {}
        hooks = StepHooks(record=lambda m, ids: routed.__setitem__(m, ids.clone()),
                          routed=lambda m, used, x: inputs.__setitem__(m, x.clone()))
        s = Sequence()
        for chunk in ([5, 17, 3, 60, 2, 9], [11]):          # a prefill chunk, then a decode step
            routed.clear(), inputs.clear()
            feed(model, [s], [chunk], hooks)
            assert sorted(routed) == sorted(inputs) == list(range(model.cfg.num_moe_layers)), name
            for m in routed:
                assert torch.equal(model.route_preview(m, inputs[m]), routed[m]), (name, m)
    finally:
        store.close()


def test_lookahead_engine_runs_and_changes_no_token(hf_model):
    name, ref, hf_dir, store_dir = hf_model
    outs = []
    for prefetch in ("none", "lookahead"):
        model, store = load_model(store_dir)
        try:
            eng = Engine(model, store, max_batch=2, prefetch=prefetch, prefetch_rule="always")
            ids = [eng.add_request(p, SamplingParams(max_tokens=6, ignore_eos=True)) for p in ([5, 17, 3], [9, 2])]
            eng.run()
            outs.append([eng.done[i].output for i in ids])
            if prefetch == "lookahead":
                assert eng.summary()["prefetch"]["precision"] is not None, name
        finally:
            store.close()
    assert outs[0] == outs[1], name


def test_the_routed_hook_fires_before_the_layers_experts_compute(hf_model):
    """The next layer's prefetch is issued from ``StepHooks.routed``: it must fire as soon as a MoE layer has
    routed and asked for its experts, before any of them computes (so the loads overlap that compute) - in
    prefill and in decode, fused or composed. Every expert computation (the host kernel's calls, the reference
    path's per-expert FFN) is logged beside the hook's calls."""
    name, ref, hf_dir, store_dir = hf_model
    model, store = load_model(store_dir)
    try:
        events = []
        ex = model.executor
        spied = [(ex, "ffn")] + ([(ex.kernel, "run"), (ex.kernel, "run_step")] if ex.kernel is not None else [])
        for obj, attr in spied:
            orig = getattr(obj, attr)
            setattr(obj, attr, lambda *a, _o=orig, **k: (events.append("compute"), _o(*a, **k))[1])
        hooks = StepHooks(routed=lambda m, used, x: events.append(m))
        s = Sequence()
        for chunk in ([5, 17, 3, 60, 2, 9], [11], [12]):
            events.clear()
            feed(model, [s], [chunk], hooks)
            layers = [e for e in events if e != "compute"]
            assert layers == list(range(model.cfg.num_moe_layers)), name
            # each layer's hook, then that layer's expert computations, then the next layer's hook
            marks = [i for i, e in enumerate(events) if e != "compute"]
            assert marks[0] == 0, (name, events)
            for a, b in zip(marks, marks[1:] + [len(events)]):
                assert b - a > 1, (name, events)          # at least one computation after each hook, before the next
    finally:
        store.close()
