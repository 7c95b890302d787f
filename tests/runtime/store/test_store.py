"""The live store: real files, real slots, the same placement as replay."""
import json
import os

import numpy as np
import pytest
import torch

from cache_policy.replay import ReplayConfig, replay_batch
from cache_policy.traces import Trace
from runtime.quant import WeightSpec
from runtime.store import ChecksumError, ExpertLoadError, ExpertStore, Manifest, StoreWriter

L, E, H, I = 3, 8, 16, 24


def expert_tensors(layer, expert):
    g = torch.Generator().manual_seed(layer * 1000 + expert)
    return {"gate": torch.randn(I, H, generator=g), "up": torch.randn(I, H, generator=g),
            "down": torch.randn(H, I, generator=g).to(torch.bfloat16)}


@pytest.fixture
def store_dir(tmp_path):
    d = str(tmp_path / "store")
    w = StoreWriter(d, model="tiny", num_layers=L, num_experts=E,
                    weights=[WeightSpec("gate", (I, H), "fp32"), WeightSpec("up", (I, H), "fp32"), WeightSpec("down", (H, I), "bf16")])
    for l in range(L):
        for e in range(E):
            w.write(l, e, expert_tensors(l, e))
    w.close()
    return d


def logical(views):
    """The blob's float parts (stored input-major, ``name.t``) back in [out, in] orientation."""
    return {k[:-2]: v.t() for k, v in views.items()}


def stride(d):
    return Manifest.read(d).blob_stride


def requests(seed, steps=40):
    rng = np.random.default_rng(seed)
    return [[sorted(rng.choice(E, size=2, replace=False, p=np.r_[[0.3, 0.2], [0.5 / (E - 2)] * (E - 2)]).tolist())
             for _ in range(L)] for _ in range(steps)]


def test_layout_is_aligned_and_checksummed(store_dir):
    m = Manifest.read(store_dir)
    assert m.blob_stride % 4096 == 0 and m.blob_bytes <= m.blob_stride
    assert [t.name for t in m.tensors] == ["gate.t", "up.t", "down.t"]
    assert m.formats == {"gate": "fp32", "up": "fp32", "down": "bf16"}
    assert os.path.getsize(os.path.join(store_dir, "layer-000.bin")) == E * m.blob_stride


@pytest.mark.parametrize("host_slots", [None, 6])
@pytest.mark.parametrize("scope,dev_slots", [("global", 4), ("layer", 2)])
def test_bytes_are_exact_and_hits_match_replay(store_dir, host_slots, scope, dev_slots):
    s = stride(store_dir)
    dev_budget = dev_slots * s * (L if scope == "layer" else 1)
    host_budget = None if host_slots is None else host_slots * s * (L if scope == "layer" else 1)
    reqs = requests(1)
    with ExpertStore(store_dir, device_budget=dev_budget, host_budget=host_budget, policy="lru", scope=scope,
                     min_experts_per_layer=2) as st:
        assert st.device_is_stand_in
        for t, step in enumerate(reqs):
            for layer, experts in enumerate(step):
                f = st.request(layer, experts, t)
                for e in f.ready + list(f.pending):
                    got = logical(f.tensors(e))
                    want = expert_tensors(layer, e)
                    for name in want:
                        assert torch.equal(got[name], want[name]), (t, layer, e, name)
                rb, cb = st.resident_bytes(), st.capacity_bytes()
                assert rb["device"] <= cb["device"] and rb["host"] <= cb["host"]
            st.end_step()
        stats = st.stats
    # The same accesses as a trace, replayed with the same policy and capacities.
    ids = np.array(reqs, dtype=np.int64)              # ids: [steps, L, 2]
    tr = Trace(ids=ids, seq_offsets=np.array([0, len(reqs)]), num_experts=E)
    r = replay_batch(tr, ReplayConfig(policy="lru", scope=scope, device_capacity=str(dev_slots),
                                      host_capacity=None if host_slots is None else str(host_slots)), 1)
    assert stats.hits["device"] == r["hits"]["device"]
    assert stats.hits["host"] == r["hits"]["host"]
    assert stats.hits["disk"] == r["hits"]["disk"]
    if host_slots is not None:
        assert stats.hits["disk"] > 0


