"""Prefix caching (issue 21): cached KV blocks of a prompt's prefix are reused, evicted LRU when free blocks
run out, counted, and the outputs are those of the cache off."""
import pytest

from runtime.engine import Engine, SamplingParams
from runtime.model import load_model
from runtime.engine.kv_manager import KVManager
from runtime.model.layers.cache import Sequence



def _fed(m: KVManager, seq: Sequence, tokens: list) -> None:
    """What the model does for a chunk: blocks for the tokens, length advanced, then the scheduler registers."""
    assert m.ensure(seq, len(tokens))
    seq.length = len(tokens)
    m.register(seq, tokens)


def test_block_manager_matches_whole_cached_blocks_and_evicts_lru():
    m = KVManager(num_blocks=6, block_size=4, state_slots=0, device="cpu")
    a = Sequence()
    _fed(m, a, list(range(10)))                  # blocks [0..3] [4..7] full, [8, 9] partial
    assert len(a.blocks) == 3 and len(m.cached) == 2
    m.release(a)
    assert m.free_blocks == 6 and len(m.evictable) == 2       # cached, nobody holds them: still free to take
    b = Sequence()
    assert m.match(b, list(range(8)) + [99]) == 8             # two full blocks; one token left to feed
    assert len(b.blocks) == 2 and b.length == 8
    assert b.slot_ids.tolist() == [x for blk in b.blocks for x in range(blk * 4, blk * 4 + 4)]
    c = Sequence()
    assert m.match(c, list(range(8))) == 4                    # at least one token to feed: one block
    e, f = Sequence(), Sequence()
    assert m.match(e, [0, 1, 2, 3, 5, 5, 6, 7, 8]) == 4        # the second block differs
    assert m.match(f, [1, 2, 3, 4, 5]) == 0
    assert m.queries == 9 + 8 + 9 + 5 and m.hits == 8 + 4 + 4
    assert m.ref[b.blocks[0]] == 3                             # b, c and e hold the first block
    for s in (b, c, e, f):
        m.release(s)
    # Eviction: take every block; the cached ones go last, least recently freed first.
    d = Sequence()
    assert m.ensure(d, 6 * 4) and m.free_blocks == 0 and not m.cached
    m.release(d)
    assert m.match(Sequence(), list(range(9))) == 0           # evicted: gone from the cache
    assert m.free_blocks == 6


def test_a_parent_evicted_invalidates_its_children():
    m = KVManager(num_blocks=3, block_size=2, state_slots=0, device="cpu")
    a = Sequence()
    _fed(m, a, [1, 2, 3, 4, 5])
    m.release(a)                                # blocks: [1,2] cached, [3,4] cached, [5] free
    x = Sequence()
    assert m.ensure(x, 4)                       # free block, then the LRU cached one: the tail [3,4] goes first
    h = Sequence()
    assert m.match(h, [1, 2, 3, 4, 9]) == 2
    m.release(h)
    m.release(x)
    y = Sequence()
    assert m.ensure(y, 6)                       # everything: [1,2] evicted too
    m.release(y)
    assert m.match(Sequence(), [1, 2, 3, 4, 9]) == 0 and m.free_blocks == 3




def _chat(store, caching: bool, kv_tokens=None):
    """32 requests sharing a 1,000-token system prompt, each with its own question, 8 greedy tokens."""
    system = [(7 * i) % 90 + 3 for i in range(1000)]
    prompts = [system + [(i * 13 + j) % 90 + 3 for j in range(6 + i % 5)] for i in range(32)]
    model, st = load_model(store)
    try:
        if kv_tokens:
            model.init_kv(kv_tokens * model.kv_bytes_per_token())
        eng = Engine(model, st, max_batch=8, prefill_chunk=64, prefix_caching=caching)
        ids = [eng.add_request(p, SamplingParams(max_tokens=8, ignore_eos=True)) for p in prompts]
        eng.run()
        fed = sum(r.tokens for r in eng.steps)
        decode = 32 * 7                         # after its prompt a request feeds 7 of its 8 tokens
        return [eng.done[i].output for i in ids], fed - decode, eng.kv, sum(len(p) for p in prompts)
    finally:
        st.close()


