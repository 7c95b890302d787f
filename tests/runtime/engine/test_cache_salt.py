"""cache_salt (issue 32, finding 3): the prefix cache told one client what another sent - a prefix someone else
sent came back in 0.07 s, a fresh one in 1.0 s. A salt keys a prompt's blocks apart (vLLM's cache_salt): blocks are
shared only between requests of the same salt, so another salt's prefix costs what a fresh one does."""
import statistics

from runtime.engine import Engine, SamplingParams
from runtime.engine.kv_manager import KVManager
from runtime.model import load_model
from runtime.model.layers.cache import Sequence


def _fed(m: KVManager, seq: Sequence, tokens: list, salt=None) -> None:
    """What the model does for a chunk: blocks for the tokens, length advanced, then the scheduler registers."""
    assert m.ensure(seq, len(tokens))
    seq.length = len(tokens)
    m.register(seq, tokens, salt)


def test_blocks_are_shared_only_under_the_same_salt():
    m = KVManager(num_blocks=32, block_size=4, state_slots=0, device="cpu")
    toks = list(range(13))                           # three full blocks, one token left to feed
    alice = Sequence()
    _fed(m, alice, toks, "alice")
    held = list(alice.blocks)
    m.release(alice)
    for salt in ("bob", None, "alicf", "alice "):
        assert m.match(Sequence(), toks, salt) == 0, salt
    a2 = Sequence()
    assert m.match(a2, toks, "alice") == 12 and a2.blocks == held[:3]
    plain = Sequence()
    _fed(m, plain, toks)                             # unsalted: its own copy, shared with unsalted requests only
    assert not set(plain.blocks) & set(held[:3])          # (held[3], alice's partial block, was freed)
    plain_held = list(plain.blocks)
    m.release(plain)
    p2 = Sequence()
    assert m.match(p2, toks) == 12 and p2.blocks == plain_held[:3]
    # a salt is not a token: a prompt that starts with the salt's text as tokens matches nothing of it
    assert m.match(Sequence(), ["salt", "alice"] + toks, None) == 0


def test_state_snapshots_follow_their_salt():
    """Models with per-sequence state match only up to a snapshot: one filed under a salt is not another's."""
    m = KVManager(num_blocks=8, block_size=2, state_slots=2, device="cpu", snapshots=2,
                  copy_state=lambda src, dst: None)
    a = Sequence()
    _fed(m, a, [1, 2, 3, 4], "x")
    m.snapshot(a, [1, 2, 3, 4], "x")
    m.release(a)
    other = Sequence()
    assert m.match(other, [1, 2, 3, 4, 5], "y") == 0 and other.state is None
    same = Sequence()
    assert m.match(same, [1, 2, 3, 4, 5], "x") == 4 and same.state is not None


def _engine(store):
    model, st = load_model(store)
    return Engine(model, st, max_batch=4, prefill_chunk=256), st


def _one(eng, prompt: list, salt) -> tuple:
    """Run one request alone: (its cached_tokens, prompt tokens the engine fed for it, seconds to first token)."""
    steps = len(eng.steps)
    i = eng.add_request(prompt, SamplingParams(max_tokens=2, ignore_eos=True), cache_salt=salt)
    eng.run()
    r = eng.done.pop(i)
    fed = sum(s.tokens for s in eng.steps[steps:]) - 1           # less the one decode step's token
    return r.cached_tokens, fed, r.first_token_time - r.arrival


def test_another_salt_costs_what_a_fresh_prefix_costs(store):
    """The engine's side of the TTFT gap: another salt's prefix is fed whole (as a fresh one), its cached_tokens
    is 0; the same salt's is served from the cache (whole blocks of the shared prefix)."""
    eng, st = _engine(store)
    try:
        bs = eng.kv.block_size
        prefix = [(7 * i) % 200 + 3 for i in range(600)]
        cached, fed, _ = _one(eng, prefix + [5, 6, 7], "victim")
        assert (cached, fed) == (0, len(prefix) + 3)
        cached, fed, _ = _one(eng, prefix + [8, 9], "attacker")
        assert (cached, fed) == (0, len(prefix) + 2)                 # nothing reused: all of it fed
        cached, fed, _ = _one(eng, prefix + [8, 9], None)            # unsalted: nor the unsalted cache
        assert (cached, fed) == (0, len(prefix) + 2)
        cached, fed, _ = _one(eng, prefix + [10, 11, 12], "victim")
        want = min(len(prefix), len(prefix) + 3 - 1) // bs * bs      # whole blocks of the shared prefix
        assert want == 592 and (cached, fed) == (want, len(prefix) + 3 - want)
        # two salts at once share no block (the second is not held back for the first's prefix either)
        a = eng.add_request(prefix + [1], SamplingParams(max_tokens=2, ignore_eos=True), cache_salt="a")
        b = eng.add_request(prefix + [1], SamplingParams(max_tokens=2, ignore_eos=True), cache_salt="b")
        eng.step()
        ra, rb = (next(r for r in eng.scheduler.running if r.id == x) for x in (a, b))
        assert ra.seq.blocks and rb.seq.blocks and not set(ra.seq.blocks) & set(rb.seq.blocks)
        eng.run()
    finally:
        st.close()


def test_the_time_to_first_token_gap_is_gone_across_salts(store):
    """The side channel itself, timed as the issue did (generous margins for a busy machine): per trial a new
    1,500-token prefix the victim sent; the same salt's repeat is fast (the channel the salt closes is real), another
    salt's is as slow as a fresh prefix."""
    eng, st = _engine(store)
    try:
        same, other, fresh = [], [], []
        for t in range(5):
            prefix = [(11 * i + 31 * t) % 250 + 3 for i in range(1500)]
            _one(eng, prefix + [1], "victim")
            other.append(_one(eng, prefix + [2], "attacker")[2])
            same.append(_one(eng, prefix + [3], "victim")[2])
            fresh.append(_one(eng, [(x + 1) % 250 + 3 for x in prefix] + [2], "attacker")[2])
        s, o, f = (statistics.median(x) for x in (same, other, fresh))
        assert s < 0.5 * f, (same, fresh)
        assert o > 0.6 * f, (other, fresh)
    finally:
        st.close()
