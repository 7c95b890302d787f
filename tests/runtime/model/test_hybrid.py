"""Hybrid execution live: experts computed on the host from their host slot change no output,
move no bytes for those experts, and the recorded trace replays to the same decisions."""
import json

import numpy as np
import pytest
import torch

from cache_policy.replay import ReplayConfig, replay_batch
from runtime.engine import Engine, SamplingParams
from runtime.model import MoEConfig, load_model
from runtime.model.layers.experts import HostWorker, TorchExperts
from runtime.store import Manifest

PROMPTS = [(5, 1), (9, 2), (3, 3)]


def as_on_cuda(model, store) -> None:
    """The backends a CUDA build picks, on this CPU: every layer composed (the fused decode is a CPU
    backend) and the reference expert path with a HostWorker computing the host experts beside it - so
    the worker's gather, compute and scatter run here."""
    ex = model.executor
    ex.backend = TorchExperts(ex, HostWorker(ex, store))
    for layer in model.layers:
        layer.forward = layer.composed


def _run(store_dir, budget, batch=3, worker=False, **kw):
    model, store = load_model(store_dir, expert_budget=budget, scope="global", **kw)
    if worker:
        as_on_cuda(model, store)
    try:
        eng = Engine(model, store, max_batch=batch, prefill_chunk=1)
        ids = [eng.add_request(torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(s)).tolist(),
                               SamplingParams(max_tokens=10, ignore_eos=True)) for n, s in PROMPTS]
        eng.run()
        return [eng.done[i].output for i in ids], eng.summary(), store.snapshot(), eng.trace()
    finally:
        store.close()


@pytest.mark.slow
def test_outputs_identical_and_no_copies_for_host_experts(hf_model):
    name, ref, hf_dir, store_dir = hf_model
    m = Manifest.read(store_dir)
    k = MoEConfig.from_hf(store_dir).top_k
    slots = max(k, m.num_layers * m.num_experts // 10)
    resident, _, _, _ = _run(store_dir, None)
    moved, s_moved, snap_moved, _ = _run(store_dir, slots * m.blob_stride)
    # cpu profile (this machine): computing from host memory always beats copying into the stand-in slab.
    auto, s_auto, snap_auto, _ = _run(store_dir, slots * m.blob_stride, cpu_experts="auto", profile="cpu")
    first, _, snap_first, _ = _run(store_dir, slots * m.blob_stride, cpu_experts="1")
    # The CUDA path: host experts' rows gathered, computed by a CPU worker beside the rest, scattered back.
    worker, _, snap_worker, _ = _run(store_dir, slots * m.blob_stride, worker=True, cpu_experts="auto", profile="cpu")
    assert moved == resident and auto == resident and first == resident and worker == resident, name
    assert snap_worker["computed"]["host"] > 0 and snap_worker["host_compute_seconds"] > 0
    need = sum(s_auto["hits"].values())
    assert snap_auto["computed"] == {"device": 0, "host": need}
    assert snap_auto["bytes"]["host_to_device"] == 0 and snap_auto["hits"]["device"] == 0
    assert snap_moved["computed"]["host"] == 0 and snap_moved["bytes"]["host_to_device"] > 0
    # --cpu-experts 1: the first MoE layer never takes a device slot and never crosses the link.
    assert snap_first["layer_hits"][0][0] == 0 and snap_first["computed"]["host"] == sum(snap_first["layer_hits"][0])


@pytest.mark.parametrize("batch,policy", [(1, "lru"), (3, "reuse")])
def test_live_hybrid_decisions_equal_replay(hf_model, batch, policy, tmp_path):
    """A GPU-node-like profile where moving an expert and computing it on the host cost about the
    same, so the decision is mixed (some moved, some on the host): replaying the recorded trace
    with the same profile makes the same decisions."""
    name, ref, hf_dir, store_dir = hf_model
    m = Manifest.read(store_dir)
    k = MoEConfig.from_hf(store_dir).top_k
    slots = max(k, m.num_layers * m.num_experts // 4)
    params = sum(int(np.prod(w.shape)) for w in m.weights)
    link_us = m.blob_bytes / 1e9 * 1e6                    # 1 GB/s
    prof = tmp_path / "balanced.json"
    prof.write_text(json.dumps({
        "name": "balanced", "host_to_device_GBps_by_copy_MiB": {"1": 1.0}, "disk_to_host_GBps": 1.0,
        "expert_compute_us_by_tokens": {"1": link_us / 20, "8": link_us / 10},
        "host_expert_compute_us_by_tokens": {"1": link_us * 1.1, "8": link_us * 3},
        "host_concurrent": True, "reference_expert": {"params": params}}))
    _, s, snap, tr = _run(store_dir, slots * m.blob_stride, batch=batch, cpu_experts="auto", profile=str(prof),
                          policy=policy)
    r = replay_batch(tr, ReplayConfig(policy=policy, scope="global", device_capacity=str(slots), cpu_experts="auto",
                                      profile=str(prof)), batch)
    assert r["hits"]["device"] == snap["hits"]["device"], name
    assert r["host_compute"]["experts"] == snap["computed"]["host"], name
    assert r["accesses"] == sum(snap["computed"].values())
    if k == 1 and batch == 1:     # one expert a layer at a time (Llama 4's top-1): moving it is always the cheaper
        assert snap["computed"]["host"] == 0 and snap["bytes"]["host_to_device"] > 0, name
        return
    assert 0 < snap["computed"]["host"] and snap["bytes"]["host_to_device"] > 0, "the decision should be mixed"
