"""``tiered-moe plan`` (runtime/plan.py): the memory split adds up to the budget to the byte, and it is the
split load_model makes of the same budget (one truth), for one rank and for tensor-parallel ranks."""
import json

import pytest
import torch

from runtime.model import load_model
from runtime.model.config import MoEConfig
from runtime.model.convert import convert
from runtime.model.synthetic import SyntheticModelSpec, build_checkpoint
from runtime.parallel.group import Rank
from runtime.parallel.shard import Shard, plan as shard_plan
from runtime.plan import cache_bytes, device_split, plan_layouts


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    d = tmp_path_factory.mktemp("plan")
    spec = SyntheticModelSpec(num_layers=4, num_experts=16, hidden_size=64, intermediate_size=128, num_heads=4,
                              num_kv_heads=2, vocab_size=96)
    build_checkpoint(str(d / "hf"), spec)
    convert(str(d / "hf"), str(d / "fp32"))
    convert(str(d / "hf"), str(d / "mxfp4"), quantize="mxfp4")
    return {"hf": str(d / "hf"), "fp32": str(d / "fp32"), "mxfp4": str(d / "mxfp4")}


def test_the_split_adds_up_to_the_budget_to_the_byte(stores):
    budget = 3 * 2 ** 20 + 12345
    p = plan_layouts(stores["fp32"], gpus=4, context=300, batch=3, budget=budget)
    assert {st[0]["layout"] for st in p["layouts"]} == {"TP1xPP4", "TP2xPP2", "TP4"}
    for stages in p["layouts"]:
        for st in stages:
            s = st["split"]
            assert s["dense"] + s["cache"] + s["expert_slots"] * s["slot_bytes"] + s["left"] == budget == s["budget"]
            assert 0 <= s["left"] and (s["left"] < s["slot_bytes"] or s["all_resident"])
    assert p["recommended"] in {st[0]["layout"] for st in p["layouts"]}


@pytest.mark.parametrize("tp", [1, 2])
def test_load_model_makes_the_planned_split(stores, tp):
    """The same budget through load_model (rank 0 of ``tp``): its dense weights, cache reservation and expert
    slots are the plan's."""
    store = stores["fp32"]
    budget = 2 * 2 ** 20
    p = plan_layouts(store, gpus=tp, context=200, batch=2, budget=budget)
    st = next(s[0] for s in p["layouts"] if s[0]["layout"] == f"TP{tp}")
    sp = st["split"]
    rank = None
    if tp > 1:
        rank = Rank(rank=0, world=tp, tp=tp, plan=shard_plan(MoEConfig.from_hf(store), Shard(0, tp)))
    model, s = load_model(store, device_budget=budget, kv_cache_bytes=sp["cache"], max_batch=2, rank=rank)
    try:
        dense = sum(t.numel() * t.element_size() for t in _dense_tensors(model))
        assert dense == sp["dense"]
        assert s.capacity_bytes()["device"] == sp["expert_slots"] * sp["slot_bytes"]
        assert s.m.blob_stride == sp["slot_bytes"]
        assert cache_bytes(model.cfg, model.dtype, 200, 2) == sp["cache"]
        kv = model.init_kv(sp["cache"], max_seqs=2)
        assert kv.num_blocks * kv.block_size >= 2 * 200           # the reservation holds the planned context
    finally:
        s.close()


def _dense_tensors(model):
    """Every dense tensor the model holds (weights of its layers, embeddings, head)."""
    seen, out = set(), []

    def add(t):
        if isinstance(t, torch.Tensor) and id(t) not in seen and t.numel():
            seen.add(id(t))
            out.append(t)

    def walk(o, depth=0):
        if depth > 4 or o is None:
            return
        if isinstance(o, torch.Tensor):
            add(o)
        elif isinstance(o, (list, tuple)):
            for x in o:
                walk(x, depth + 1)
        elif hasattr(o, "__dict__") and type(o).__module__.startswith("runtime.model"):
            for k, v in vars(o).items():
                if k not in ("cfg", "store", "executor", "experts", "rope", "kv", "codec"):
                    walk(v, depth + 1)
    for layer in model.layers:
        walk(layer)
    add(model.embed)
    walk(model.norm)
    if model.head is not None:
        walk(model.head)
    return out


