"""Tensor parallelism (runtime/parallel): each rank's slices of the weights, and a real gloo group of 2 and 4
rank processes checked against one process - every architecture's fixture, every expert resident and with
10% of them on the device: logits, 32 greedy tokens, the ranks' residency, the bytes each rank moves."""
import glob
import os

import pytest
import torch

from conftest import ARCHS, build_hf
from runtime.config import RuntimeConfig
from runtime.engine import SamplingParams
from runtime.expert_codec import ExpertCodec
from runtime.model.convert import convert
from runtime.model.synthetic import K3ShapeSpec, SyntheticModelSpec, build_checkpoint, build_k3_checkpoint
from runtime.parallel.shard import Shard, expert_weights, plan, rank_manifest
from runtime.quant import get_format
from runtime.store import ExpertStore, Manifest
from runtime.store.shared import shm_dir
from runtime.model.config import MoEConfig

PROMPTS = [[3, 17, 5, 9, 11, 2, 40, 7], [8, 1, 6]]


# -- slices of one weight ------------------------------------------------------------------------
FORMATS = [("fp32", {}), ("bf16", {}), ("mxfp4", {}), ("int4", {"group": 32, "scale_dtype": "bfloat16"}),
           ("int8", {"group": 32, "scale_dtype": "float16"}), ("fp8_e4m3", {"block": [16, 32]})]


@pytest.mark.parametrize("name,params", FORMATS, ids=[f[0] for f in FORMATS])
def test_a_sliced_weight_decodes_to_the_slice_of_the_weight(name, params):
    """The oracle: dequantize the whole weight, then cut it; the slicer cuts the stored parts instead."""
    fmt = get_format(name, **params)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 128, generator=g)
    parts = fmt.quantize(w)
    whole = torch.empty(64, 128)
    fmt.dequantize(parts, whole)
    for rows, cols in (([(16, 48)], None), ([(0, 16), (32, 48)], None), (None, (32, 96)), ([(16, 32)], (64, 128))):
        sl = fmt.slice_parts((64, 128), parts, rows=rows, cols=cols)
        r = torch.cat([torch.arange(a, b) for a, b in rows]) if rows else torch.arange(64)
        c = torch.arange(*cols) if cols else torch.arange(128)
        out = torch.empty(len(r), len(c))
        fmt.dequantize({k: v.contiguous() for k, v in sl.items()}, out)
        assert torch.equal(out, whole[r][:, c]), (name, rows, cols)


@pytest.mark.parametrize("name,params,cut", [("mxfp4", {}, "blocks of 32"), ("int4", {"group": 32}, "blocks of 32"),
                                             ("fp8_e4m3", {"block": [16, 32]}, "blocks of 16")])
def test_a_cut_through_a_block_is_refused(name, params, cut):
    fmt = get_format(name, **params)
    parts = fmt.quantize(torch.randn(64, 128))
    with pytest.raises(ValueError, match=cut):
        if name == "fp8_e4m3":
            fmt.slice_parts((64, 128), parts, rows=[(8, 24)])
        else:
            fmt.slice_parts((64, 128), parts, cols=(16, 48))


# -- a rank's experts add up to the expert ----------------------------------------------------------
@pytest.fixture(scope="module")
def quant_stores(tmp_path_factory):
    """A mixtral-format checkpoint with intermediate 256 (a multiple of 32 x 4 ranks) as fp32 and in
    every quantized format."""
    d = tmp_path_factory.mktemp("tpq")
    spec = SyntheticModelSpec(num_layers=2, num_experts=8, hidden_size=64, intermediate_size=256, num_heads=4,
                              num_kv_heads=2, vocab_size=96)
    build_checkpoint(str(d / "hf"), spec)
    out = {"fp32": str(d / "fp32")}
    convert(str(d / "hf"), out["fp32"])
    for q in ("mxfp4", "int4", "int8", "fp8"):
        out[q] = str(d / q)
        convert(str(d / "hf"), out[q], quantize=q)
    return out


