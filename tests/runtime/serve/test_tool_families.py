"""Tool calls, structured output and logprobs for real families (Qwen3, GLM-4.5, Kimi K2, DeepSeek-V3): each
family's chat template (tests/runtime/serve/families.py, in its released format), its tokenizer's special tokens,
its tool-call format - parsed back, and constrained once the model opens a call - through the official client."""
import json

import pytest

from families import FAMILIES, build_family
from helpers import require
from servehelp import KEY
from test_sampling_api import SCHEMA, _valid
from test_server import client

require("transformers", "the families' config classes")

# the format each family's template selects, its opening and closing markers
FORMAT = {"qwen3": ("hermes", "<tool_call>", "</tool_call>"), "glm45": ("glm45", "<tool_call>", "</tool_call>"),
          "qwen35": ("qwen3_coder", "<tool_call>", "</tool_call>"),
          "kimi_k2": ("kimi_k2", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"),
          "deepseek_v3": ("deepseek_v3", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")}

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "weather at a place",
                                             "parameters": {"type": "object", "additionalProperties": False,
                                                            "required": ["city", "days"],
                                                            "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]{0,9}$"},
                                                                           "days": {"type": "integer", "minimum": 1,
                                                                                    "maximum": 14}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["zone"],
    "properties": {"zone": {"enum": ["UTC", "CET"]}, "precise": {"type": "boolean"}}}}}
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
CALLS = [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"zone": "CET", "precise": True})]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    from families import write_tokenizer
    out = {}
    for fam in FAMILIES:
        d = str(tmp_path_factory.mktemp(fam))
        write_tokenizer(d, fam)
        out[fam] = d
    return out


def _rendered_calls(d: str, calls) -> str:
    """An assistant turn with ``calls`` as the family's chat template writes it."""
    from runtime.serve.chat import ChatFormatter
    fmt = ChatFormatter(d)
    msgs = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": a}}
                for i, (n, a) in enumerate(calls)]}]
    return fmt.render(msgs, [WEATHER, TIME])


def _calls_part(text: str, opener: str, closer: str) -> str:
    """The assistant turn's calls, from its opening marker to its closing one (the system prompt before it may
    name the markers and the tools too)."""
    start = text.rfind(opener, 0, text.rindex("get_weather"))
    return text[start:text.rindex(closer) + len(closer)]


@pytest.mark.parametrize("fam", list(FORMAT))
def test_template_parser_and_grammar_agree(fam, tokenizers):
    """The calls the family's template writes are what its parser reads back, and what its grammar accepts after
    the opening token; the grammar refuses an unknown function and arguments its parameters do not allow."""
    from runtime.engine.grammar import GrammarTokenizer
    from runtime.serve.chat import ChatFormatter
    from runtime.serve.tool_parsers import Tools, parse_auto, tool_format, trigger
    from runtime.tokenizer import Tokenizer
    d = tokenizers[fam]
    name, opener, closer = FORMAT[fam]
    fmt = tool_format(ChatFormatter(d).template_text)
    assert fmt.name == name
    tok = Tokenizer(d)
    functions = [{**t["function"], "description": t["function"].get("description", "")} for t in (WEATHER, TIME)]
    gt = GrammarTokenizer(d + "/tokenizer.json", tok.tok.get_vocab_size(), [tok.token_id(FAMILIES[fam][2])])

    def accepts(calls_text: str, parallel=True) -> bool:
        tid, kind, grammar = trigger(fmt, Tools(functions, "auto", parallel=parallel), tok)
        assert tid == tok.token_id(opener)
        m = gt.matcher(kind, grammar)
        ids = tok.encode(calls_text)
        assert ids[0] == tid
        for i in ids[1:]:
            if not m.m.consume_token(i):
                return False
        return m.m.is_accepting()

    for calls in (CALLS[:1], CALLS):
        text = _rendered_calls(d, calls)
        body = _calls_part(text, opener, closer)
        content, got = parse_auto(fmt, "Let me see." + body, functions)
        assert content == "Let me see."
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == calls
        assert accepts(body)
        assert accepts(body, parallel=False) == (len(calls) == 1)     # parallel_tool_calls: false - one call
    one = _calls_part(_rendered_calls(d, CALLS[:1]), opener, closer)
    assert not accepts(one.replace("get_weather", "get_water"))
    assert not accepts(one.replace("3", "15"))                 # days above its maximum
    assert not accepts(one.replace("Paris", "Parisparisparis"))   # city not of its pattern
    assert not accepts(one.replace("Paris", "paris"))


