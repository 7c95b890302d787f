"""Issue 32: a grammar compiles off the engine loop - the other requests step while it compiles - and the engine
keeps what it compiled (the same grammar again, a client's tools with every turn, costs a copy)."""
import json
import time

import pytest

from runtime.engine import Engine, SamplingParams
from runtime.model import load_model

# ~0.15 s of compile on this machine's CPU (1,200 properties, each with its own pattern: many lexemes)
BIG = json.dumps({"type": "object", "properties": {
    f"p{i}": {"type": "string", "pattern": f"^[a-z]{{{i % 7 + 1}}}x[0-9]+$"} for i in range(1200)}})


@pytest.fixture(scope="module")
def engine(store):
    model, st = load_model(store)
    yield Engine(model, st)
    st.close()


def test_other_requests_step_while_a_grammar_compiles(engine):
    t0 = time.perf_counter()
    slow = engine.add_request([5, 9], SamplingParams(max_tokens=4, grammar=("json_schema", BIG)))
    added = time.perf_counter() - t0
    fast = engine.add_request([7, 3], SamplingParams(max_tokens=6, ignore_eos=True))
    while fast not in engine.done:
        engine.step()
    pending = len(engine.grammars)            # the big grammar still compiling when the plain request is done
    engine.run()
    assert added < 0.1 and pending == 1, (added, pending)
    r = engine.done[slow]
    assert r.finish_reason in ("stop", "length") and bytes(t for t in r.output if t < 256).decode().startswith("{")
    assert len(engine.done[fast].output) == 6


def test_a_grammar_sent_again_is_not_compiled_again(engine):
    gt = engine._grammar_tokenizer()
    schema = json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})
    a = engine.add_request([5], SamplingParams(max_tokens=8, grammar=("json_schema", schema)))
    engine.run()
    kept = dict(gt._compiled)
    b = engine.add_request([6], SamplingParams(max_tokens=8, grammar=("json_schema", schema)))
    engine.run()
    assert ("json_schema", schema) in kept and gt._compiled[("json_schema", schema)] is kept[("json_schema", schema)]
    for i in (a, b):
        out = bytes(t for t in engine.done[i].output if t < 256).decode()
        assert engine.done[i].finish_reason == "length" or isinstance(json.loads(out)["n"], int), out
