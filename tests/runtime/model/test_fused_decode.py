"""The fused CPU decode (runtime/model/layers/fused.py: a GQA, MLA or linear-attention + MoE or dense MLP layer in two
kernel calls) against
the composed layers it replaces (TIERED_MOE_FUSED_DECODE=0) on the same store: the same logits at
every decode step of a batch of sequences of different lengths, the same expert requests (store hits
per tier, the recorded routing trace) with every expert resident and with 10% of them on the device
(misses take the composed block's general path from inside a fused layer), per architecture - and the
layers each architecture fuses, so the comparison cannot pass on composed layers alone."""

import numpy as np
import pytest
import torch

from runtime import kernels
from runtime.engine import Engine, SamplingParams
from runtime.model import Sequence, StepHooks, load_model
from runtime.model.convert import convert
from runtime.store import Manifest
from helpers import feed

from conftest import build_hf

if kernels.lib() is None:
    pytest.skip(f"host kernels unavailable: {kernels.unavailable()}", allow_module_level=True)

# architecture -> the layers that decode fused (the others: a kind the kernel does not take - ERNIE's router, its
# dense layer 0 fuses; Mellum's sliding layers, whose RoPE is not the step's table).
# gpt-oss's sliding-window rings and its sinks fuse; MLA through tm_mla_block (q through q_lora with interleaved
# RoPE (V3), one q_proj with YaRN (V3 yarn), no RoPE (Kimi-Linear's full layer between its KDA layers)); Gated
# DeltaNet and KDA through tm_gdn_block, Qwen3-Next's gated attention with partial RoPE through tm_attn_block; the
# dense MLP layers (DeepSeek's first layer, Qwen3-Next's mlp_only_layers, Qwen3-MoE's layer 1) through the same
# calls without a router; Llama 4's dense chunked-attention layers (its chunk's ring entries read, the weightless q/k
# norm as ones; its MoE layers' router and its NoPE layers' q scale stay composed)
ALL = [0, 1, 2]
FUSED = {"mixtral": ALL, "qwen2_moe": ALL, "qwen3_moe": ALL, "olmoe": ALL, "glm4_moe": ALL, "minimax_m2": ALL,
         "gpt_oss": ALL, "ernie4_5_moe": [0], "deepseek_v3": ALL, "deepseek_v3_yarn": ALL, "deepseek_v2_lite": ALL,
         "glm4_moe_lite": ALL, "kimi_linear": ALL, "deepseek_v2": ALL, "kimi_k25": ALL, "qwen3_next": ALL,
         "qwen3_5_moe_text": ALL, "solar_open": ALL, "minicpm5_moe": ALL, "glm4v_moe": ALL,
         "hy_v3": ALL, "granitemoe": ALL, "granitemoeshared": ALL,
         "exaone_moe": ALL, "flint": ALL, "sarvam_mla": ALL,
         "sarvam_moe": ALL, "param2moe": ALL, "qwen3_omni_moe_thinker": ALL,
         "deepseek_ocr2": ALL, "granitemoe_swa": ALL, "mellum": [0],
         "aria_text": ALL, "aria": ALL, "llama4_text": [0], "llama4": [0, 2],
         "granitemoehybrid": [1]}
SLOW = {"qwen2_moe", "olmoe", "minimax_m2", "ernie4_5_moe", "solar_open", "minicpm5_moe", "glm4v_moe", "hy_v3",
        "granitemoe", "granitemoeshared", "exaone_moe", "flint", "sarvam_mla",
        "sarvam_moe", "param2moe", "qwen3_omni_moe_thinker", "deepseek_ocr2",
        "granitemoe_swa", "mellum", "aria_text", "aria", "llama4_text", "llama4", "granitemoehybrid"}