# what Pydantic writes for a tool's arguments: a nested model and an enum, by $defs / $ref
PLACE = {"type": "function", "function": {"name": "place_weather", "parameters": {
    "$defs": {"Unit": {"enum": ["C", "F"], "title": "Unit", "type": "string"},
              "Place": {"properties": {"city": {"title": "City", "type": "string"}, "unit": {"$ref": "#/$defs/Unit"}},
                        "required": ["city", "unit"], "title": "Place", "type": "object"}},
    "properties": {"place": {"$ref": "#/$defs/Place"}, "unit": {"$ref": "#/$defs/Unit"}},
    "required": ["place", "unit"], "title": "Args", "type": "object"}}}


@pytest.mark.parametrize("fam", list(FORMAT))
def test_grammars_take_parameters_with_defs_and_refs(fam, tokenizers):
    """Issue 32: parameters with $defs / $ref (they were refused): every family's call grammar - and the required
    one - compiles and takes the call its template writes; a value outside the referenced enum is refused."""
    from runtime.engine.grammar import GrammarTokenizer
    from runtime.serve.chat import ChatFormatter
    from runtime.serve.tool_parsers import parse_tools, tool_format, trigger
    from runtime.tokenizer import Tokenizer
    d = tokenizers[fam]
    name, opener, closer = FORMAT[fam]
    fmt = tool_format(ChatFormatter(d).template_text)
    tok = Tokenizer(d)
    gt = GrammarTokenizer(d + "/tokenizer.json", tok.tok.get_vocab_size(), [tok.token_id(FAMILIES[fam][2])])
    def written(unit: str) -> str:
        """The call with ``unit`` as the family's template writes it, from its opening marker to its closing one."""
        msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_0", "type": "function", "function": {
                "name": "place_weather", "arguments": {"place": {"city": "Paris", "unit": "C"}, "unit": unit}}}]}]
        text = ChatFormatter(d).render(msgs, [PLACE])
        return text[text.rfind(opener, 0, text.rindex("place_weather")):text.rindex(closer) + len(closer)]

    def accepts(kind, grammar, ids) -> bool:
        m = gt.matcher(kind, grammar)
        return all(m.m.consume_token(i) for i in ids) and m.m.is_accepting()
    tools = parse_tools({"tools": [PLACE], "tool_choice": "auto"})
    tid, kind, grammar = trigger(fmt, tools, tok)
    assert accepts(kind, grammar, tok.encode(written("F"))[1:]), written("F")
    assert not accepts(kind, grammar, tok.encode(written("K"))[1:])
    required = parse_tools({"tools": [PLACE], "tool_choice": "required"}).grammar()
    call = '[{"name": "place_weather", "arguments": {"place": {"city": "Paris", "unit": "C"}, "unit": "F"}}]'
    assert accepts(*required, tok.encode(call)) and not accepts(*required, tok.encode(call.replace('"F"', '"K"')))


# -- served: the official client against a server of each family -----------------------------------------------
@pytest.fixture(scope="module", params=["qwen3", "glm45", "kimi_k2", "qwen35"])
def served(request, tmp_path_factory):
    """A server of the family's checkpoint (converted from its Hugging Face folder, as `serve --model` does)."""
    from runtime.model.convert import convert
    from runtime.serve.api import Server
    from runtime.serve.engine_proc import EngineConfig
    fam = request.param
    d = tmp_path_factory.mktemp(fam)
    build_family(str(d / "hf"), fam)
    convert(str(d / "hf"), str(d / "store"))
    srv = Server(EngineConfig(model=str(d / "store"), max_batch=4), port=0, api_key=KEY).start()
    srv.family = fam
    yield srv
    srv.close()


def _calls(msg):
    return [(c.function.name, c.function.arguments) for c in msg.tool_calls or []]


def _streamed(chunks):
    """(content, [(name, arguments)], finish_reason, logprobs entries, tool-call deltas seen) of a streamed choice,
    accumulated as a client does: tool calls by their index, argument pieces appended."""
    content, calls, finish, lps, pieces = "", {}, None, [], 0
    for x in chunks:
        if not x.choices:
            continue
        c = x.choices[0]
        content += c.delta.content or ""
        for tc in c.delta.tool_calls or []:
            pieces += 1
            if tc.index not in calls:
                assert tc.id and tc.id.startswith("call_") and tc.type == "function" and tc.function.name
            cur = calls.setdefault(tc.index, ["", ""])
            cur[0] += tc.function.name or ""
            cur[1] += tc.function.arguments or ""
        if c.logprobs is not None and c.logprobs.content:
            lps += c.logprobs.content
        finish = c.finish_reason or finish
    return content, [tuple(calls[i]) for i in sorted(calls)], finish, lps, pieces


