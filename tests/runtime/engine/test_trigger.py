"""A request's trigger (a lazy grammar): free output until the model samples the trigger token, then the rest in
the grammar's language (how auto tool calls are finished once the model opens one)."""
import pytest

from runtime.engine import Engine, SamplingParams
from runtime.model import load_model

X = 300          # a plain token of the synthetic tokenizer (<|x300|>): the trigger


@pytest.fixture(scope="module")
def engine(store):
    model, st = load_model(store)
    yield Engine(model, st)
    st.close()


def _run(eng, **kw):
    i = eng.add_request([5, 9, 2], SamplingParams(max_tokens=12, temperature=1.0, seed=3, **kw))
    eng.run()
    return eng.done[i]


def test_after_the_trigger_the_grammar_holds(engine):
    r = _run(engine, logit_bias={X: 100}, trigger=(X, "regex", "ab+c"))
    assert r.output[0] == X                                  # free: the bias picks the trigger
    rest = bytes(r.output[1:]).decode()
    assert rest.startswith("ab") and rest.endswith("c") and set(rest[1:-1]) == {"b"}
    assert r.finish_reason == "stop"                   # the grammar completed the output


def test_without_the_trigger_the_output_is_free(engine):
    free = _run(engine, logit_bias={X: -100})
    armed = _run(engine, logit_bias={X: -100}, trigger=(X, "regex", "ab+c"))
    assert armed.output == free.output and X not in armed.output and len(armed.output) == 12


def test_bad_triggers():
    with pytest.raises(ValueError, match="trigger must be"):
        SamplingParams(trigger=(1, "yaml", "x"))
    with pytest.raises(ValueError, match="either a grammar or a trigger"):
        SamplingParams(trigger=(1, "regex", "x"), grammar=("regex", "y"))


def test_a_trigger_grammar_that_does_not_compile_is_the_requests_error(engine):
    # compiled off the engine loop (runtime/engine/grammar.py, GrammarBuilds): the request ends rejected - the
    # server's 400 - and the engine goes on
    i = engine.add_request([5], SamplingParams(trigger=(X, "regex", "(unclosed")))
    engine.run()
    assert engine.done[i].finish_reason == "rejected" and "regex" in engine.done[i].error
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request([5], SamplingParams(trigger=(10**6, "regex", "a")))
