"""One memory on a machine without a GPU (issue 29): ``--host-budget`` alone is the experts' whole budget -
every expert computes from its host-tier slot, none is copied to a "device" tier in the same RAM, the rest
stay on disk - and ``auto`` sizes it from the memory available, a cgroup limit included (files written here
in the kernel's formats: proc(5) meminfo, cgroup v2 memory.max / memory.current, v1 memory.limit_in_bytes /
memory.usage_in_bytes). Tokens are checked against the model with every expert resident."""
import os
import subprocess
import sys

import pytest

from runtime.engine import Engine, SamplingParams
from runtime.model import load_model
from runtime.model.footprint import HOST_MARGIN_BYTES, HOST_MARGIN_SHARE, host_budget_auto, host_memory_available
from runtime.store import Manifest

PROMPTS = [[1, 5, 9, 2], [3, 3, 7], [11, 4, 6, 8, 2]]


def run(store: str, **kw):
    model, st = load_model(store, device="cpu", max_batch=len(PROMPTS), **kw)
    try:
        eng = Engine(model, st, max_batch=len(PROMPTS), prefill_chunk=8)
        ids = [eng.add_request(p, SamplingParams(max_tokens=12, ignore_eos=True)) for p in PROMPTS]
        eng.run()
        return [eng.done[i].output for i in ids], eng.summary(), st
    finally:
        st.close()


def test_host_budget_alone_is_the_one_budget(tiny_store):
    _, store = tiny_store
    m = Manifest.read(store)
    want, _, _ = run(store)                                         # every expert resident
    budget = 6 * m.blob_stride                                      # 6 of 16 experts: one step of 3 x top-2
    got, summ, st = run(store, host_budget=budget)
    assert got == want
    assert st.compute_on_host(0) and st.compute_on_host(m.num_layers - 1)
    assert summ["bytes"]["host_to_device"] == 0                     # nothing copied within the one memory
    assert summ["hits"]["device"] == 0 and summ["hits"]["disk"] > 0  # the rest came from disk
    assert summ["bytes"]["disk_to_host"] == summ["hits"]["disk"] * m.blob_bytes
    assert st.host.data.numel() <= budget                           # the host slab is the budget, no more


def test_lookahead_reads_ahead_into_host_memory(tiny_store):
    """One memory with --prefetch lookahead: layer m + 1's predicted experts the host tier lacks are read from
    disk while layer m computes (into host slots: nothing crosses to a device), and the tokens do not change."""
    _, store = tiny_store
    m = Manifest.read(store)
    want, _, _ = run(store)
    model, st = load_model(store, device="cpu", max_batch=len(PROMPTS), host_budget=6 * m.blob_stride)
    try:
        eng = Engine(model, st, max_batch=len(PROMPTS), prefill_chunk=8, prefetch="lookahead")
        ids = [eng.add_request(p, SamplingParams(max_tokens=12, ignore_eos=True)) for p in PROMPTS]
        eng.run()
        assert [eng.done[i].output for i in ids] == want
        summ = eng.summary()
        assert st.stats.prefetch_loaded > 0 and summ["bytes"]["host_to_device"] == 0
        assert not st.placement.device[0].resident                         # the device tier stayed empty
    finally:
        st.close()


def test_a_step_of_more_experts_than_top_k_runs(tiny_store):
    """The device tier keeps only top-k slots in one memory: a batch whose layer needs more experts than that
    runs (the host tier is where they compute), up to what the host tier holds."""
    _, store = tiny_store
    m = Manifest.read(store)
    want, _, _ = run(store)
    got, summ, _ = run(store, host_budget=m.num_experts * m.blob_stride)   # one layer's worth: the batch fits
    assert got == want and summ["mean_unique_experts_per_layer"] > 2


def write_proc(root, avail_kb: int, cgroup_line: str):
    os.makedirs(root / "self", exist_ok=True)
    (root / "meminfo").write_text(f"MemTotal:       16000000 kB\nMemFree:         1000000 kB\n"
                                  f"MemAvailable:   {avail_kb:>8} kB\nBuffers:           1000 kB\n")
    (root / "self" / "cgroup").write_text(cgroup_line)