FORMAT_OF = {"qwen3": FORMAT["qwen3"], "glm45": FORMAT["glm45"], "qwen35": FORMAT["qwen35"],
             "kimi_k2": ("kimi_k2", "<|tool_call_begin|>")}


def test_auto_tool_calls_open_by_the_model_and_finish_by_the_grammar(served):
    """tool_choice auto: the model opens a call with its family's marker (pushed here by logit_bias on that token,
    as a trained model does by itself); from there the grammar holds the call to an offered tool with valid
    arguments, closed by the family's marker; the server parses it into tool_calls - streamed and not. With
    parallel_tool_calls false the grammar ends after one call; with it, the model may open more (or end: EOS is
    pushed as hard as the marker, so which comes is the model's choice)."""
    from runtime.serve.tool_parsers import tool_format
    c = client(served)
    opener = served.tok.token_id(tool_format(FAMILIES[served.family][4]).trigger)
    eos = served.tok.token_id(FAMILIES[served.family][2])
    msgs = [{"role": "user", "content": "weather in Paris for 3 days, and the time?"}]
    seen = {False: 0, True: 0}
    for seed, parallel in [(s, False) for s in range(4)] + [(s, True) for s in range(8)]:
        kw = dict(model=served.model_name, messages=msgs, tools=[WEATHER, TIME], seed=seed, max_tokens=200,
                  temperature=1.0, parallel_tool_calls=parallel,
                  logit_bias={str(opener): 100, **({str(eos): 100} if parallel else {})})
        r = c.chat.completions.create(**kw)
        ch = r.choices[0]
        streamed = _streamed(c.chat.completions.create(**kw, stream=True))
        assert streamed[2] == ch.finish_reason
        # cut or not, the same calls streamed and not (a cut keeps its complete ones), each sent whole once complete
        assert streamed[1] == _calls(ch.message) and streamed[4] == len(streamed[1])
        if parallel and ch.finish_reason == "stop":      # the model ended at once: nothing, no call
            assert not ch.message.content and not ch.message.tool_calls
            continue
        if parallel and ch.finish_reason == "length":    # call after call, until max_tokens: the complete ones kept
            assert ch.message.tool_calls or FORMAT_OF[served.family][1] in ch.message.content
            for call in ch.message.tool_calls or []:
                assert _valid(json.loads(call.function.arguments), PARAMS[call.function.name]), call
            seen[True] += 1
            continue
        assert ch.finish_reason == "tool_calls", ch.message.content
        seen[parallel] += 1
        assert ch.message.content is None and (len(ch.message.tool_calls) == 1 or parallel)
        for call in ch.message.tool_calls:
            assert call.type == "function" and call.id.startswith("call_")
            assert _valid(json.loads(call.function.arguments), PARAMS[call.function.name]), call
    assert seen[False] == 4 and seen[True] >= 1


def test_auto_without_a_call_streams_its_content(served):
    """No call opened (the marker pushed down): plain content, the same streamed as not."""
    c = client(served)
    from runtime.serve.tool_parsers import tool_format
    opener = served.tok.token_id(tool_format(FAMILIES[served.family][4]).trigger)
    kw = dict(model=served.model_name, messages=[{"role": "user", "content": "hello"}], tools=[WEATHER], seed=3,
              max_tokens=12, temperature=1.0, logit_bias={str(opener): -100})
    r = c.chat.completions.create(**kw)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")
    content, calls, finish, _, _ = _streamed(c.chat.completions.create(**kw, stream=True))
    assert (content, calls, finish) == (r.choices[0].message.content, [], r.choices[0].finish_reason)