def test_config_only_plans_like_the_converted_store(stores):
    """Planning from config.json alone (before converting): the experts' blob as the converted store's."""
    from runtime.plan import model_shape
    _, m_hf, meta, what = model_shape(stores["hf"], "mxfp4")
    _, m_store, meta_store, _ = model_shape(stores["mxfp4"])
    assert "config.json only" in what
    assert (m_hf.blob_bytes, m_hf.blob_stride) == (m_store.blob_bytes, m_store.blob_stride)
    assert {n: t.shape for n, t in meta.items()} == {n: t.shape for n, t in meta_store.items()}
    with pytest.raises(ValueError, match="drop --expert-format"):
        model_shape(stores["mxfp4"], "int4")


def test_device_split_refuses_a_budget_without_room():
    with pytest.raises(ValueError, match="cannot hold the dense weights"):
        device_split(1000, 600, 300, 200, 10)
    s = device_split(10_000, 600, 300, 200, 10)
    assert s.expert_slots == 10 and s.all_resident and s.left == 10_000 - 600 - 300 - 2000


def test_device_budget_auto(stores):
    """--device-budget auto without CUDA: the profile's GPU at 90%, the cache for max_batch sequences."""
    from runtime.config import RuntimeConfig
    cfg = RuntimeConfig(model=stores["fp32"], device_budget="auto", max_batch=2)
    model, s = cfg.load()
    try:
        mc = MoEConfig.from_hf(stores["fp32"])
        assert model.kv_bytes == cache_bytes(mc, model.dtype, min(mc.max_position_embeddings, 8192), 2)
        assert s.capacity_bytes()["device"] == s.m.num_layers * s.m.num_experts * s.m.blob_stride   # all fit
    finally:
        s.close()
    with pytest.raises(ValueError, match="give bytes or auto"):
        RuntimeConfig(model=stores["fp32"], device_budget="lots")


def test_plan_command(stores, capsys):
    from runtime.cli import main
    assert main(["plan", "--model", stores["fp32"], "--gpus", "2", "--context", "256", "--batch", "4",
                 "--gpu-memory", "4MiB"]) == 0
    out = capsys.readouterr().out
    assert "recommended:" in out and "TP2" in out and "TP1xPP2" in out
    assert main(["plan", "--model", stores["fp32"], "--gpus", "2", "--context", "256", "--batch", "4", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["gpus"] == 2 and d["layouts"]
    assert main(["plan", "--model", stores["fp32"], "--gpus", "2", "--context", "256", "--batch", "4",
                 "--gpu-memory", "1KiB"]) == 2
    assert "no layout of 2 GPU(s)" in capsys.readouterr().err


def test_step_dense_bytes_counts_what_a_step_reads(stores):
    """Bytes read per decode step, counted by hand from the checkpoint's own tensors: every non-expert tensor
    but the embedding table (a row per token; the head is untied here) at the compute dtype; two stages
    split them, each stage its layers', the last the norm and head; tensor parallelism halves the split ones."""
    from safetensors import safe_open
    import glob
    import os
    from runtime.parallel.shard import shard_dense, stage_layers
    from runtime.plan import dense_shapes, step_dense_bytes
    cfg = MoEConfig.from_hf(stores["fp32"])
    meta = dense_shapes(stores["fp32"])
    per_layer, top, attn = {}, 0, 0
    for f in glob.glob(os.path.join(stores["hf"], "*.safetensors")):
        with safe_open(f, framework="pt") as fh:
            for n in fh.keys():
                if ".experts." in n or n == "model.embed_tokens.weight":
                    continue
                b = fh.get_slice(n).get_shape()
                nb = 4 * int(torch.tensor(b).prod()) if b else 4
                if n.startswith("model.layers."):
                    i = int(n.split(".")[2])
                    per_layer[i] = per_layer.get(i, 0) + nb
                    attn += nb if ".self_attn." in n and n.endswith("_proj.weight") else 0
                else:
                    top += nb
    everything = step_dense_bytes(cfg, meta, torch.float32, set(range(cfg.num_layers)), True, True)
    assert everything == sum(per_layer.values()) + top
    halves = []
    for s in range(2):
        (lo, hi), _ = stage_layers(cfg, 2, s)
        halves.append(step_dense_bytes(cfg, meta, torch.float32, set(range(lo, hi)), s == 0, s == 1))
        assert halves[-1] == sum(per_layer[i] for i in range(lo, hi)) + (top if s == 1 else 0)
    rank = shard_dense(cfg, shard_plan(cfg, Shard(1, 2)), dict(meta))
    tp2 = step_dense_bytes(cfg, rank, torch.float32, set(range(cfg.num_layers)), True, True)
    assert tp2 == everything - attn // 2      # q/k/v/o by heads (4 heads, 2 kv heads); the rest whole per rank
