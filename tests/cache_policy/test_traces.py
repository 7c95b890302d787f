import numpy as np
import pytest

import oracle
from cache_policy.traces import Trace, build_groups, continuous_batches, load_trace, reuse_distances, trace_stats


def mk(ids=None, so=None, E=8, **kw):
    ids = np.array([[[0, 1]], [[2, 3]], [[1, 4]]]) if ids is None else ids
    so = np.array([0, 2, 3]) if so is None else so
    return Trace(ids=ids, seq_offsets=so, num_experts=E, **kw)


def test_valid_trace_properties():
    t = mk()
    assert (t.num_tokens, t.num_layers, t.top_k, t.num_sequences) == (3, 1, 2, 2)


@pytest.mark.parametrize("kwargs,msg", [
    (dict(E=4), r"expert id 4 >= num_experts 4 \(first at token 2, layer 0"),
    (dict(ids=np.array([[0, 1], [2, 3]])), "3-d array"),
    (dict(ids=np.array([[[0, 0]], [[2, 3]], [[1, 4]]])), "same expert twice"),
    (dict(ids=np.array([[[0, -1]], [[2, 3]], [[1, 4]]])), "negative expert id"),
    (dict(ids=np.array([[[0.0, 1.0]]]), so=np.array([0, 1])), "integers"),
    (dict(so=np.array([0, 2])), "does not cover the trace"),
    (dict(so=np.array([1, 2, 3])), "does not cover the trace"),
    (dict(so=np.array([0, 2, 2, 3])), "strictly increasing"),
    (dict(weights=np.ones((3, 1, 3))), r"'weights' shape \(3, 1, 3\) does not match"),
    (dict(weights=np.full((3, 1, 2), np.nan)), "NaN"),
    (dict(layer_numbers=np.arange(2)), "layer_numbers"),
    (dict(E=0), "positive integer"),
])
def test_bad_traces_are_refused_with_a_clear_message(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        mk(**kwargs)


def test_load_errors_name_the_file(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_trace(str(tmp_path / "nope.npz"))
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="bad.npz: not a readable"):
        load_trace(str(bad))
    part = tmp_path / "part.npz"
    np.savez(part, ids=np.zeros((2, 1, 1), dtype=np.uint8))
    with pytest.raises(ValueError, match="missing array\\(s\\) seq_offsets, num_experts"):
        load_trace(str(part))
    rag = tmp_path / "ragged.npz"
    np.savez(rag, ids=np.zeros((4, 2, 1), dtype=np.uint8), seq_offsets=np.array([0, 3]), num_experts=4)
    with pytest.raises(ValueError, match="ragged.npz: 'seq_offsets' must start at 0 and end at the token count 4"):
        load_trace(str(rag))


def test_save_load_roundtrip(tmp_path):
    t = mk(weights=np.random.default_rng(0).random((3, 1, 2)).astype(np.float32), model="m")
    p = str(tmp_path / "t.npz")
    t.save(p)
    u = load_trace(p)
    assert np.array_equal(u.ids, t.ids) and np.array_equal(u.seq_offsets, t.seq_offsets)
    assert np.allclose(u.weights, t.weights) and u.model == "m" and u.num_experts == 8


def test_shared_traces_load(deepseek_trace, flame_trace):
    assert deepseek_trace.ids.shape == (94165, 26, 6) and deepseek_trace.num_sequences == 999
    assert flame_trace.weights is not None and flame_trace.num_layers == 8


@pytest.mark.parametrize("batch", [1, 2, 3, 7, 50])
def test_continuous_batching_matches_slot_simulation(batch, flame_trace):
    tr = flame_trace.subset(range(0, 32, 3))
    lens = [5, 9, 2, 7, 7, 1, 4, 12, 3, 6, 8]
    ids = np.concatenate([tr.ids[tr.seq_offsets[i]:tr.seq_offsets[i] + n] for i, n in enumerate(lens)])
    t = Trace(ids=ids, seq_offsets=np.concatenate([[0], np.cumsum(lens)]), num_experts=64)
    want = oracle.groups_of(t, batch)
    g = build_groups(t, continuous_batches(t.seq_offsets, batch))
    got = []
    for gi in range(len(g.ptr) - 1):
        step, layer = divmod(gi, t.num_layers)
        got.append((step, layer, [int(k) - layer * 64 for k in g.keys[g.ptr[gi]:g.ptr[gi + 1]]]))
    assert got == want
    sched = continuous_batches(t.seq_offsets, batch)
    assert sched.batch_sizes().max() <= batch and sched.batch_sizes().sum() == t.num_tokens


def test_group_counts_and_weights():
    ids = np.array([[[0, 1]], [[1, 2]]])
    w = np.array([[[0.5, 0.25]], [[0.75, 1.0]]], dtype=np.float32)
    t = Trace(ids=ids, seq_offsets=np.array([0, 1, 2]), num_experts=4, weights=w)
    g = build_groups(t, continuous_batches(t.seq_offsets, 2))
    assert g.keys.tolist() == [0, 1, 2] and g.count.tolist() == [1, 2, 1]
    assert np.allclose(g.weight, [0.5, 1.0, 1.0])


def test_reuse_distance_against_brute_force(flame_trace):
    tr = flame_trace.subset(range(4))
    rd = reuse_distances(tr)
    want = []
    T, L, k = tr.ids.shape
    seen = {}
    events = sorted(((t, l, int(e)) for t in range(T) for l in range(L) for e in tr.ids[t, l]), key=lambda x: (x[1], x[2], x[0]))
    for t, l, e in events:
        if (l, e) in seen:
            want.append(t - seen[(l, e)])
        seen[(l, e)] = t
    assert sorted(rd.tolist()) == sorted(want)


def test_stats_on_a_known_trace():
    ids = np.array([[[0, 1]], [[0, 1]], [[0, 2]], [[0, 3]]])
    s = trace_stats(Trace(ids=ids, seq_offsets=np.array([0, 4]), num_experts=10))
    assert s["tokens"] == 4 and s["accesses"] == 8 and s["top_k"] == 2
    # top 10% of 10 experts = expert 0, used by every token: 4 of 8 accesses.
    assert s["top10pct_share_mean"] == pytest.approx(0.5)
    # token 1 reuses both of token 0's experts, token 2 one of two, token 3 one of two: 4/6.
    assert s["persistence"] == pytest.approx(4 / 6)
    assert s["experts_never_used"] == 6


def test_batch1_groups_carry_each_tokens_weights(flame_trace):
    tr = flame_trace.subset(range(2))
    g = build_groups(tr, continuous_batches(tr.seq_offsets, 1))
    k, E = tr.top_k, tr.num_experts
    for gi in (0, 5, 77, len(g.ptr) - 2):
        t, layer = divmod(gi, tr.num_layers)
        tok = continuous_batches(tr.seq_offsets, 1).tokens[t]
        want = sorted(zip(tr.ids[tok, layer].tolist(), tr.weights[tok, layer].tolist()))
        got = list(zip((g.keys[g.ptr[gi]:g.ptr[gi + 1]] - layer * E).tolist(), g.weight[g.ptr[gi]:g.ptr[gi + 1]].tolist()))
        assert [e for e, _ in got] == [e for e, _ in want]
        assert np.allclose([w for _, w in got], [w for _, w in want])
        assert g.count[g.ptr[gi]:g.ptr[gi + 1]].tolist() == [1] * k