def test_required_named_and_a_conversation_with_results(served):
    c = client(served)
    msgs = [{"role": "user", "content": "what time is it?"}]
    for choice, parallel in (("required", True), ("required", False),
                             ({"type": "function", "function": {"name": "get_time"}}, True)):
        kw = dict(model=served.model_name, messages=msgs, tools=[WEATHER, TIME], seed=1, tool_choice=choice,
                  max_tokens=96, temperature=1.0, parallel_tool_calls=parallel)
        ch = c.chat.completions.create(**kw).choices[0]
        streamed = _streamed(c.chat.completions.create(**kw, stream=True))
        if ch.finish_reason != "length":
            assert ch.finish_reason == "tool_calls" and (parallel or len(ch.message.tool_calls) == 1)
            for name, args in _calls(ch.message):
                assert _valid(json.loads(args), PARAMS[name]) and (choice == "required" or name == "get_time")
            # streamed: the same calls, each whole once complete
            assert streamed[1] == _calls(ch.message) and streamed[2] == "tool_calls"
            assert streamed[4] == len(streamed[1])
    # the call and its result go back through the family's template
    r = c.chat.completions.create(model=served.model_name, max_tokens=4, tools=[WEATHER], messages=[
        *msgs, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}])
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_json_schema_output(served):
    c = client(served)
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    msgs = [{"role": "user", "content": "a person, as JSON"}]
    ended = 0
    for seed in range(3):
        kw = dict(model=served.model_name, messages=msgs, max_tokens=96, temperature=1.0, seed=seed, response_format=rf)
        r = c.chat.completions.create(**kw)
        text = r.choices[0].message.content
        assert _streamed(c.chat.completions.create(**kw, stream=True))[0] == text
        if r.choices[0].finish_reason == "stop":
            ended += 1
            assert _valid(json.loads(text), SCHEMA), text
    assert ended >= 1


def test_chat_logprobs(served):
    """logprobs / top_logprobs of a chat reply: the tokens spell the content, each top list is sorted and holds the
    sampled token's logprob at greedy decoding, streamed the same as not; probabilities sum to at most 1."""
    import math
    c = client(served)
    kw = dict(model=served.model_name, messages=[{"role": "user", "content": "count"}], max_tokens=8, temperature=0,
              logprobs=True, top_logprobs=3)
    r = c.chat.completions.create(**kw)
    lp = r.choices[0].logprobs.content
    assert len(lp) == r.usage.completion_tokens
    # a token may be part of a character (byte-level): its bytes, joined, are the content's
    assert b"".join(bytes(t.bytes) for t in lp).decode("utf-8", "replace") == r.choices[0].message.content
    for t in lp:
        tops = [x.logprob for x in t.top_logprobs]
        assert tops == sorted(tops, reverse=True) and len(tops) == 3
        assert t.logprob == pytest.approx(tops[0], abs=1e-6)          # greedy: the most likely token
        assert sum(math.exp(v) for v in tops) <= 1 + 1e-5
    s = _streamed(c.chat.completions.create(**kw, stream=True))[3]
    assert [(t.token, round(t.logprob, 5)) for t in s] == [(t.token, round(t.logprob, 5)) for t in lp]


@pytest.mark.parametrize("fam", ["qwen3", "kimi_k2", "deepseek_v3"])
def test_streamed_arguments_are_prefixes_of_the_final_ones(fam, tokenizers):
    """The family's calls as its template writes them, revealed a character at a time: what may be streamed of each
    call's arguments only grows, is always a prefix of the final arguments, and ends equal to them (the final ones
    are the arguments as written)."""
    from runtime.serve.chat import ChatFormatter
    from runtime.serve.tool_parsers import Tools, parse_auto, stream_spans, streamable_arguments, tool_format
    d = tokenizers[fam]
    _, opener, closer = FORMAT[fam]
    fmt = tool_format(ChatFormatter(d).template_text)
    text = "Sure." + _calls_part(_rendered_calls(d, CALLS), opener, closer)
    _, final = parse_auto(fmt, text)
    final = [(c["function"]["name"], c["function"]["arguments"]) for c in final]
    assert [(n, json.loads(a)) for n, a in final] == CALLS
    tools = Tools([], "auto")
    sent: list = []
    for k in range(len(text) + 1):
        for i, (name, a, b) in enumerate(stream_spans(tools, fmt, text[:k]) or []):
            args = streamable_arguments(text[:k], a, b, fmt.close)
            if i == len(sent):
                sent.append([name, ""])
            assert sent[i][0] == name == final[i][0]
            assert args.startswith(sent[i][1]) and final[i][1].startswith(args)
            sent[i][1] = args
    assert [tuple(x) for x in sent] == final