def test_prefetch_makes_hits_and_never_evicts_the_current_layer(store_dir):
    s = stride(store_dir)
    with ExpertStore(store_dir, device_budget=4 * s, scope="global", min_experts_per_layer=2) as st:
        f = st.request(0, [0, 1], 0)
        f.wait()
        assert st.prefetch(1, [5, 6, 7], 0, protect=[0, 1]) == 2     # room for two besides layer 0's
        resident = st.placement.device[0].resident
        assert {0, 1} <= resident
        f = st.request(1, [5, 6], 0)
        f.wait()
        assert st.stats.hits["device"] == 2
        assert torch.equal(logical(f.tensors(5))["gate"], expert_tensors(1, 5)["gate"])
    # protect names the computing layer's experts (layer - 1 of the prefetched one), whatever layer that is
    with ExpertStore(store_dir, device_budget=4 * s, scope="global", min_experts_per_layer=2) as st:
        E = st.m.num_experts
        st.request(0, [3, 4], 0).wait()
        st.request(1, [0, 1], 0).wait()
        assert st.prefetch(2, [5, 6, 7], 1, protect=[0, 1]) == 2     # layer 0's two make room, layer 1's stay
        assert {E + 0, E + 1} <= st.placement.device[1].resident


def test_corrupt_blob_names_layer_and_expert(store_dir):
    m = Manifest.read(store_dir)
    path = os.path.join(store_dir, "layer-002.bin")
    with open(path, "r+b") as f:
        f.seek(5 * m.blob_stride + 100)
        b = f.read(1)
        f.seek(5 * m.blob_stride + 100)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(ChecksumError, match="layer 2 expert 5"):
        ExpertStore(store_dir, device_budget=4 * m.blob_stride)
    st = ExpertStore(store_dir, device_budget=4 * m.blob_stride, host_budget=6 * m.blob_stride)
    try:
        with pytest.raises(ExpertLoadError, match="layer 2 expert 5: .*checksum mismatch for layer 2 expert 5"):
            st.request(2, [5], 0).wait()
        assert st.stats.reread == 1 and st.stats.load_errors == 1       # read twice, then given up
        # dropped from every tier: the next request reads it again (and fails again) - never a "hit" on bad bytes
        assert 2 * m.num_experts + 5 not in st.dev.slot_of and 5 not in st.resident(2)
        with pytest.raises(ExpertLoadError):
            st.request(2, [5], 1).wait()
        assert st.stats.hits["device"] == 0
        # repaired on disk: read afresh, correct bytes
        with open(path, "r+b") as f:
            f.seek(5 * m.blob_stride + 100)
            f.write(b)
        f = st.request(2, [5], 2)
        assert torch.equal(logical(f.tensors(5))["gate"], expert_tensors(2, 5)["gate"])
    finally:
        st.close()


def test_bad_stores_and_budgets(store_dir, tmp_path):
    s = stride(store_dir)
    with pytest.raises(ValueError, match="minimum is"):
        ExpertStore(store_dir, device_budget=s, min_experts_per_layer=2)
    with pytest.raises(ValueError, match="tiers are inclusive"):
        ExpertStore(store_dir, device_budget=4 * s, host_budget=2 * s)
    with pytest.raises(ValueError, match="does not exist"):
        ExpertStore(str(tmp_path / "nope"), device_budget=s)
    with pytest.raises(ValueError, match="no manifest.json"):
        ExpertStore(str(tmp_path), device_budget=s)
    with pytest.raises(ValueError, match="needs a trace"):
        ExpertStore(store_dir, device_budget=4 * s, policy="belady")
    mpath = os.path.join(store_dir, "manifest.json")
    d = json.load(open(mpath))
    json.dump({**d, "version": 99}, open(mpath, "w"))
    with pytest.raises(ValueError, match="store version 99"):
        Manifest.read(store_dir)
    json.dump(d, open(mpath, "w"))
    with open(os.path.join(store_dir, "layer-001.bin"), "r+b") as f:
        f.truncate(3 * s)
    with pytest.raises(ValueError, match="layer-001.bin: .* truncated"):
        Manifest.read(store_dir)


