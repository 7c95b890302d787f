"""Issue 32: what a client sends costs the others a bounded delay, and a grammar that cannot be served is the
client's error. Admission (runtime/serve/admission.py) compiles each grammar in a worker process under a size and a
CPU-time budget, refuses with a 400 that names the field and the limit, and keeps its verdicts; the engine compiles
what was admitted off its loop; a grammar refused for its content never makes /health say the engine fails; tools
as clients write them ($defs / $ref, strict); a reply cut by max_tokens keeps its complete calls, streamed or not."""
import json
import time

import pytest

from helpers import require
from test_sampling_api import TIME, WEATHER, _valid
from test_server import client, raw

openai = require("openai", "the official client the server is tested with")

# a required property that refers to itself: no finite JSON value has it
RECURSIVE = {"$defs": {"node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}},
                                "required": ["next"]}}, "$ref": "#/$defs/node"}
# what Pydantic writes for a model with a nested model and an enum
PYDANTIC = {"$defs": {"Unit": {"enum": ["C", "F"], "title": "Unit", "type": "string"},
                      "Place": {"properties": {"city": {"maxLength": 8, "title": "City", "type": "string"},
                                               "unit": {"$ref": "#/$defs/Unit"}},
                                "required": ["city", "unit"], "title": "Place", "type": "object",
                                "additionalProperties": False}},
            "properties": {"place": {"$ref": "#/$defs/Place"}}, "required": ["place"], "title": "Args",
            "type": "object", "additionalProperties": False}


def _resolved(schema: dict, root: dict) -> dict:
    """``schema`` with its local $refs replaced by what they name (PYDANTIC has no cycle): for _valid."""
    if "$ref" in schema:
        return _resolved(root["$defs"][schema["$ref"].rsplit("/", 1)[1]], root)
    out = dict(schema)
    if "properties" in out:
        out["properties"] = {k: _resolved(v, root) for k, v in out["properties"].items()}
    return out


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory):
    from runtime.model.synthetic import write_byte_tokenizer
    d = tmp_path_factory.mktemp("admission")
    write_byte_tokenizer(str(d), 512)
    return str(d / "tokenizer.json")


def _refusal(adm, fmt, text, field="response_format"):
    from runtime.serve.params import ApiError
    with pytest.raises(ApiError) as e:
        adm.check(fmt, text, field)
    return e.value


def test_admission_budgets_refuse_naming_the_field_and_the_limit(tokenizer_json):
    """Size: refused before any compile. CPU time: a worker past its budget is killed (the 100,000-value enum takes
    ~0.3 s to find itself too big for llguidance), the refusal kept, so the same grammar again - its keys in another
    order - costs a lookup. A grammar that does not compile or admits no output: a 400 whose message is short and
    quotes no grammar. A good one is admitted, and kept too."""
    from runtime.serve.admission import Admission
    enum = json.dumps({"type": "object", "properties": {"v": {"enum": [f"value-{i}" for i in range(100000)]}}})
    adm = Admission(tokenizer_json, 512, cpu_budget=0.05, max_chars=len(enum) + 10)
    try:
        e = _refusal(adm, "regex", "a" * (len(enum) + 11))
        assert (e.status, e.param, e.code) == (400, "response_format", "grammar_too_large")
        assert "size limit" in e.message and adm.stats["compiled"] == 0
        t = time.monotonic()
        e = _refusal(adm, "json_schema", enum)
        assert (e.status, e.code) == (400, "grammar_too_expensive") and "CPU-time limit" in e.message
        assert time.monotonic() - t < 20 and adm.stats["killed"] == 1
        again = json.dumps({"properties": json.loads(enum)["properties"], "type": "object"})
        t = time.monotonic()
        assert _refusal(adm, "json_schema", again, "guided_json").param == "guided_json"
        assert time.monotonic() - t < 1.0 and adm.stats["compiled"] == 1 and adm.stats["cached"] == 1
        adm.cpu_budget = 5.0
        for fmt, text in (("regex", "(unclosed"), ("json_schema", json.dumps(RECURSIVE)),
                          ("lark", "start: foo\nfoo: " + " | ".join(f'"secret{i}"' for i in range(300)) + " bar\n")):
            e = _refusal(adm, fmt, text)
            assert e.code == "invalid_grammar" and len(e.message) < 300 and "secret1" not in e.message, e.message
        adm.check("json_schema", json.dumps(PYDANTIC), "response_format")
        adm.check("json_schema", json.dumps(PYDANTIC), "response_format")
        assert adm.stats["cached"] == 2
    finally:
        adm.close()