def test_tool_schemas_the_grammar_cannot_use_are_400s(served):
    """Parameters that are not JSON schemas of an object's properties fail their request alone, naming the tool."""
    import openai
    c = client(served)
    bad = [{"type": "object", "properties": {"a": "text"}}, {"type": "object", "properties": ["a"]},
           {"type": "object", "properties": {"a": {"type": "string"}}, "required": "a"},
           {"type": "object", "properties": {"a": {"type": "string", "maxLength": "ten"}}}]
    for params in bad:
        tool = {"type": "function", "function": {"name": "f", "parameters": params}}
        with pytest.raises(openai.BadRequestError, match="tools"):
            c.chat.completions.create(model=served.model_name, messages=[{"role": "user", "content": "x"}],
                                      tools=[tool], max_tokens=4)
    r = c.chat.completions.create(model=served.model_name, messages=[{"role": "user", "content": "x"}],
                                  tools=[WEATHER], max_tokens=4)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


# -- gpt-oss: harmony channels -----------------------------------------------------------------------------------
HARMONY = ('<|channel|>analysis<|message|>The user wants weather.<|end|><|start|>assistant<|channel|>commentary '
           'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", "days": 3}<|call|>')


def test_harmony_channels_split():
    """The harmony format as its definition writes it: analysis -> reasoning, final -> content, a commentary
    message to a function -> a call (its recipient after the channel or in the role's header), a preamble ->
    content; text without channels is content; a partial text splits into prefixes of the whole one."""
    from runtime.serve.harmony import split
    h = split(HARMONY)
    assert (h.reasoning, h.content, h.calls) == ("The user wants weather.", "",
                                                   [("get_weather", '{"city": "Paris", "days": 3}')])
    reply = ("<|channel|>analysis<|message|>Think <b>.<|end|><|start|>assistant<|channel|>commentary<|message|>"
             "Checking.<|end|><|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>"
             '{"zone": "UTC"}<|call|>')
    h = split(reply)
    assert (h.reasoning, h.content, h.calls) == ("Think <b>.", "Checking.", [("get_time", '{"zone": "UTC"}')])
    final = "<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>final<|message|>It is 3 < 4.<|return|>"
    assert (split(final).reasoning, split(final).content) == ("a", "It is 3 < 4.")
    assert split("plain words").content == "plain words"
    r = c = ""
    for k in range(len(final) + 1):
        p = split(final[:k])
        if "<|channel|>" in final[:k]:
            assert p.reasoning.startswith(r) and p.content.startswith(c), final[:k]
            r, c = p.reasoning, p.content
    assert (r, c) == ("a", "It is 3 < 4.")


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    from runtime.model.convert import convert
    from runtime.serve.api import Server
    from runtime.serve.engine_proc import EngineConfig
    d = tmp_path_factory.mktemp("gpt_oss")
    build_family(str(d / "hf"), "gpt_oss")
    convert(str(d / "hf"), str(d / "store"))
    srv = Server(EngineConfig(model=str(d / "store"), max_batch=4), port=0, api_key=KEY).start()
    yield srv
    srv.close()


def test_harmony_replies_streamed_and_not(gpt_oss):
    """A gpt-oss server splits every chat reply by its channels: no marker reaches the client, the reasoning comes
    as reasoning_content, and streaming gives the same reasoning and content (the markers pushed up by logit_bias,
    so the random model writes some)."""
    c = client(gpt_oss)
    tok = gpt_oss.tok
    bias = {str(tok.token_id(m)): 4 for m in ("<|channel|>", "<|message|>", "<|end|>", "<|start|>")}
    for seed in range(6):
        kw = dict(model=gpt_oss.model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=48,
                  temperature=1.0, seed=seed, logit_bias=bias)
        m = c.chat.completions.create(**kw).choices[0].message
        reasoning = (m.model_extra or {}).get("reasoning_content") or ""
        assert "<|" not in (m.content or "") and "<|" not in reasoning
        content, r = "", ""
        for x in c.chat.completions.create(**kw, stream=True):
            if x.choices:
                content += x.choices[0].delta.content or ""
                r += (x.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
        assert (content, r) == (m.content or "", reasoning)
    # a conversation with a call and its result renders through the harmony template
    r = c.chat.completions.create(model=gpt_oss.model_name, max_tokens=4, tools=[WEATHER], messages=[
        {"role": "user", "content": "weather?"}, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris", "days": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "sunny"}])
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