@pytest.mark.slow
def test_a_shared_system_prompt_is_computed_once(store):
    off, prefill_off, _, total = _chat(store, False)
    on, prefill_on, mgr, _ = _chat(store, True)
    assert prefill_off == total
    assert on == off
    assert prefill_on <= 0.1 * prefill_off, (prefill_on, prefill_off)
    assert mgr.hits == prefill_off - prefill_on and mgr.queries >= total
    # a cache too small to keep the prefix for everyone: evictions, the same outputs
    small, _, _, _ = _chat(store, True, kv_tokens=3 * 1024)
    assert small == off


def test_state_snapshots_at_block_boundaries():
    """Per-sequence state: a prefix matches only up to its deepest block with a snapshot of the state after it,
    which is copied into the new sequence's own slot; snapshots are evicted LRU and with their block."""
    copies = []
    m = KVManager(num_blocks=8, block_size=2, state_slots=2, device="cpu", snapshots=2,
                     copy_state=lambda src, dst: copies.append((src, dst)))
    a = Sequence()
    _fed(m, a, [1, 2, 3, 4])
    m.snapshot(a, [1, 2, 3, 4])                    # the state after block [1, 2][3, 4] -> a spare slot
    assert a.state == 0 and copies == [(0, 2)]      # sequences' slots 0-1, snapshots 2-3
    _fed(m, a, [1, 2, 3, 4, 5, 6])
    m.snapshot(a, [1, 2, 3, 4, 5, 6])
    assert copies[-1] == (0, 3) and not m.free_snap
    b = Sequence()
    assert m.match(b, [1, 2, 3, 4, 5, 6, 7]) == 6 and b.state == 1 and copies[-1] == (3, 1)
    m.release(b)
    c = Sequence()
    assert m.match(c, [1, 2, 3, 4, 9, 9, 9]) == 4 and copies[-1] == (2, c.state)   # the shallower snapshot
    assert c.cached_to == 4
    m.release(c)
    d = Sequence()
    assert m.match(d, [1, 2, 7]) == 0 and d.state is None and d.cached_to == 2    # block cached, no snapshot after it
    # a third snapshot evicts the least recently used one (after [5, 6]: c used the one after [3, 4] since)
    _fed(m, a, [1, 2, 3, 4, 5, 6, 7, 8])
    m.snapshot(a, [1, 2, 3, 4, 5, 6, 7, 8])
    assert len(m.snap) == 2 and a.blocks[1] in m.snap and a.blocks[2] not in m.snap
    # evicting a block drops its snapshot and frees the slot
    m.release(a)
    e = Sequence()
    assert m.ensure(e, 16) and not m.snap and len(m.free_snap) == 2


def test_without_spare_slots_stateful_models_do_not_match():
    m = KVManager(num_blocks=4, block_size=2, state_slots=1, device="cpu")
    a = Sequence()
    _fed(m, a, [1, 2, 3, 4])
    m.snapshot(a, [1, 2, 3, 4])
    m.release(a)
    assert m.match(Sequence(), [1, 2, 3, 4, 5]) == 0


def test_a_prefix_computed_twice_files_what_follows_under_the_cached_chain():
    """Two sequences compute the same first block (admitted together); the second's next block is filed after the
    cached copy, so a third request finds both blocks."""
    m = KVManager(num_blocks=8, block_size=2, state_slots=0, device="cpu")
    a, b = Sequence(), Sequence()
    _fed(m, a, [1, 2, 3])
    _fed(m, b, [1, 2, 5, 6, 7])                 # its block [1, 2] duplicates a's: not registered
    assert b.blocks[0] not in m.key_of
    c = Sequence()
    assert m.match(c, [1, 2, 5, 6, 9]) == 4    # a's [1, 2] then b's [5, 6]
    assert c.blocks == [a.blocks[0], b.blocks[1]]