@pytest.fixture(scope="module", params=[a if a not in SLOW else pytest.param(a, marks=pytest.mark.slow) for a in FUSED])
def store(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    build_hf(request.param, str(d / "hf"))
    convert(str(d / "hf"), str(d / "store"))
    return request.param, str(d / "store")


def _load(store_dir, fused: bool, frac: float, monkeypatch):
    monkeypatch.setenv("TIERED_MOE_FUSED_DECODE", "1" if fused else "0")
    m = Manifest.read(store_dir)
    slots = max(4, int(frac * m.num_layers * m.num_experts))
    return load_model(store_dir, expert_budget=slots * m.blob_stride, policy="lru")


def _decode(store_dir, fused, frac, monkeypatch, step=True):
    monkeypatch.setenv("TIERED_MOE_FUSED_STEP", "1" if step else "0")
    model, st = _load(store_dir, fused, frac, monkeypatch)
    try:
        which = [i for i, f in enumerate(model.fused) if f is not None]
        # the shared experts and dense MLPs of fused layers run in tm_mlp_block (none composed beside it)
        assert all(f.mlp is not None for f in model.fused if f is not None and (f.dense or f.block.shared is not None))
        seqs = [Sequence() for _ in range(3)]
        g = torch.Generator().manual_seed(5)
        prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (5, 2, 7)]
        feed(model, seqs, prompts)
        steps = [feed(model, seqs, [[t] for t in torch.randint(0, 96, (3,), generator=g).tolist()]) for _ in range(6)]
        runner = model.residual.step
        if fused and step and frac == 1.0:       # the decode steps ran through the one-call step (layers/fused_step.py)
            # and MoE layers' experts in it (from their residency tables; the rest fell back one layer at a time)
            assert runner is not None and runner.calls >= 6
            assert runner.routed_done > 0 or all(f is None or f.dense for f in model.fused)
        # the store's state after the steps: hits per layer and, per device pool, its residents in LRU order - the
        # one-call step books its layers through ExpertStore.request_resident, which must decide as request does
        state = ([list(h) for h in st.stats.layer_hits], st.stats.requests,
                 [list(p.policy.order) for p in st.placement.unique_pools()])
        return which, torch.stack(steps), (dict(st.stats.hits), state)
    finally:
        st.close()


@pytest.mark.parametrize("step", [True, False])
@pytest.mark.parametrize("frac", [1.0, 0.1])
def test_fused_decode_equals_composed(store, frac, step, monkeypatch):
    """The fused layers one call per step (step) and one layer at a time, against the composed layers."""
    arch, d = store
    which, fused, hits = _decode(d, True, frac, monkeypatch, step)
    assert which == FUSED[arch], arch
    _, composed, hits0 = _decode(d, False, frac, monkeypatch)
    assert (fused - composed).abs().max().item() <= 1e-5 * composed.abs().max().item(), arch
    assert hits == hits0                                  # the same expert requests, hit for hit, the same LRU order
    hits = hits[0]
    if frac < 1:
        assert hits["device"] < sum(hits.values())                    # misses really took the general path


def test_fused_engine_trace_and_tokens_equal_composed(store, monkeypatch):
    arch, d = store
    out = {}
    for fused in (True, False):
        model, st = _load(d, fused, 0.25, monkeypatch)
        try:
            eng = Engine(model, st, max_batch=3, prefill_chunk=4)
            ids = [eng.add_request(list(range(3, 3 + n)), SamplingParams(max_tokens=12, ignore_eos=True)) for n in (6, 3, 9)]
            eng.run()
            out[fused] = ([eng.done[i].output for i in ids], eng.trace().ids)
        finally:
            st.close()
    assert out[True][0] == out[False][0], arch
    assert np.array_equal(out[True][1], out[False][1]), arch


def test_cache_bonus_and_other_dtypes_run_composed(store, monkeypatch):
    """Cache-aware routing changes the router's choice per resident expert: those steps run composed."""
    arch, d = store
    if not FUSED[arch]:
        pytest.skip("no fused layer")
    model, st = _load(d, True, 1.0, monkeypatch)
    try:
        calls = []
        for f in model.fused:
            if f is not None:       # counts the fused layers' kernel calls (their composed fallback makes none)
                orig = f._attention
                f._attention = lambda *a, _o=orig: (calls.append(1), _o(*a))
        s = Sequence()
        feed(model, [s], [[1, 2, 3]])
        runner, before = model.residual.step, model.residual.step.calls
        feed(model, [s], [[4]], StepHooks(cache_bonus=0.5))
        assert not calls and runner.calls == before
        feed(model, [s], [[5]], StepHooks(cache_bonus=0.0))
        # one layer at a time, or the fused layers in the step's one call (layers/fused_step.py)
        assert len(calls) == len(FUSED[arch]) or (not calls and runner.calls > before)
    finally:
        st.close()


