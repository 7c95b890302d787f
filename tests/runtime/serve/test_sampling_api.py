"""logprobs / top_logprobs, n, presence / frequency / repetition penalties and logit_bias through the server,
each checked against a reference computed here from the model's own logits (issue 21)."""
import json

import pytest
import torch

from servehelp import KEY
from test_server import client, raw  # noqa: E402  (same folder)

PROMPT = [5, 9, 2, 7]


@pytest.fixture(scope="module")
def ref(tiny_store):
    """The model's last-token logits for any token list, in-process (one forward per call)."""
    from runtime.engine import Engine
    from runtime.model import load_model
    model, st = load_model(tiny_store[1])
    eng = Engine(model, st)
    yield lambda ids: eng.score([list(ids)])[0].float()
    st.close()


def _penalized(logits, prompt, out, presence=0.0, frequency=0.0, repetition=1.0, bias=None):
    """OpenAI's / vLLM's definitions, written out token by token."""
    x = logits.clone()
    for t, b in (bias or {}).items():
        x[t] += b
    for t in set(prompt) | set(out):
        x[t] = x[t] / repetition if x[t] > 0 else x[t] * repetition
    for t in set(out):
        x[t] -= frequency * out.count(t) + presence
    return x


def _complete(server, **body):
    st, data = raw(server, "POST", "/v1/completions", {"model": server.model_name, "prompt": PROMPT, "temperature": 0,
                                                        "max_tokens": 6, **body})
    assert st == 200, data
    return json.loads(data)


def test_completion_logprobs_are_the_models(server, ref):
    r = _complete(server, logprobs=5)["choices"][0]
    lp = r["logprobs"]
    ids = []
    for i, (tok_text, tok_lp, top) in enumerate(zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"])):
        want = ref(PROMPT + ids).log_softmax(-1)
        best = int(want.argmax())                        # greedy: the sampled token is the most likely
        assert tok_text == server.tok.decode([best])
        assert tok_lp == pytest.approx(float(want[best]), abs=1e-4)
        vals, idx = want.topk(5)
        assert list(top.values()) == pytest.approx(vals.tolist(), abs=1e-4)
        assert len(top) == len({server.tok.decode([int(j)]) for j in idx})
        ids.append(best)
    assert len(lp["tokens"]) == 6 and "".join(lp["tokens"]) == r["text"]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(6)]


def test_chat_logprobs_with_the_official_client_streamed_and_not(server):
    c = client(server)
    msgs = [{"role": "user", "content": "hello there"}]
    full = c.chat.completions.create(model=server.model_name, messages=msgs, max_tokens=5, temperature=0, logprobs=True,
                                     top_logprobs=3)
    content = full.choices[0].logprobs.content
    assert len(content) == 5 and all(len(x.top_logprobs) == 3 for x in content)
    assert all(x.top_logprobs[0].logprob >= x.top_logprobs[1].logprob >= x.top_logprobs[2].logprob for x in content)
    assert all(x.logprob == pytest.approx(x.top_logprobs[0].logprob) for x in content)     # greedy
    assert "".join(x.token for x in content) == full.choices[0].message.content
    assert all(bytes(x.bytes).decode() == x.token for x in content)
    streamed = []
    for ch in c.chat.completions.create(model=server.model_name, messages=msgs, max_tokens=5, temperature=0,
                                        logprobs=True, top_logprobs=3, stream=True):
        if ch.choices and ch.choices[0].logprobs is not None:
            streamed += ch.choices[0].logprobs.content
    assert [(x.token, x.logprob) for x in streamed] == [(x.token, x.logprob) for x in content]
    plain = c.chat.completions.create(model=server.model_name, messages=msgs, max_tokens=5, temperature=0)
    assert plain.choices[0].logprobs is None


@pytest.mark.parametrize("knobs", [dict(frequency_penalty=1.5), dict(presence_penalty=2.0),
                                   dict(repetition_penalty=1.8), dict(frequency_penalty=-0.5, presence_penalty=0.7,
                                                                      repetition_penalty=1.2)])