def test_available_memory_from_meminfo_and_cgroups(tmp_path):
    proc, cg = tmp_path / "proc", tmp_path / "cg"
    write_proc(proc, 8_000_000, "0::/job\n")
    os.makedirs(cg / "job")
    assert host_memory_available(str(proc), str(cg)) == (8_000_000 * 1024, "MemAvailable")
    (cg / "job" / "memory.max").write_text("max\n")                 # v2 without a limit
    (cg / "job" / "memory.current").write_text("1000\n")
    assert host_memory_available(str(proc), str(cg))[0] == 8_000_000 * 1024
    (cg / "job" / "memory.max").write_text(f"{2 * 2**30}\n")        # v2: 2 GiB, 0.5 GiB used
    (cg / "job" / "memory.current").write_text(f"{2**29}\n")
    got, src = host_memory_available(str(proc), str(cg))
    assert got == 2 * 2**30 - 2**29 and "memory.max" in src
    proc1, cg1 = tmp_path / "proc1", tmp_path / "cg1"             # v1: the memory controller's own hierarchy
    write_proc(proc1, 8_000_000, "5:cpu,cpuacct:/x\n4:memory:/box\n")
    os.makedirs(cg1 / "memory" / "box")
    (cg1 / "memory" / "box" / "memory.limit_in_bytes").write_text(f"{2**30}\n")
    (cg1 / "memory" / "box" / "memory.usage_in_bytes").write_text(f"{2**28}\n")
    assert host_memory_available(str(proc1), str(cg1))[0] == 2**30 - 2**28


def test_host_budget_auto_formula_and_refusal(tiny_store):
    avail = 2 * 2**30
    assert host_budget_auto(avail, 10**8, 5 * 10**7) == avail - 10**8 - 5 * 10**7 - HOST_MARGIN_BYTES - avail // 10
    _, store = tiny_store
    # auto on this machine: runs, and holds at most every expert
    model, st = load_model(store, device="cpu", host_budget="auto")
    try:
        m = Manifest.read(store)
        assert st.compute_on_host(0) and st.host.data.numel() <= m.num_layers * m.num_experts * m.blob_stride
    finally:
        st.close()
    with pytest.raises(ValueError, match="--host-budget auto sizes the one memory of a machine without a GPU"):
        load_model(store, device="cpu", expert_budget=8 * Manifest.read(store).blob_stride, host_budget="auto")


def test_cli_generate_with_only_a_host_budget(tiny_store):
    _, store = tiny_store
    m = Manifest.read(store)
    p = subprocess.run([sys.executable, "-m", "runtime.cli", "generate", "--model", store, "--prompt", "hello there",
                        "--max-tokens", "6", "--host-budget", str(4 * m.blob_stride)], capture_output=True, text=True,
                       timeout=300, cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__)))))
    assert p.returncode == 0, p.stderr[-2000:]
    assert "experts from host memory" in p.stderr and "from disk" in p.stderr and "MB read per token" in p.stderr


def test_plan_without_a_gpu_adds_up_and_is_what_load_model_makes(tiny_store):
    """``plan --gpus 0``: memory = dense + cache + margin + the experts' budget, to the byte; load_model given that
    budget holds the planned number of experts."""
    from runtime.plan import format_plan_cpu, plan_cpu
    _, store = tiny_store
    m = Manifest.read(store)
    mem = 256 * 2**20 + 40 * 2**20
    p = plan_cpu(store, context=64, batch=2, memory=mem)
    assert p["memory"] == p["dense"] + p["cache"] + p["margin"] + p["host_budget"]
    assert HOST_MARGIN_SHARE == 0.10 and p["margin"] == HOST_MARGIN_BYTES + mem // 10
    assert p["experts_in_memory"] == min(p["host_budget"] // m.blob_stride, m.num_layers * m.num_experts)
    room = p["dense"] + p["cache"] + 7 * m.blob_stride + 100
    small = plan_cpu(store, context=64, batch=2, memory=int((HOST_MARGIN_BYTES + room) / 0.9) + 1)
    assert small["experts_in_memory"] == 7 and abs(small["on_disk_share"] - (1 - 7 / 16)) < 1e-9
    model, st = load_model(store, device="cpu", host_budget=small["host_budget"])
    try:
        assert st.host.data.shape[0] == 7                              # slots: what the plan said
    finally:
        st.close()
    assert "7 of 16 experts" in format_plan_cpu(small)
    # some experts stay on disk: the plan measured how fast the store's files read (whole experts, O_DIRECT)
    assert small["disk_read_Bps"] > 0 and small["disk_read_mode"] in ("O_DIRECT", "buffered")
    assert "MB read per token caps decode at" in format_plan_cpu(small)
    assert p["disk_read_Bps"] is None or p["experts_in_memory"] < 16       # all in memory: nothing to probe


def test_generate_with_no_flag_runs_one_memory_and_device_budget_keeps_the_stand_in(tiny_store):
    """Without CUDA and with no budget flag, generate runs one memory (--host-budget auto); --device-budget keeps
    the stand-in device tier for experiments. Same tokens either way."""
    _, store = tiny_store
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))

    def gen(*extra):
        p = subprocess.run([sys.executable, "-m", "runtime.cli", "generate", "--model", store, "--prompt-ids", "3,1,4",
                            "--max-tokens", "6", *extra], capture_output=True, text=True, timeout=300, cwd=root)
        assert p.returncode == 0, p.stderr[-2000:]
        return p
    one, stand_in = gen(), gen("--device-budget", "auto")
    assert "experts from host memory 1.000, from disk 0.000" in one.stderr
    assert "device hit rate" in stand_in.stderr and "CPU memory standing in for HBM" in stand_in.stderr
    assert one.stdout == stand_in.stdout


