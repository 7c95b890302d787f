"""OpenAI's Responses API (runtime/serve/responses_api.py) through the official client's ``responses.create`` -
plain, streamed (its events), with function tools and a continuation by ``previous_response_id`` - on two families
(Qwen3-MoE with Hermes calls, gpt-oss with harmony channels and reasoning items); the reply each time is the one the
chat completions API gives for the same conversation and sampling (the reference)."""
import json

import pytest

from families import serve_family
from helpers import require
from test_sampling_api import _valid
from test_server import client, raw

openai = require("openai", "the official client the server is tested with")
require("transformers", "the families' config classes")

PARAMS = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
          "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]{0,9}$"},
                         "days": {"type": "integer", "minimum": 1, "maximum": 14}}}
TOOL = {"type": "function", "name": "get_weather", "description": "weather at a place", "parameters": PARAMS}
CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "weather at a place",
                                              "parameters": PARAMS}}


# -- the pieces, without a server ------------------------------------------------------------------------------
def test_store_is_bounded_least_recently_used_first_out():
    from runtime.serve.responses_api import ResponseStore
    s = ResponseStore(limit=3, chars=10_000)
    for i in range(4):
        s.put(f"r{i}", {"id": f"r{i}"}, [{"role": "user", "content": "x"}])
    assert s.get("r0") is None and s.get("r1") is not None        # r1 used: r2 is now the oldest
    s.put("r4", {}, [])
    assert s.get("r2") is None and [k for k in s.items] == ["r3", "r1", "r4"]
    big = [{"role": "user", "content": "y" * 4000}]
    s.put("b1", {}, big)
    s.put("b2", {}, big)
    s.put("b3", {}, big)                                          # 3 x 4,000 characters > 10,000: the oldest go
    assert s.size <= 10_000 and s.get("b1") is None and s.get("b3") is not None
    s.put("huge", {}, [{"role": "user", "content": "z" * 20_000}])
    assert s.get("huge") is None                                  # larger than the whole store: not kept


def test_requests_become_chat_requests_and_bad_ones_are_400s():
    from runtime.serve.params import ApiError
    from runtime.serve.responses_api import ResponseStore, parse
    store = ResponseStore()
    req = parse({"model": "m", "instructions": "Be brief.", "max_output_tokens": 5, "tools": [TOOL],
                 "tool_choice": {"type": "function", "name": "get_weather"},
                 "text": {"format": {"type": "json_object"}},
                 "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                           {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                            "arguments": "{}"},
                           {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]}, store)
    assert req.chat["messages"] == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny", "name": "get_weather"}]
    assert req.chat["tools"] == [CHAT_TOOL] and req.chat["max_tokens"] == 5
    assert req.chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert req.chat["response_format"] == {"type": "json_object"}
    assert req.history == req.chat["messages"][1:]                # the instructions are not carried on
    for body, param in (({"input": "x", "n": 2}, "n"), ({"input": 5}, "input"),
                        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
                         "input[0].content"),
                        ({"input": [{"type": "web_search_call"}]}, "input[0].type"),
                        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
                        ({"input": "x", "background": True}, "background"),
                        ({"input": "x", "previous_response_id": "resp_nope"}, "previous_response_id"),
                        ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text")):
        with pytest.raises(ApiError) as e:
            parse({"model": "m", **body}, store)
        assert e.value.status == 400 and e.value.param == param, (body, e.value.message)


# -- served ---------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=["qwen3", "gpt_oss"])
def served(request, tmp_path_factory):
    srv = serve_family(tmp_path_factory, request.param)
    # gpt-oss: replies held (vLLM's guided_grammar) to an analysis message then a final one, as gpt-oss writes them
    srv.extra = {"guided_grammar": harmony_grammar(srv.tok)} if srv.family == "gpt_oss" else {}
    yield srv
    srv.close()