def test_penalties_follow_their_definitions(server, ref, knobs):
    """Greedy with penalties: each token is the argmax of the model's logits as penalized by the formula above."""
    r = _complete(server, logprobs=0, max_tokens=8, **knobs)["choices"][0]
    out = []
    for _ in range(8):
        x = _penalized(ref(PROMPT + out), PROMPT, out, presence=knobs.get("presence_penalty", 0.0),
                       frequency=knobs.get("frequency_penalty", 0.0), repetition=knobs.get("repetition_penalty", 1.0))
        out.append(int(x.argmax()))
    assert r["logprobs"]["tokens"] == [server.tok.decode([t]) for t in out]
    plain = _complete(server, logprobs=0, max_tokens=8)["choices"][0]["logprobs"]["tokens"]
    assert plain != r["logprobs"]["tokens"] or len(set(out)) == 1, "the penalty changed nothing"


def test_logit_bias(server, ref):
    out = []
    r = _complete(server, logprobs=0, logit_bias={"11": 100, "3": -100})["choices"][0]
    for _ in range(6):
        out.append(int(_penalized(ref(PROMPT + out), PROMPT, out, bias={11: 100.0, 3: -100.0}).argmax()))
    assert out == [11] * 6
    assert r["logprobs"]["tokens"] == [server.tok.decode([t]) for t in out]
    # the logprobs stay the model's own (vLLM's raw_logprobs): the bias does not make token 11 certain
    assert r["logprobs"]["token_logprobs"][0] == pytest.approx(float(ref(PROMPT).log_softmax(-1)[11]), abs=1e-4)


def test_n_choices(server):
    """n choices: greedy ones are equal; seeded ones are the n=1 requests with seeds seed, seed + 1, ..."""
    r = _complete(server, n=3)
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    assert len({c["text"] for c in r["choices"]}) == 1 and r["usage"]["completion_tokens"] == 18
    many = _complete(server, n=3, temperature=1.5, seed=41, max_tokens=10)["choices"]
    one = [_complete(server, temperature=1.5, seed=41 + i, max_tokens=10)["choices"][0]["text"] for i in range(3)]
    assert [c["text"] for c in many] == one
    # streamed: every chunk names its choice, and each choice's deltas add up to its text
    import http.client
    c = http.client.HTTPConnection(server.host, server.port, timeout=60)
    c.request("POST", "/v1/completions", json.dumps({"model": server.model_name, "prompt": PROMPT, "n": 3,
                                                      "temperature": 1.5, "seed": 41, "max_tokens": 10, "stream": True}),
              {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    texts = ["", "", ""]
    for line in c.getresponse().read().decode().splitlines():
        if line.startswith("data: {"):
            for ch in json.loads(line[6:])["choices"]:
                texts[ch["index"]] += ch["text"]
    assert texts == one


def test_n_choices_share_the_prompts_blocks(server):
    """The n choices of one request are n engine requests; the first computes the prompt, the others start
    from its cached blocks (prefix caching): the prompt's full blocks are computed once."""
    from test_server import metric
    prompt = [(3 * i) % 60 + 4 for i in range(40)]
    before = metric(server, "tiered_moe_prefix_cache_hits_total")
    st, data = raw(server, "POST", "/v1/completions", {"model": server.model_name, "prompt": prompt, "n": 4,
                                                        "max_tokens": 3, "temperature": 0})
    assert st == 200 and len(json.loads(data)["choices"]) == 4
    assert metric(server, "tiered_moe_prefix_cache_hits_total") - before >= 3 * 32    # 2 full blocks of 16, x 3




# -- structured output -----------------------------------------------------------------------------------
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
                         "ok": {"type": "boolean"}}}