@pytest.mark.parametrize("fmt", ["fp32", "mxfp4", "int4", "int8", "fp8"])
def test_rank_experts_sum_to_the_whole_expert(quant_stores, fmt):
    """Each rank's expert (its rows of gate / up, its columns of down) on the same input; the ranks'
    outputs summed = the whole expert's output (from the same stored bytes)."""
    from runtime.model.layers.moe_block import ExpertExecutor
    store_dir = quant_stores[fmt]
    cfg = MoEConfig.from_hf(store_dir)
    x = torch.randn(3, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    whole = ExpertStore(store_dir, device_budget=10 ** 9)
    ex = ExpertExecutor(cfg, whole, torch.float32, "cpu")
    want = ex.ffn(ex.codec.weights(whole.slot_views(5, host=True)), x.clone())
    whole.close()
    N = 2 if fmt == "fp8" else 4                       # fp8's 128-row tiles: 256 / 2 ranks, not / 4
    total = torch.zeros_like(want)
    for r in range(N):
        p = plan(cfg, Shard(r, N))
        st = ExpertStore(store_dir, device_budget=10 ** 9, shard=Shard(r, N))
        assert st.m.blob_bytes < whole.m.blob_bytes / N * 1.02 + 128
        exr = ExpertExecutor(p.cfg, st, torch.float32, "cpu")
        total += exr.ffn(exr.codec.weights(st.slot_views(5, host=True)), x.clone())
        st.close()
    assert torch.allclose(total, want, atol=1e-5, rtol=1e-4), (total - want).abs().max()


def test_what_cannot_split_says_so(quant_stores, tmp_path):
    m = Manifest.read(quant_stores["fp8"])
    with pytest.raises(ValueError, match="gate .*fp8_e4m3.*cannot split over 4.*blocks of 128"):
        rank_manifest(m, Shard(0, 4))
    with pytest.raises(ValueError, match="intermediate size 256 does not split over 3"):
        RuntimeConfig(model=quant_stores["fp32"], tensor_parallel=3)
    with pytest.raises(ValueError, match="drop --host-budget"):
        RuntimeConfig(model=quant_stores["fp32"], tensor_parallel=2, host_budget=10 ** 6)
    w = expert_weights(Manifest.read(quant_stores["mxfp4"]).weights, 256, Shard(1, 8))   # 32 per rank: whole blocks
    assert {x.name: x.shape for x in w}["down"] == (64, 32)
    with pytest.raises(ValueError, match="mxfp4.*blocks of 32"):
        expert_weights(Manifest.read(quant_stores["mxfp4"]).weights, 256, Shard(1, 16))


# -- a real group -----------------------------------------------------------------------------------
def _stores(root) -> dict:
    out = {}
    for a in ARCHS:
        d = os.path.join(root, a)
        build_hf(a, os.path.join(d, "hf"))
        convert(os.path.join(d, "hf"), os.path.join(d, "store"))
        out[a] = os.path.join(d, "store")
    k3 = os.path.join(root, "k3")
    build_k3_checkpoint(os.path.join(k3, "hf"), K3ShapeSpec(vocab_size=96, hidden_size=64, latent_size=64,
                                                             expert_intermediate=128, num_layers=4, num_experts=32,
                                                             top_k=4, kda_heads=2, kda_head_dim=32, mla_heads=4,
                                                             kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                                                             v_head_dim=16))
    convert(os.path.join(k3, "hf"), os.path.join(k3, "store"), quantize="mxfp4")   # K3 ships MXFP4 experts
    out["k3_mxfp4"] = os.path.join(k3, "store")
    return out


@pytest.fixture(scope="module")
def arch_stores(tmp_path_factory):
    return _stores(str(tmp_path_factory.mktemp("tp-archs")))


def _run(eng):
    logits = eng.score(PROMPTS)
    ids = [eng.add_request(p, SamplingParams(max_tokens=32, ignore_eos=True)) for p in PROMPTS]
    eng.run()
    return logits, [eng.done[i].output for i in ids]


def _slots(store_dir: str, N: int, fraction: "float | None") -> "int | None":
    """Bytes of expert slots for ``fraction`` of the experts (None: every expert) at a rank's slice size."""
    if fraction is None:
        return None
    m = Manifest.read(store_dir)
    cfg = MoEConfig.from_hf(store_dir)
    n = max(cfg.top_k, round(fraction * m.num_layers * m.num_experts))
    return n * (m.blob_stride if N == 1 else rank_manifest(m, Shard(0, N)).blob_stride)


def _stage_slots(store_dir: str, N: int, stages: int, fraction: "float | None") -> "int | None":
    """A stage's expert slots for ``fraction`` of its layers' experts (at least top-k)."""
    if fraction is None:
        return None
    m = Manifest.read(store_dir)
    cfg = MoEConfig.from_hf(store_dir)
    per = -(-m.num_layers // stages)
    n = max(cfg.top_k, round(fraction * per * m.num_experts))
    return n * (m.blob_stride if N == 1 else rank_manifest(m, Shard(0, N)).blob_stride)


# Four ranks on this project's 2-core machines cost about 5 s per store and budget (a group of processes is
# started for each): two ranks take every architecture; four ranks and two stages take one of each way a layer
# splits - GQA, MLA, sliding window, gated shared expert, expert biases, KDA and Gated DeltaNet heads (split at 2
# and 4 ranks or replicated), DeepSeek-V4 (hash routing, hyper-connections), K3's MXFP4 experts -, the others
# with TIERED_MOE_TP_EVERY_ARCH=1.
SPLIT_KINDS = ("mixtral", "mixtral_swa", "qwen2_moe", "deepseek_v3", "gpt_oss", "kimi_linear", "qwen3_next",
               "qwen3_5_moe_text", "deepseek_v4", "k3_mxfp4")


@pytest.mark.slow
@pytest.mark.parametrize("world,stages", [(2, 1), (4, 1), (2, 2)], ids=["tp2", "tp4", "tp2xpp2"])
def test_group_matches_one_process(arch_stores, world, stages):
    """Tensor-parallel ranks (x pipeline stages): logits, 32 greedy tokens, residency and bytes against one
    process."""
    from runtime.parallel.group import open_group
    assert set(SPLIT_KINDS) <= set(arch_stores), set(SPLIT_KINDS) - set(arch_stores)
    every = world == 2 and stages == 1 or os.environ.get("TIERED_MOE_TP_EVERY_ARCH") == "1"
    group = None
    try:
        for arch, store_dir in arch_stores.items():
            if not every and arch not in SPLIT_KINDS:
                continue
            if stages > 1 and MoEConfig.from_hf(store_dir).attn_res_block_layers:
                with pytest.raises(ValueError, match="Block Attention Residuals"):
                    RuntimeConfig(model=store_dir, tensor_parallel=world, pipeline_parallel=stages)
                continue
            # two ranks: every expert resident and 10% on the device; four ranks and two stages: the tiered run only
            # (it moves experts as well as computing them; the all-resident case is two ranks' on every layer kind)
            for fraction in ((None, 0.1) if every else (0.1,)):
                cfg1 = RuntimeConfig(model=store_dir, max_batch=2, expert_budget=_slots(store_dir, 1, fraction))
                model, store = cfg1.load()
                eng1 = cfg1.engine(model, store)
                want_logits, want = _run(eng1)
                want_bytes = store.snapshot()["bytes"]["host_to_device"]
                store.close()

                cfg = RuntimeConfig(model=store_dir, max_batch=2, tensor_parallel=world, pipeline_parallel=stages,
                                    expert_budget=_slots(store_dir, world, fraction) if stages == 1 else
                                    _stage_slots(store_dir, world, stages, fraction))
                group, model, store = open_group(group, cfg)
                eng = group.make_engine(model, store)
                logits, got = _run(eng)
                what = (f"{arch}, {world} ranks x {stages} stages, {'all' if fraction is None else '10%'} of experts "
                        f"on the device")
                assert (logits - want_logits).abs().max() < 1e-4, what
                assert got == want, what
                res = eng.gather("residency")
                for s in range(stages):          # a stage's ranks hold the same experts
                    mine = res[s * world:(s + 1) * world]
                    assert all(r == mine[0] for r in mine[1:]), f"{what}: the ranks' residency diverged"
                assert all(r["slots"] == r["placement"] for r in res), what
                snaps = eng.gather("snapshot")
                lay = eng.gather("layout")
                assert [x["rank"] for x in lay] == list(range(world * stages))
                # One host tier per stage, shared by its ranks (mapped, its name already gone); the stages' layers
                # tile the model.
                assert all(x["host_shared"] for x in lay) and not glob.glob(os.path.join(shm_dir(), "tiered-moe-host-*"))
                assert lay[0]["layers"][0] == 0 and lay[-1]["layers"][1] == MoEConfig.from_hf(store_dir).num_layers
                if arch == "kimi_linear":        # 4 KDA heads: split at 2 and 4 ranks, each rank its heads' state
                    assert lay[0]["linear_attention"] == "split", lay[0]
                if arch in ("qwen3_next", "qwen3_5_moe_text"):   # 2 key-head groups: split at 2 ranks, not at 4
                    assert lay[0]["linear_attention"] == ("split" if world == 2 else "replicated"), lay[0]
                assert all(lay[s * world]["layers"][1] == lay[(s + 1) * world]["layers"][0] for s in range(stages - 1))
                if stages > 1:    # micro-batches request each layer once per micro-batch: other placement, same tokens
                    assert all(snaps[s * world]["bytes"]["host_to_device"] > 0 for s in range(stages)), what
                    store.close()
                    continue
                # A rank's slice is 1/N of the expert, less the down bias (gpt-oss) every rank's blob keeps whole
                # (rank 0's, zeros elsewhere: one layout for every rank).
                bias = sum(t.nbytes for t in store.m.tensors if t.name.startswith("down_bias."))
                share = (store.m.blob_bytes - bias) / (store.full_m.blob_bytes - bias)
                assert abs(share * world - 1) < 0.02, f"{what}: a rank's slice is {share:.4f} of an expert"
                for s in snaps:    # the same moves as one process, each of a slice's bytes
                    assert s["bytes"]["host_to_device"] == want_bytes * store.m.blob_bytes // store.full_m.blob_bytes, what
                if fraction is not None:
                    assert want_bytes > 0, f"{what}: the device tier never missed"
                store.close()
    finally:
        if group is not None:
            group.close()


@pytest.mark.slow
def test_group_prefix_caching_with_state(arch_stores):
    """Prefix caching across two tensor-parallel ranks on models with per-sequence state (KDA, Gated DeltaNet,
    split by heads): every rank snapshots and restores its heads' state at the same boundaries, so the group's
    tokens are one process's, and the shared prefix was served from the cache."""
    from runtime.parallel.group import open_group
    shared = [(7 * i) % 90 + 3 for i in range(40)]
    prompts = [shared + [50 + i, 60 + i, 70 + i] for i in range(3)]

    def run(eng):
        out = []
        for p in prompts:                    # one after another: each finds what the one before left
            i = eng.add_request(p, SamplingParams(max_tokens=8, ignore_eos=True))
            eng.run()
            out.append(eng.done[i].output)
        return out
    group = None
    try:
        for arch in ("kimi_linear", "qwen3_next"):
            cfg1 = RuntimeConfig(model=arch_stores[arch], max_batch=1)
            model, store = cfg1.load()
            eng1 = cfg1.engine(model, store)
            want = run(eng1)
            hits = eng1.scheduler.blocks.hits
            store.close()
            assert hits == 2 * 32, arch              # two full blocks of the 40 shared tokens, for the 2nd and 3rd
            group, model, store = open_group(group, RuntimeConfig(model=arch_stores[arch], max_batch=1,
                                                                  tensor_parallel=2))
            eng = group.make_engine(model, store)
            assert run(eng) == want, arch
            assert eng.scheduler.blocks.hits == hits, arch
            store.close()
    finally:
        if group is not None:
            group.close()


@pytest.mark.slow
def test_generate_command_with_two_ranks(arch_stores, capsys):
    """``tiered-moe generate --tensor-parallel 2``: the ranks start, decode and stop; the text is one process's."""
    import json

    from runtime.cli import main
    store = arch_stores["qwen3_moe"]
    # --device-budget auto: the one process keeps a device (stand-in) tier too, so its bytes compare with the ranks'
    # (with no budget a machine without a GPU runs one memory: nothing crosses host -> device)
    args = ["generate", "--model", store, "--prompt-ids", "3,17,5,9", "--max-tokens", "12", "--json", "--device-budget",
            "auto"]
    assert main(args) == 0
    one = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert main(args + ["--tensor-parallel", "2"]) == 0
    two = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert two[0]["tokens"] == one[0]["tokens"] and len(one[0]["tokens"]) == 12
    assert two[1]["bytes"]["host_to_device"] < one[1]["bytes"]["host_to_device"]


@pytest.mark.slow
def test_two_nodes_on_loopback_with_torchrun(arch_stores, capsys):
    """Pipeline stages across "nodes": two torchrun launches (--nnodes 2, one rank each) meeting at a
    rendezvous address on the loopback, as README's multi-node section starts them; rank 0's text is one
    process's."""
    import json
    import socket
    import subprocess
    import sys

    from runtime.cli import main
    store = arch_stores["qwen3_moe"]
    args = ["generate", "--model", store, "--prompt-ids", "3,17,5,9", "--prompt-ids", "8,1", "--max-tokens", "12",
            "--json"]
    assert main(args) == 0
    one = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    procs = [subprocess.Popen([torchrun, "--nnodes", "2", "--node-rank", str(n), "--nproc-per-node", "1",
                               "--master-addr", "127.0.0.1", "--master-port", str(port), "-m", "runtime.cli", *args,
                               "--pipeline-parallel", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
             for n in (0, 1)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    two = [json.loads(x) for x in outs[0][0].splitlines() if x.startswith("{")]
    assert [x["tokens"] for x in two[:2]] == [x["tokens"] for x in one[:2]]
    assert outs[1][0].strip() == ""                       # the second node's rank follows rank 0 and prints nothing


@pytest.mark.slow
def test_regimes_on_two_ranks_projects_the_layout(arch_stores):
    """regimes --tensor-parallel 2: the live part on two ranks (each rank's measured bytes per token half of
    one process's at the same slot count), the layout projected from the recorded routing."""
    from runtime.regimes import run_one
    store = arch_stores["mixtral"]
    kw = dict(batch=2, policy="lru", prefetch="none", device_fraction=0.25, requests=2, prompt_len=4, max_tokens=6,
              profile="h200", geometry=None, seed=0)
    one = run_one(store, **kw)
    two = run_one(store, **kw, tensor_parallel=2)
    assert one["layout"] is None and two["layout"]["layout"] == "TP2"
    m = Manifest.read(store)
    half = rank_manifest(m, Shard(0, 2)).blob_bytes / m.blob_bytes
    for b in two["layout"]["measured_h2d_bytes_per_token_per_rank"]:
        assert b == pytest.approx(one["bytes_per_token"]["host_to_device"] * half)
    assert two["generated_tokens"] == one["generated_tokens"] and two["layout"]["tokens_per_s"] > 0