def harmony_grammar(tok) -> str:
    """A Lark grammar (llguidance's: ``<[id]>`` is a token) of harmony's analysis message then its final one."""
    def t(marker):
        return f"<[{tok.token_id(marker)}]>"
    return (f'start: {t("<|channel|>")} "analysis" {t("<|message|>")} /[a-z]{{2,6}}( [a-z]{{2,6}})?/ '
            f'{t("<|end|>")} {t("<|start|>")} "assistant" {t("<|channel|>")} "final" {t("<|message|>")} '
            f'/[A-Z][a-z]{{1,6}}/\n')


def _items(r, kind):
    return [it for it in r.output if it.type == kind]


def _reasoning(r) -> str:
    return "".join(c.text for it in _items(r, "reasoning") for c in it.content or [])


def test_plain_replies_are_the_chat_replies(served):
    """input as a string or as items, with instructions: the output text, the reasoning and the token counts are
    the chat completion's for the same conversation, seed and sampling."""
    c = client(served)
    for seed in range(4):
        common = dict(model=served.model_name, temperature=1.0)
        extra = {"seed": seed, **served.extra}
        r = c.responses.create(input="hello", instructions="Be brief.", max_output_tokens=64, extra_body=extra,
                               **common)
        chat = c.chat.completions.create(messages=[{"role": "system", "content": "Be brief."},
                                                   {"role": "user", "content": "hello"}], max_tokens=64,
                                         extra_body=extra, **common)
        m, finish = chat.choices[0].message, chat.choices[0].finish_reason
        assert r.object == "response" and r.id.startswith("resp_") and r.model == served.model_name
        assert r.status == ("incomplete" if finish == "length" else "completed")
        assert r.output_text == (m.content or "")
        assert _reasoning(r) == ((m.model_extra or {}).get("reasoning_content") or "")
        assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens,
                                                                 chat.usage.completion_tokens)
        assert (r.usage.output_tokens_details.reasoning_tokens > 0) == bool(_reasoning(r))
        if served.family == "gpt_oss":       # the analysis message is reasoning, the final one the text
            assert _reasoning(r) and "<|" not in r.output_text + _reasoning(r)
        else:
            assert not _reasoning(r)
        streamed = ["", ""]      # the chat stream: the same reasoning_content and content
        for x in c.chat.completions.create(messages=[{"role": "system", "content": "Be brief."},
                                                     {"role": "user", "content": "hello"}], max_tokens=64,
                                           stream=True, extra_body=extra, **common):
            if x.choices:
                streamed[0] += (x.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
                streamed[1] += x.choices[0].delta.content or ""
        assert streamed == [_reasoning(r), r.output_text]
        items = c.responses.create(input=[{"role": "system", "content": "Be brief."},
                                          {"type": "message", "role": "user",
                                           "content": [{"type": "input_text", "text": "hello"}]}],
                                   max_output_tokens=64, extra_body=extra, **common)
        assert (items.output_text, _reasoning(items)) == (r.output_text, _reasoning(r))


def _collect(events) -> dict:
    """A streamed response's events checked for order (numbered from 0, created first, each item added then done,
    the last event the response) and accumulated: texts, reasoning and call arguments from their deltas."""
    events = list(events)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[0].response.status == "in_progress"
    assert events[-1].type in ("response.completed", "response.incomplete")
    out = {"text": "", "reasoning": "", "args": {}, "done_args": {}, "open": [], "final": events[-1].response}
    for e in events:
        if e.type == "response.output_item.added":
            assert not out["open"], "an item opened before the last one was done"
            out["open"].append(e.item.id)
        elif e.type == "response.output_item.done":
            assert out["open"] == [e.item.id]
            out["open"].pop()
        elif e.type == "response.output_text.delta":
            out["text"] += e.delta
        elif e.type == "response.reasoning_text.delta":
            out["reasoning"] += e.delta
        elif e.type == "response.function_call_arguments.delta":
            out["args"][e.item_id] = out["args"].get(e.item_id, "") + e.delta
        elif e.type == "response.function_call_arguments.done":
            out["done_args"][e.item_id] = e.arguments
    assert not out["open"]
    return out


def test_streamed_events_add_up_to_the_response(served):
    c = client(served)
    for seed in range(3):
        kw = dict(model=served.model_name, input="hello", max_output_tokens=64, temperature=1.0,
                  extra_body={"seed": seed, **served.extra})
        r = c.responses.create(**kw)
        s = _collect(c.responses.create(stream=True, **kw))
        final = s["final"]
        assert (s["text"], s["reasoning"]) == (r.output_text, _reasoning(r))
        assert (final.output_text, _reasoning(final), final.status) == (r.output_text, _reasoning(r), r.status)
        assert [it.type for it in final.output] == [it.type for it in r.output]
        assert final.usage.output_tokens == r.usage.output_tokens


def test_function_calls_streamed_and_continued(served):
    """tool_choice required / named: function_call items whose arguments validate, streamed as argument deltas that
    add up to them; the call's output sent back with previous_response_id is the same conversation as sending it
    all again; an unknown previous response is OpenAI's 400."""
    c = client(served)
    q = "weather in Paris for 3 days?"
    for choice in ("required", {"type": "function", "name": "get_weather"}):
        kw = dict(model=served.model_name, input=q, tools=[TOOL], tool_choice=choice, max_output_tokens=128,
                  temperature=1.0, parallel_tool_calls=False, extra_body={"seed": 1})
        r = c.responses.create(**kw)
        assert r.status == "completed", r.output
        calls = _items(r, "function_call")
        assert calls and not _items(r, "message")
        for call in calls:
            assert call.name == "get_weather" and call.call_id.startswith("call_")
            assert _valid(json.loads(call.arguments), PARAMS), call.arguments
        s = _collect(c.responses.create(stream=True, **kw))
        streamed = _items(s["final"], "function_call")
        assert [(x.name, x.arguments) for x in streamed] == [(x.name, x.arguments) for x in calls]
        assert all(s["args"][x.id] == s["done_args"][x.id] == x.arguments for x in streamed)
    follow = [{"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny, 21 C"}]
    r2 = c.responses.create(model=served.model_name, previous_response_id=r.id, input=follow, tools=[TOOL],
                            max_output_tokens=4, temperature=0)
    whole = [{"role": "user", "content": q}] + [{"type": "function_call", "call_id": x.call_id, "name": x.name,
                                                 "arguments": x.arguments} for x in calls] + follow
    r3 = c.responses.create(model=served.model_name, input=whole, tools=[TOOL], max_output_tokens=4, temperature=0,
                            store=False)
    assert r2.previous_response_id == r.id
    assert r2.usage.input_tokens == r3.usage.input_tokens > r.usage.input_tokens
    assert (r2.output_text, r2.status) == (r3.output_text, r3.status)
    assert c.responses.retrieve(r2.id).output_text == r2.output_text
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(r3.id)                                # store: false - not kept
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model=served.model_name, previous_response_id=r3.id, input="and tomorrow?")
    assert e.value.code == "previous_response_not_found"


def test_structured_text_format_and_errors(served):
    c = client(served)
    schema = {"type": "object", "additionalProperties": False, "required": ["ok"],
              "properties": {"ok": {"type": "boolean"}}}
    r = c.responses.create(model=served.model_name, input="ok?", max_output_tokens=32, temperature=0,
                           text={"format": {"type": "json_schema", "name": "answer", "schema": schema}})
    if r.status == "completed":
        assert _valid(json.loads(r.output_text), schema), r.output_text
    status, err = raw(served, "POST", "/v1/responses", {"model": served.model_name, "input": "x",
                                                        "tools": [{"type": "file_search"}]})
    assert status == 400 and err and json.loads(err)["error"]["param"] == "tools[0].type"
    status, _ = raw(served, "POST", "/v1/responses", {"model": served.model_name, "input": "x"}, key="wrong")
    assert status == 401