def _valid(v, schema) -> bool:
    """JSON Schema's meaning of the keywords SCHEMA uses, written out (draft 2020-12)."""
    t = schema.get("type")
    if "enum" in schema:
        return v in schema["enum"]
    if t == "object":
        props = schema.get("properties", {})
        return (isinstance(v, dict) and all(k in v for k in schema.get("required", []))
                and (schema.get("additionalProperties", True) or set(v) <= set(props))
                and all(_valid(v[k], props[k]) for k in v if k in props))
    if t == "array":
        return (isinstance(v, list) and len(v) <= schema.get("maxItems", len(v))
                and all(_valid(x, schema["items"]) for x in v))
    if t == "string":
        import re
        return (isinstance(v, str) and len(v) <= schema.get("maxLength", len(v))
                and re.search(schema.get("pattern", ""), v) is not None)
    if t == "integer":
        return (isinstance(v, int) and not isinstance(v, bool) and schema.get("minimum", v) <= v
                <= schema.get("maximum", v))
    if t == "boolean":
        return isinstance(v, bool)
    return False


def test_json_schema_output_validates_streamed_and_not(server):
    """response_format json_schema through the official client: every output that ends (finish_reason stop) is JSON
    that validates against the schema, streamed or not; the two agree for the same seed."""
    c = client(server)
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    msgs = [{"role": "user", "content": "a person, as JSON"}]
    ended = 0
    for seed in range(6):
        r = c.chat.completions.create(model=server.model_name, messages=msgs, max_tokens=96, temperature=1.0, seed=seed,
                                      response_format=rf)
        ch = r.choices[0]
        text = ch.message.content
        streamed = "".join(x.choices[0].delta.content or "" for x in c.chat.completions.create(
            model=server.model_name, messages=msgs, max_tokens=96, temperature=1.0, seed=seed, response_format=rf,
            stream=True) if x.choices)
        assert streamed == text
        if ch.finish_reason == "stop":
            ended += 1
            v = json.loads(text)
            assert _valid(v, SCHEMA), text
        else:                        # cut by max_tokens: a prefix of valid JSON, never anything else
            assert ch.finish_reason == "length" and text.startswith('{"name": "')
    assert ended >= 3
    # json_object: any JSON object
    r = c.chat.completions.create(model=server.model_name, messages=msgs, max_tokens=64, temperature=1.0, seed=1,
                                  response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].message.content.startswith("{")


def test_a_schema_that_does_not_compile_is_a_400(server):
    st, data = raw(server, "POST", "/v1/chat/completions", {
        "model": server.model_name, "messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer",
                                                                                           "minimum": "zero"}}}})
    assert st == 400, data
    assert "json_schema" in json.loads(data)["error"]["message"]



# -- tools ------------------------------------------------------------------------------------------------------
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "weather at a place",
                                             "parameters": {"type": "object", "additionalProperties": False,
                                                            "required": ["city", "days"],
                                                            "properties": {"city": {"type": "string", "maxLength": 10},
                                                                           "days": {"type": "integer"}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["zone"],
    "properties": {"zone": {"enum": ["UTC", "CET"]}}}}}


