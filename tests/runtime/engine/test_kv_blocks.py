"""The KV cache in preallocated blocks: memory fixed at start, admission by free blocks, preemption
(recompute) when out - and outputs equal to each request decoded alone with room to spare."""
import pytest

from runtime.engine import Engine, SamplingParams
from runtime.model import load_model

PROMPTS = [list(range(1, 1 + n)) for n in (20, 7, 30, 12)]


def run(store, kv_tokens, max_batch, greedy=True):
    model, st = load_model(store)
    try:
        model.init_kv(kv_tokens * model.kv_bytes_per_token(), block_size=8)
        eng = Engine(model, st, max_batch=max_batch, prefill_chunk=8)
        k0 = model.kv[0].k.data_ptr()
        ids = [eng.add_request(p, SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0 if greedy else 0.9,
                                                 seed=i)) for i, p in enumerate(PROMPTS)]
        peak = 0
        while eng.has_work():
            eng.step()
            peak = max(peak, eng.kv.num_blocks - eng.kv.free_blocks)
            assert model.kv[0].k.data_ptr() == k0          # never reallocated: memory fixed at start
        assert eng.kv.free_blocks == eng.kv.num_blocks   # every block returned
        return [eng.done[i].output for i in ids], eng.preemptions, peak, model.kv.num_blocks
    finally:
        st.close()


@pytest.mark.slow
@pytest.mark.parametrize("greedy", [True, False])
def test_preemption_recomputes_to_the_same_tokens(store, greedy):
    want = [run_alone for run_alone in (run(store, 4096, 1, greedy)[0])]
    got, preempted, peak, blocks = run(store, 8 * 8, 4, greedy)      # 8 blocks of 8 tokens for 4 sequences of <= 54
    assert preempted > 0 and peak <= blocks
    assert got == want


def test_requests_larger_than_the_cache_are_refused(store):
    model, st = load_model(store)
    try:
        model.init_kv(32 * model.kv_bytes_per_token(), block_size=8)     # 4 blocks
        eng = Engine(model, st, max_batch=2)
        with pytest.raises(ValueError, match=r"needs 5 KV blocks of 8 tokens; the KV cache budget holds 4"):
            eng.add_request(list(range(1, 20)), SamplingParams(max_tokens=20))
        eng.add_request(list(range(1, 10)), SamplingParams(max_tokens=20))   # 29 tokens: 4 blocks, fits
    finally:
        st.close()


def test_kv_budget_from_load_model_and_admission_by_free_blocks(store):
    model, st = load_model(store, kv_cache_bytes=None)
    per_token = model.kv_bytes_per_token()
    st.close()
    model, st = load_model(store, kv_cache_bytes=40 * per_token)
    try:
        eng = Engine(model, st, max_batch=4, prefill_chunk=64)
        assert model.kv.num_blocks == 40 // 16 and model.kv.nbytes <= 40 * per_token
        for p in PROMPTS[:3]:
            eng.add_request(p[:10], SamplingParams(max_tokens=4, ignore_eos=True))
        eng.step()
        # 2 blocks of 16 tokens, each request's prompt (+1) takes one: the third waits for a free block
        assert len(eng.running) == 2 and len(eng.waiting) == 1
        eng.run()
        assert all(len(r.output) == 4 for r in eng.done.values())
    finally:
        st.close()


@pytest.mark.slow
def test_expert_aware_schedule_with_a_tight_cache(store):
    """More active requests than the batch, blocks short: preemption and admission keep every
    request's tokens equal to decoding it alone."""
    want = run(store, 4096, 1)[0]
    model, st = load_model(store)
    try:
        model.init_kv(10 * 8 * model.kv_bytes_per_token(), block_size=8)
        eng = Engine(model, st, max_batch=2, prefill_chunk=8, schedule="expert-aware", max_active=4)
        ids = [eng.add_request(p, SamplingParams(max_tokens=24, ignore_eos=True)) for p in PROMPTS]
        eng.run()
        assert [eng.done[i].output for i in ids] == want
        assert eng.kv.free_blocks == eng.kv.num_blocks
    finally:
        st.close()


def test_the_model_allocates_nothing_the_engines_manager_gives_the_blocks(store):
    """One allocator: a forward over a sequence that holds no blocks (or fewer than its chunk needs) is refused,
    naming the KVManager; blocks prepared by the manager run, and release gives every one back."""
    from runtime.engine.kv_manager import KVManager
    from runtime.model import Sequence
    model, st = load_model(store)
    try:
        model.init_kv(64 * model.kv_bytes_per_token(), block_size=8)
        kv = KVManager.for_cache(model.kv)
        s = Sequence()
        with pytest.raises(ValueError, match=r"sequence 0 holds KV blocks for 0 tokens.*KVManager"):
            model.forward([s], [[1, 2, 3]])
        assert kv.free_blocks == kv.num_blocks == 8 and s.blocks == []
        kv.prepare([s], [list(range(1, 10))])                   # 9 tokens: two blocks of 8
        assert len(s.blocks) == 2 and kv.free_blocks == 6
        model.forward([s], [list(range(1, 10))])
        with pytest.raises(ValueError, match=r"holds KV blocks for 16 tokens, the forward feeds it to 17"):
            model.forward([s], [list(range(10, 18))])
        kv.release(s)
        assert kv.free_blocks == 8 and s.blocks == []
    finally:
        st.close()