def test_request_errors(store_dir):
    s = stride(store_dir)
    with ExpertStore(store_dir, device_budget=2 * s, min_experts_per_layer=2) as st:
        with pytest.raises(ValueError, match=r"expert ids must be in \[0, 8\)"):
            st.request(0, [9], 0)
        with pytest.raises(ValueError, match="layer 7 out of range"):
            st.request(7, [1], 0)
    with ExpertStore(store_dir, device_budget=2 * s, host_budget=4 * s, min_experts_per_layer=2) as st:
        with pytest.raises(ValueError, match="waves need a host tier that holds every expert"):
            st.request(0, [1, 2, 3], 0)


def test_waves_when_a_layer_needs_more_than_the_device_tier(store_dir):
    s = stride(store_dir)
    with ExpertStore(store_dir, device_budget=3 * s, min_experts_per_layer=2) as st:
        st.request(0, [0, 1], 0).wait()
        f = st.request(0, [0, 2, 3, 4, 5, 6, 7], 1)
        seen = []
        for wave in f.waves():
            assert len(wave) <= 3
            for e in wave:
                assert torch.equal(logical(f.tensors(e))["up"], expert_tensors(0, e)["up"])
                seen.append(e)
            assert st.resident_bytes()["device"] <= 3 * s
        assert sorted(seen) == [0, 2, 3, 4, 5, 6, 7]
        assert st.stats.waves == 2 and st.stats.hits["device"] == 1


def test_writer_refuses_wrong_tensors(tmp_path):
    w = StoreWriter(str(tmp_path / "s"), model="m", num_layers=1, num_experts=2, weights=[WeightSpec("w", (2, 2), "fp32")])
    with pytest.raises(ValueError, match=r"layer 0 expert 1: w: fp32 part 't' is \(2, 3\) torch.float32, expected \(2, 2\)"):
        w.write(0, 1, {"w": torch.zeros(3, 2)})
    with pytest.raises(ValueError, match="layer 0 expert 0: weight 'w' is missing"):
        w.write(0, 0, {"v": torch.zeros(2, 2)})
    w.write(0, 0, {"w": torch.zeros(2, 2)})
    with pytest.raises(ValueError, match="never written"):
        w.close()


def test_host_computed_experts_are_views_of_the_host_slot_and_move_nothing(store_dir):
    with ExpertStore(store_dir, device_budget=4 * stride(store_dir), cpu_experts="auto", profile="cpu") as st:
        f = st.request(1, [2, 5], 0, counts=[1, 3])
        assert f.host == {2, 5} and f.on_host(2) and not f.pending
        for e in (2, 5):
            got = logical(f.tensors(e))
            want = expert_tensors(1, e)
            for k in want:
                assert torch.equal(got[k].to(want[k].dtype), want[k])
            assert f.tensors(e)["gate.t"].data_ptr() != 0
        assert st.stats.bytes["host_to_device"] == 0 and st.stats.computed == {"device": 0, "host": 2}
        assert st.resident(1) == []
    with pytest.raises(ValueError, match="neither 'auto' nor a number"):
        ExpertStore(store_dir, device_budget=4 * stride(store_dir), cpu_experts="most")
    with pytest.raises(ValueError, match=f"the model has {L} MoE layers"):
        ExpertStore(store_dir, device_budget=4 * stride(store_dir), cpu_experts=str(L + 1))


def test_prefetches_not_started_when_their_layer_runs_are_cancelled(store_dir):
    import threading
    with ExpertStore(store_dir, device_budget=6 * stride(store_dir), threads=2) as st:
        gate = threading.Event()
        st.prefetch_pool.submit(gate.wait)              # the one prefetch worker is busy
        assert st.prefetch(2, [1, 3, 4], 0) == 3
        assert set(st.resident(2)) == {1, 3, 4}
        moved = st.stats.bytes["host_to_device"]
        f = st.request(2, [3, 6], 0)                    # 3 is needed (it waits for its copy); 1 and 4 are not
        assert st.stats.prefetch_cancelled == 2
        assert set(st.resident(2)) == {3, 6}
        assert st.stats.bytes["host_to_device"] == moved - 2 * st.m.blob_bytes + st.m.blob_bytes   # 2 dropped, 6 loaded
        gate.set()
        got = logical(f.tensors(3))
        assert torch.equal(got["gate"], expert_tensors(2, 3)["gate"])