def test_required_and_named_tool_calls_with_the_official_client(server):
    """tool_choice required / named: the output is constrained to the calls' JSON, so every call parses, names an
    offered tool (the named one), and its arguments validate against that tool's parameters - streamed or not."""
    c = client(server)
    msgs = [{"role": "user", "content": "weather in Paris for 3 days?"}]
    params = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    done = 0
    for seed in range(4):
        for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
            r = c.chat.completions.create(model=server.model_name, messages=msgs, tools=[WEATHER, TIME], seed=seed,
                                          tool_choice=choice, max_tokens=96, temperature=1.0)
            ch = r.choices[0]
            if ch.finish_reason == "length":
                continue
            done += 1
            assert ch.finish_reason == "tool_calls" and ch.message.content is None and ch.message.tool_calls
            for call in ch.message.tool_calls:
                assert call.type == "function" and call.id.startswith("call_")
                if choice != "required":
                    assert call.function.name == "get_time"
                assert _valid(json.loads(call.function.arguments), params[call.function.name])
            streamed: dict = {}              # a client's accumulation: by index, the pieces of the arguments appended
            for x in c.chat.completions.create(model=server.model_name, messages=msgs, tools=[WEATHER, TIME],
                                               seed=seed, tool_choice=choice, max_tokens=96, temperature=1.0,
                                               stream=True):
                for tc in (x.choices[0].delta.tool_calls or []) if x.choices else []:
                    cur = streamed.setdefault(tc.index, [tc.function.name, ""])
                    cur[1] += tc.function.arguments or ""
            assert [tuple(streamed[i]) for i in sorted(streamed)] == \
                [(t.function.name, t.function.arguments) for t in ch.message.tool_calls]
    assert done >= 4
    # a conversation that carries a call and its result renders and is served
    r = c.chat.completions.create(model=server.model_name, max_tokens=4, tools=[WEATHER], tool_choice="auto", messages=[
        *msgs, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris", "days": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    import openai
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        c.chat.completions.create(model=server.model_name, messages=msgs, tools=[WEATHER],
                                  tool_choice={"type": "function", "function": {"name": "nope"}})


@pytest.mark.parametrize("family, text, content", [
    ("hermes", 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
               '</tool_call>', "Let me check."),
    ("glm45", 'Sure.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days'
              '</arg_key>\n<arg_value>3</arg_value>\n</tool_call>', "Sure."),
    ("kimi_k2", '<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
                '{"city": "Paris", "days": 3}<|tool_call_end|><|tool_calls_section_end|>', None),
    ("deepseek_v3", '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n'
                    '{"city": "Paris", "days": 3}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>', None),
    ("harmony", '<|channel|>analysis<|message|>need weather<|end|><|start|>assistant<|channel|>commentary '
                'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", "days": 3}<|call|>', None),
])
def test_each_familys_tool_call_format_parses(family, text, content):
    """The families' tool-call formats as their chat templates define them, written out here."""
    from runtime.serve.tool_parsers import FORMATS, parse_auto, tool_format
    fmt = next(f for f in FORMATS if f.name == family)
    assert tool_format("{% for t in tools %}" + fmt.marker + "{% endfor %}") is fmt   # picked by its template
    got_content, calls = parse_auto(fmt, text)
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("get_weather", {"city": "Paris", "days": 3})]
    assert parse_auto(fmt, "no call here") == ("no call here", [])


def test_stop_token_ids_and_ignore_eos(server):
    """stop_token_ids (vLLM's extension) end the output at a named token - also with ignore_eos, which ignores only
    the model's EOS (vLLM's meaning); logit_bias forces the token."""
    r = _complete(server, logit_bias={"11": 100}, stop_token_ids=[11])
    assert r["choices"][0]["finish_reason"] == "stop" and r["usage"]["completion_tokens"] == 1
    r = _complete(server, logit_bias={"11": 100}, stop_token_ids=[11], ignore_eos=True)
    assert r["choices"][0]["finish_reason"] == "stop" and r["usage"]["completion_tokens"] == 1
    r = _complete(server, logit_bias={"11": 100}, ignore_eos=True)
    assert r["choices"][0]["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 6


def test_a_stop_string_inside_a_required_call_returns_the_text(server):
    """A stop string can cut the constrained JSON: the choice comes back as its text (finish stop), not a 500."""
    st, data = raw(server, "POST", "/v1/chat/completions", {
        "model": server.model_name, "messages": [{"role": "user", "content": "x"}], "tools": [WEATHER],
        "tool_choice": "required", "stop": ["\"name\""], "max_tokens": 32, "temperature": 0})
    assert st == 200, data
    ch = json.loads(data)["choices"][0]
    assert ch["finish_reason"] == "stop" and ch["message"]["content"] == "[{" and "tool_calls" not in ch["message"]
