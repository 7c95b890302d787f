"""Prefix caching on models with per-sequence state (issue 21): Gated DeltaNet, Kimi Delta Attention, lightning
attention and Mamba-2 hybrids (recurrent state; Mamba-2's convolution state too; Nemotron-H's layers with an empty
sublayer, which cache nothing), gpt-oss and MiMo-V2-Flash
(sliding-window rings beside full attention; MiMo's values narrower than its keys) and DeepSeek-V4 (window rings and
the compressors' open windows beside compressed entries): the state is snapshotted at block boundaries and a shared
prefix skips its prefill from the deepest one - with the outputs of the cache off."""
import os

import pytest
import torch

from conftest import build_hf
from runtime.engine import Engine, SamplingParams
from runtime.model import load_model

SYSTEM, N = 120, 6


@pytest.fixture(scope="module", params=["qwen3_next", "gpt_oss", pytest.param("kimi_linear", marks=pytest.mark.slow),
                                        "deepseek_v4", pytest.param("minimax", marks=pytest.mark.slow),
                                        pytest.param("granitemoehybrid", marks=pytest.mark.slow),
                                        pytest.param("mimo_v2_flash", marks=pytest.mark.slow),
                                        pytest.param("nemotron_h", marks=pytest.mark.slow)])
def stateful_store(request, tmp_path_factory):
    from runtime.model.convert import convert
    d = str(tmp_path_factory.mktemp(request.param))
    build_hf(request.param, os.path.join(d, "hf"))
    convert(os.path.join(d, "hf"), os.path.join(d, "store"))
    return os.path.join(d, "store")


def _chat(store, caching: bool, every=256):
    """N requests sharing a SYSTEM-token prompt, each with its own question (longer than a block: the first
    request's last full block is its own); greedy."""
    g = torch.Generator().manual_seed(0)
    system = torch.randint(3, 96, (SYSTEM,), generator=g).tolist()
    prompts = [system + torch.randint(3, 96, (18 + i % 4,), generator=g).tolist() for i in range(N)]
    model, st = load_model(store)
    try:
        eng = Engine(model, st, max_batch=4, prefill_chunk=48, prefix_caching=caching)
        eng.scheduler.snapshot_every = every
        ids = [eng.add_request(p, SamplingParams(max_tokens=6, ignore_eos=True)) for p in prompts]
        eng.run()
        prefill = sum(r.tokens for r in eng.steps) - N * 5
        return [eng.done[i].output for i in ids], prefill, eng.kv, sum(len(p) for p in prompts)
    finally:
        st.close()


def test_a_shared_prefix_restores_the_state(stateful_store):
    off, prefill_off, _, total = _chat(stateful_store, False)
    on, prefill_on, mgr, _ = _chat(stateful_store, True)
    assert prefill_off == total and mgr.snapshots > 0
    assert on == off
    bs = mgr.block_size
    shared = SYSTEM // bs * bs
    # the first request computes everything; the second finds the blocks but no state where they end (it files
    # one there); every later one starts from it
    assert mgr.hits == (N - 2) * shared and prefill_on == prefill_off - mgr.hits


def test_periodic_snapshots(stateful_store):
    """With a snapshot every 2 blocks, the second request already starts from one inside the shared prefix."""
    off, _, _, _ = _chat(stateful_store, False)
    on, _, mgr, _ = _chat(stateful_store, True, every=32)
    assert on == off
    bs = mgr.block_size
    every = -(-32 // bs) * bs
    shared = SYSTEM // bs * bs
    assert mgr.hits == (shared - 1) // every * every + (N - 2) * shared