def test_a_grammar_failing_while_generating_is_the_requests_error():
    """A request whose grammar fails in a step (a limit of its own, no token allowed) ends rejected - the front-end
    answers a 400 and /health does not count it - not as an engine error."""
    from runtime.engine.request import FinishReason, Request, SamplingParams
    from runtime.engine.scheduler import Scheduler

    class Blocks:
        def release(self, seq):
            pass

    class Failed:
        failed = True
    s = Scheduler(Blocks(), max_batch=1, max_active=1, prefill_chunk=8, step_tokens=None, schedule="fcfs",
                  num_moe_layers=1, num_experts=2)
    r = Request(id=1, prompt=[1], params=SamplingParams())
    assert s.fail(r, "GrammarError: x").finish_reason == FinishReason.ERROR
    r = Request(id=2, prompt=[1], params=SamplingParams())
    r.matcher = Failed()
    assert s.fail(r, "GrammarError: x").finish_reason == FinishReason.REJECTED


def test_schemas_that_cannot_be_served_are_400s_and_health_stays_up(server):
    """A recursive required $ref is a 400 naming response_format (it was a 500 echoing the grammar), answered after
    the refusal delay; a 100,000-value enum is refused by the size limit; many of them leave /health at 200; a
    json_schema without its name (OpenAI requires one) is a 400 too."""
    msgs = [{"role": "user", "content": "x"}]
    body = {"model": server.model_name, "messages": msgs, "max_tokens": 8,
            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": RECURSIVE}}}
    for _ in range(4):
        t = time.monotonic()
        status, data = raw(server, "POST", "/v1/chat/completions", body)
        err = json.loads(data)["error"]
        assert status == 400 and err["param"] == "response_format" and len(err["message"]) < 300, data
        # answered no sooner than REFUSAL_DELAY_S: a client looping on refusals sends a few a second at most
        assert time.monotonic() - t >= server.admission.refusal_delay - 0.05
    enum = {"type": "object", "properties": {"v": {"enum": [f"value-{i}" for i in range(100000)]}}}
    body["response_format"]["json_schema"]["schema"] = enum
    status, data = raw(server, "POST", "/v1/chat/completions", body)
    assert status == 400 and json.loads(data)["error"]["code"] == "grammar_too_large"
    assert raw(server, "GET", "/health")[0] == 200
    body["response_format"] = {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}
    status, data = raw(server, "POST", "/v1/chat/completions", body)
    assert status == 400 and json.loads(data)["error"]["param"] == "response_format.json_schema.name"


def test_tool_parameters_with_defs_and_refs(server):
    """Pydantic's $defs / $ref in a tool's parameters: served for required and named calls (they were refused), the
    arguments valid against the schema with its refs resolved."""
    c = client(server)
    tool = {"type": "function", "function": {"name": "place_weather", "parameters": PYDANTIC}}
    ok = 0
    for seed in range(3):
        for choice in ("required", {"type": "function", "function": {"name": "place_weather"}}):
            r = c.chat.completions.create(model=server.model_name, messages=[{"role": "user", "content": "w?"}],
                                          tools=[tool, TIME], tool_choice=choice, seed=seed, max_tokens=160,
                                          temperature=1.0)
            for call in r.choices[0].message.tool_calls or []:
                if call.function.name == "place_weather":
                    assert _valid(json.loads(call.function.arguments), _resolved(PYDANTIC, PYDANTIC))
                    ok += 1
    assert ok >= 2


def test_strict_tools_take_no_other_properties(tokenizer_json):
    """strict: true (OpenAI's strict mode): the call grammar refuses a property the parameters do not name, at every
    level; without it the schema's own default (other properties allowed) holds."""
    from runtime.engine.grammar import GrammarTokenizer
    from runtime.serve.tool_parsers import parse_tools
    from runtime.tokenizer import Tokenizer
    tok = Tokenizer(tokenizer_json.rsplit("/", 1)[0])
    gt = GrammarTokenizer(tokenizer_json, 512, [])
    params = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}}}}

    def accepts(strict: bool, text: str) -> bool:
        fn = {"name": "f", "parameters": params, **({"strict": True} if strict else {})}
        tools = parse_tools({"tools": [{"type": "function", "function": fn}], "tool_choice": "required"})
        m = gt.matcher(*tools.grammar())
        return all(m.m.consume_token(i) for i in tok.encode(text)) and m.m.is_accepting()
    for text in ('[{"name": "f", "arguments": {"a": {"b": 1}, "c": 2}}]',
                 '[{"name": "f", "arguments": {"a": {"b": 1, "c": 2}}}]'):
        assert accepts(False, text) and not accepts(True, text)
    assert accepts(True, '[{"name": "f", "arguments": {"a": {"b": 1}}}]')