def test_an_expert_is_checked_the_first_time_it_is_read(store_dir, monkeypatch):
    """DiskTier checks an expert's crc32 the first time this process reads it; rereads (a store bigger than memory
    reads its misses again and again) skip it. A read that failed its check is checked again next time."""
    from runtime.store import host_tier
    m = Manifest.read(store_dir)
    calls = []
    real = host_tier.zlib.crc32
    monkeypatch.setattr(host_tier.zlib, "crc32", lambda b: calls.append(1) or real(b))
    disk = host_tier.DiskTier(store_dir, m)
    try:
        buf = np.zeros(m.blob_stride, dtype=np.uint8)
        if disk.mode == "O_DIRECT":                      # O_DIRECT wants an aligned buffer: a slot of a real slab
            buf = host_tier.Slab(1, m.blob_stride, "cpu", pin=False).data[0].numpy()
        disk.read_into(1, 3, buf)
        disk.read_into(1, 3, buf)
        disk.read_into(1, 4, buf)
        assert len(calls) == 2
        path = os.path.join(store_dir, m.layer_file(1))
        with open(path, "r+b") as f:                     # corrupt expert 5: its check fails, every time
            f.seek(5 * m.blob_stride + 7)
            b = f.read(1)
            f.seek(5 * m.blob_stride + 7)
            f.write(bytes([b[0] ^ 0xFF]))
        for _ in range(2):
            with pytest.raises(ChecksumError, match="layer 1 expert 5"):
                disk.read_into(1, 5, buf)
        assert len(calls) == 4
    finally:
        disk.close()


def test_prefetches_wait_for_pending_demand_loads_a_needed_one_is_promoted_an_unneeded_one_dropped(store_dir):
    """mover.DemandFirst: a prefetch issued while a demand load is pending (layer m + 1's prefetch is issued as
    layer m routes, its misses still loading) starts its transfer only when no demand load is pending; a request
    that needs it promotes it; one its layer does not need is dropped while it waits."""
    import threading
    import time
    from runtime.store.mover import Mover
    gate, moved = threading.Event(), []
    E_ = Manifest.read(store_dir).num_experts
    real = Mover.move

    def move(self, key, from_disk, after=None):
        if key == 0 * E_ + 5:                           # layer 0 expert 5: a slow demand load
            assert gate.wait(10)
        moved.append(key)
        return real(self, key, from_disk, after)
    # threads=4: two prefetch workers, so both prefetches are running (waiting for their turn), not queued
    with ExpertStore(store_dir, device_budget=8 * stride(store_dir), threads=4) as st:
        st.mover.move = move.__get__(st.mover)
        f0 = st.request(0, [5], 0)                      # the demand load of 0/5 is pending
        assert st.prefetch(1, [2, 3], 0) == 2
        time.sleep(0.3)
        assert not st.inflight[E_ + 2].done() and not st.inflight[E_ + 3].done(), "a prefetch ran before a demand load"
        assert moved == []
        t0 = time.perf_counter()
        f1 = st.request(1, [2], 1)                      # needs 2 (promoted); 3 is not needed (dropped)
        got = logical(f1.tensors(2))
        assert time.perf_counter() - t0 < 0.5 * st.mover.order.patience, "a needed prefetch waited for its turn"
        assert torch.equal(got["gate"], expert_tensors(1, 2)["gate"])
        assert moved == [E_ + 2] and st.stats.prefetch_cancelled == 1 and set(st.resident(1)) == {2}
        gate.set()
        assert torch.equal(logical(f0.tensors(5))["gate"], expert_tensors(0, 5)["gate"])
        assert moved == [E_ + 2, 5]                    # 3 was never copied
        assert st.prefetch(2, [4], 1) == 1              # nothing pending: a prefetch starts at once
        st.inflight[2 * E_ + 4].result(timeout=5)


def test_a_prefetch_waits_no_longer_than_its_patience():
    import time
    from runtime.store.mover import DemandFirst
    d = DemandFirst(patience=0.1)
    d.submitted()                                       # a demand load that never finishes
    t0 = time.perf_counter()
    assert d.wait_turn(7) is True
    assert 0.09 < time.perf_counter() - t0 < 2
    assert d.drop(7) is False                           # not waiting any more: its transfer runs