def test_a_checkpoint_written_layer_by_layer_is_the_same_checkpoint(tmp_path):
    """build_checkpoint(shard_by_layer=True): one file per layer and the index (transformers' sharded layout),
    the same tensors as the single file, in the dtype asked."""
    import json

    import torch
    from safetensors.torch import load_file

    from runtime.model.synthetic import SyntheticModelSpec, build_checkpoint
    spec = SyntheticModelSpec(num_layers=2, num_experts=8, hidden_size=32, intermediate_size=32, vocab_size=64, topics=4)
    build_checkpoint(str(tmp_path / "one"), spec)
    build_checkpoint(str(tmp_path / "sharded"), spec, dtype=torch.bfloat16, shard_by_layer=True)
    one = load_file(str(tmp_path / "one" / "model.safetensors"))
    index = json.load(open(tmp_path / "sharded" / "model.safetensors.index.json"))["weight_map"]
    assert set(index) == set(one) and len(set(index.values())) == 2          # a file per layer
    for name, file in index.items():
        t = load_file(str(tmp_path / "sharded" / file))[name]
        assert t.dtype == torch.bfloat16 and torch.equal(t, one[name].to(torch.bfloat16)), name
    assert json.load(open(tmp_path / "sharded" / "config.json"))["torch_dtype"] == "bfloat16"


def _held_dense_bytes(model) -> int:
    """Bytes of every distinct tensor storage the model's layers, embeddings, norm, head and residual scheme
    hold: what its dense weights take once loaded (the KV cache, the expert store and the rotary tables are
    not dense weights)."""
    import torch
    seen, total, stack = set(), 0, [model.layers, model.embed, model.norm, model.head, model.residual]
    visited = set()
    while stack:
        o = stack.pop()
        if o is None or id(o) in visited:
            continue
        visited.add(id(o))
        if isinstance(o, torch.Tensor):
            key = (o.untyped_storage().data_ptr(), o.untyped_storage().nbytes())
            if key not in seen:
                seen.add(key)
                total += o.untyped_storage().nbytes()
        elif isinstance(o, (list, tuple)):
            stack.extend(o)
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif type(o).__module__.startswith("runtime.") and hasattr(o, "__dict__"):
            stack.extend(v for k, v in vars(o).items() if k not in ("store", "executor", "rope", "experts", "cfg"))
    return total


@pytest.mark.parametrize("quant", ["none", "int8", "int4"])
def test_dense_weights_counted_as_they_are_kept(tmp_path, quant):
    """--host-budget auto and plan --gpus 0 count the dense weights at the size the model keeps them (bf16 as
    stored for the bf16 GEMV, --dense-quant's codes + scales, the head at int8), not float32: checked against
    the bytes a loaded model's layers hold."""
    import torch
    from runtime import kernels
    from runtime.model.convert import convert
    from runtime.model.footprint import dense_bytes, dense_kept_bytes
    from runtime.model.synthetic import SyntheticModelSpec, build_checkpoint
    from runtime.plan import dense_shapes, plan_cpu
    if kernels.lib() is None:
        pytest.skip("the host kernels do not load here: dense weights are widened to float32")
    spec = SyntheticModelSpec(num_layers=2, num_experts=8, hidden_size=128, intermediate_size=64, num_heads=4,
                              num_kv_heads=2)
    build_checkpoint(str(tmp_path / "hf"), spec, dtype=torch.bfloat16)
    store = str(tmp_path / "store")
    convert(str(tmp_path / "hf"), store)
    shapes = dense_shapes(store)
    kept = dense_kept_bytes(shapes, torch.float32, quant)
    model, st = load_model(store, device="cpu", host_budget="auto", dense_quant=quant)
    try:
        held = _held_dense_bytes(model)
    finally:
        st.close()
    assert abs(kept - held) <= 0.02 * held, (kept, held)
    assert kept < 0.75 * dense_bytes(shapes.values(), torch.float32)        # float32 counted them too big
    p = plan_cpu(store, context=64, batch=1, memory=2**30, probe_disk=False, dense_quant=quant)
    assert p["dense"] == kept