CUT = ('[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, {"name": "get_time", "arguments": '
       '{"zone": "UTC"}}, {"name": "get_weather", "arguments": {"city": "Ly')


def test_a_cut_reply_keeps_its_complete_calls_streamed_and_not():
    """Cut by max_tokens in its third call: the reply keeps the two complete calls (it lost them), and a stream,
    fed the text as it grows, sends exactly those two - each whole, arguments JSON - never the partial third."""
    from runtime.serve.tool_parsers import Tools, cut_reply, new_calls, tool_format
    fns = [{**t["function"], "description": ""} for t in (WEATHER, TIME)]
    tools = Tools(fns, "required")
    fmt = tool_format(None)
    content, calls = cut_reply(tools, fmt, CUT)
    want = [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"zone": "UTC"})]
    assert content is None and [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == want
    sent: list = []
    deltas = [d for k in range(len(CUT) + 1) for d in new_calls(tools, fmt, CUT[:k], sent)]
    assert [(d["index"], d["function"]["name"], json.loads(d["function"]["arguments"])) for d in deltas] == \
        [(i, n, a) for i, (n, a) in enumerate(want)]
    # auto (Hermes): the content before the calls, the complete call; cut before any call is complete: the text
    auto = Tools(fns, "auto")
    text = ('Sure.<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_w')
    content, calls = cut_reply(auto, fmt, text)
    assert content == "Sure." and [c["function"]["name"] for c in calls] == ["get_time"]
    assert cut_reply(auto, fmt, text[:40]) == (text[:40], [])


def test_cut_tool_replies_agree_streamed_and_not_on_the_server(server):
    """Through the official client, the same seeded required-calls request cut by max_tokens: streamed and not give
    the same complete calls and finish_reason "length"; every streamed call's arguments are JSON; the stream's
    content is null as the reply's (OpenAI's stream of forced calls)."""
    c = client(server)
    msgs = [{"role": "user", "content": "weather?"}]
    cut = 0
    for seed in range(6):
        # "]" pushed down: the model adds call after call until max_tokens cuts one
        kw = dict(model=server.model_name, messages=msgs, tools=[WEATHER, TIME], tool_choice="required", seed=seed,
                  max_tokens=120, temperature=1.0, logit_bias={str(ord("]")): -100})
        r = c.chat.completions.create(**kw)
        ch = r.choices[0]
        calls = [(t.function.name, t.function.arguments) for t in ch.message.tool_calls or []]
        streamed, content, finish = {}, [], None
        for x in c.chat.completions.create(**kw, stream=True):
            if not x.choices:
                continue
            d = x.choices[0].delta
            content.append(d.content)
            finish = x.choices[0].finish_reason or finish
            for tc in d.tool_calls or []:
                assert tc.index not in streamed and json.loads(tc.function.arguments) is not None
                streamed[tc.index] = (tc.function.name, tc.function.arguments)
        assert [streamed[i] for i in sorted(streamed)] == calls and finish == ch.finish_reason
        assert ch.message.content is None and all(x is None for x in content), content
        if ch.finish_reason == "length" and calls:
            cut += 1
    assert cut >= 4