def test_linear_attention_state_slots_reused_and_fresh(store, monkeypatch):
    """Linear-attention layers keep a state per sequence in a slot of the arena, which the fused kernel reads
    and writes in place: with two slots for five requests the slots are reused (stale contents), and
    one-token prompts start in a decode step (the slot zeroed first); tokens as composed."""
    arch, d = store
    if arch not in ("qwen3_next", "qwen3_5_moe_text", "kimi_linear"):
        pytest.skip("no linear-attention layer")
    def drive(model, eng, fused):
        ids = [eng.add_request(list(range(5 + n, 5 + 2 * n)), SamplingParams(max_tokens=6, ignore_eos=True))
               for n in (1, 5, 1, 2, 1)]
        eng.run()
        return [eng.done[i].output for i in ids]
    out = _fused_and_composed(d, monkeypatch, 2, 4, drive)
    assert out[True] == out[False], arch


def _fused_and_composed(d, monkeypatch, max_batch, prefill_chunk, drive) -> dict:
    """{fused: drive(model, engine, fused)} for the fused and the composed layers, every expert in the device tier."""
    out = {}
    for fused in (True, False):
        model, st = _load(d, fused, 1.0, monkeypatch)
        try:
            out[fused] = drive(model, Engine(model, st, max_batch=max_batch, prefill_chunk=prefill_chunk), fused)
        finally:
            st.close()
    return out


def _expert_args_follow(model):
    runner, bufs = model.residual.step, model.fused[0].bufs
    assert runner.routed_done > 0 and bufs.n > 64
    assert all(r.moe.x == bufs.xs.data_ptr() and r.moe.y == bufs.ys.data_ptr() for r in runner.routed if r is not None)


def test_fused_step_follows_step_buffers_that_grow(store, monkeypatch):
    """The step's buffers are remade when the batch or the context outgrows them (StepBuffers._alloc): the one-call
    step's expert arguments follow them (they pointed at freed rows once) - tokens as composed past the growth."""
    arch, d = store
    if arch not in ("qwen3_moe", "deepseek_v3", "qwen3_next"):
        pytest.skip("one architecture per attention kind")
    def drive(model, eng, fused):
        # one sequence decoding past the first 64 keys of scratch (the context grows, the batch does not), then
        # three at once (the batch grows)
        ids = [eng.add_request([5, 9, 4], SamplingParams(max_tokens=72, ignore_eos=True))]
        held = []
        while eng.has_work():
            eng.step()
            if fused and not held and model.fused[0].bufs.x is not None:
                held.append(model.fused[0].bufs.xs)     # kept alive: its rows cannot be handed out again
        if fused:
            assert model.fused[0].bufs.xs is not held[0]                  # remade as the context grew
            _expert_args_follow(model)
        ids += [eng.add_request([(7 * i + n) % 90 + 3 for i in range(n)], SamplingParams(max_tokens=6, ignore_eos=True))
                for n in (9, 3, 5)]
        eng.run()
        if fused:
            _expert_args_follow(model)
        return [eng.done[i].output for i in ids]
    out = _fused_and_composed(d, monkeypatch, 4, 16, drive)
    assert out[True] == out[False], arch


def test_fused_step_one_memory_reads_host_slots(store, monkeypatch):
    """On a CPU without budgets (the CLI's default: one memory, every expert in the host tier, computed there -
    cpu_layers over every layer) the one-call step reads the host slots: logits and hits as composed, the experts of
    every MoE layer computed in the call, their time counted as host compute."""
    arch, d = store
    if arch not in ("qwen3_moe", "deepseek_v3", "qwen3_next", "gpt_oss"):
        pytest.skip("one architecture per attention kind")
    runs = {}
    for fused in (True, False):
        monkeypatch.setenv("TIERED_MOE_FUSED_DECODE", "1" if fused else "0")
        model, st = load_model(d, host_budget="auto")
        try:
            assert st.host_holds_all and st.placement.cpu_layers == model.cfg.num_moe_layers
            seqs, g = [Sequence() for _ in range(2)], torch.Generator().manual_seed(3)
            feed(model, seqs, [[5, 6, 7], [8, 9]])
            logits = torch.stack([feed(model, seqs, [[t] for t in torch.randint(0, 96, (2,), generator=g).tolist()])
                                  for _ in range(5)])
            runs[fused] = (logits, dict(st.stats.hits), st.stats.host_compute_seconds)
            if fused:
                n_moe = sum(1 for f in model.fused if f is not None and not f.dense)
                assert model.residual.step.routed_done == 5 * n_moe > 0
        finally:
            st.close()
    (fl, fh, fs), (cl, ch, _) = runs[True], runs[False]
    assert (fl - cl).abs().max().item() <= 1e-5 * cl.abs().max().item(), arch
    assert fh == ch and fs > 0
