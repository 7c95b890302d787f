"""Reasoning parsers (runtime/serve/reasoning.py) and the chat template's fields: a <think> family's thinking split
into reasoning_content (streamed and not, against the raw reply the completions API gives for the same prompt and
seed), structured output holding the reply after the thinking, enable_thinking through chat_template_kwargs and
continue_final_message as transformers renders them; gpt-oss's analysis channel is tested in test_tool_families.py
and through the Responses API in test_responses_api.py."""
import json
import re

import pytest

from families import serve_family, write_tokenizer
from helpers import require
from test_sampling_api import SCHEMA, _valid
from test_server import client, raw

require("transformers", "the families' config classes and the reference chat-template renderer")


def spec_split(reply: str, opened: bool) -> "tuple[str, str]":
    """What a <think> reply's reasoning and content are, written out: the block from the start of the reply (or of
    the prompt, ``opened``) to </think> is the reasoning, the rest the content; newlines around both dropped; a block
    never closed is all reasoning; a reply that opens none is all content."""
    if not opened:
        m = re.match(r"\s*<think>", reply)
        if m is None:
            return "", reply
        reply = reply[m.end():]
    m = re.fullmatch(r"(.*?)</think>(.*)", reply, re.S)
    if m is None:
        return reply.strip("\n"), ""
    return m.group(1).strip("\n"), m.group(2).lstrip("\n")


REPLIES = ["<think>\nThe user greets.\n</think>\n\nHello!", "<think>a</think>b</think>c", "  <think>\n\n</think>x",
           "<think>cut short", "plain reply", "\n\nplain after newlines", "<thi", "", "x <think>y</think>",
           "<think>\n\n</think>\n\n<tool_call>\n{}\n</tool_call>", "<think>ends in <\n", "<think>a</thi"]


@pytest.mark.parametrize("reply", REPLIES)
@pytest.mark.parametrize("state", [None, True, False])
def test_split_is_the_spec_and_grows_with_the_text(reply, state):
    """The whole reply splits as the spec says; each prefix splits into prefixes of that (what a stream sends only
    grows, and its deltas add up to the whole)."""
    from runtime.serve.reasoning import FORMATS, Reasoner
    r = Reasoner(next(f for f in FORMATS if f.name == "qwen3"), state)
    whole = r.split(reply, final=True)
    if state is False:
        assert whole == ("", reply)
    else:
        assert whole == spec_split(reply, opened=state is True)
    sent = ("", "")
    for k in range(len(reply) + 1):
        part = r.split(reply[:k])
        assert part[0].startswith(sent[0]) and part[1].startswith(sent[1]), (reply[:k], part, sent)
        assert whole[0].startswith(part[0]) and whole[1].startswith(part[1]), (reply[:k], part, whole)
        sent = part


def test_formats_are_picked_by_the_template_or_named():
    from runtime.serve.reasoning import reasoning_format, think_state
    from families import DEEPSEEK_V3_TEMPLATE, HARMONY_TEMPLATE, QWEN3_TEMPLATE, QWEN3_THINK_TEMPLATE
    assert reasoning_format(QWEN3_THINK_TEMPLATE).name == "qwen3"
    assert reasoning_format(HARMONY_TEMPLATE.replace("final", "analysis")).name == "gpt_oss"
    r1 = DEEPSEEK_V3_TEMPLATE.replace("{%- if add_generation_prompt -%}<｜Assistant｜>",
                                      "{%- if add_generation_prompt -%}<｜Assistant｜><think>\n") + "{# </think> #}"
    assert reasoning_format(r1).name == "deepseek_r1"
    assert reasoning_format(QWEN3_TEMPLATE) is None and reasoning_format(None) is None
    assert reasoning_format(QWEN3_TEMPLATE, "deepseek_r1").name == "deepseek_r1"
    assert reasoning_format(QWEN3_THINK_TEMPLATE, "none") is None
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        reasoning_format(QWEN3_TEMPLATE, "qwen4")
    fmt = reasoning_format(QWEN3_THINK_TEMPLATE)
    assert think_state(fmt, "<|im_start|>assistant\n<think>\n") is True           # DeepSeek-R1-0528's prompt
    assert think_state(fmt, "<|im_start|>assistant\n<think>\n\n</think>\n\n") is False   # enable_thinking false
    assert think_state(fmt, "<think>old</think>\n<|im_start|>user\nhi<|im_start|>assistant\n") is None
    assert think_state(fmt, "<|im_start|>assistant\n") is None


def test_reasoning_tokens_count_the_prefix_that_wrote_the_thinking():
    from runtime.serve.reasoning import FORMATS, Reasoner, reasoning_tokens
    r = Reasoner(next(f for f in FORMATS if f.name == "qwen3"), None)
    pieces = ["<think>", "\n", "ab", "c", "\n", "</think>", "\n\n", "Hi"]

    def decode(ids):
        return "".join(pieces[i] for i in ids)
    assert reasoning_tokens(list(range(len(pieces))), decode, lambda t: r.split(t)[0]) == 4    # through "c"
    assert reasoning_tokens([7], decode, lambda t: r.split(t)[0]) == 0


# -- the chat template's fields, against transformers' renderer ------------------------------------------------
@pytest.fixture(scope="module")
def think_tokenizer(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("qwen3_think_tok"))
    write_tokenizer(d, "qwen3_think")
    return d


MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
PREFILLED = MSGS + [{"role": "assistant", "content": "<think>\nThe user says hi"}]


def test_template_kwargs_and_continue_final_message_render_as_transformers(think_tokenizer):
    from transformers import AutoTokenizer

    from runtime.serve.chat import ChatFormatter, template_options
    hf = AutoTokenizer.from_pretrained(think_tokenizer)
    fmt = ChatFormatter(think_tokenizer)
    for body, kw in (({}, {"add_generation_prompt": True}),
                     ({"chat_template_kwargs": {"enable_thinking": False}},
                      {"add_generation_prompt": True, "enable_thinking": False}),
                     ({"add_generation_prompt": False}, {"add_generation_prompt": False})):
        assert fmt.render(MSGS, **template_options(body)) == hf.apply_chat_template(MSGS, tokenize=False, **kw)
    off = fmt.render(MSGS, **template_options({"chat_template_kwargs": {"enable_thinking": False}}))
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    cont = fmt.render(PREFILLED, **template_options({"continue_final_message": True}))
    assert cont == hf.apply_chat_template(PREFILLED, tokenize=False, continue_final_message=True)
    assert cont.endswith("<|im_start|>assistant\n<think>\nThe user says hi")
    # where the thinking stands is read from the prompt's end the reply follows on from, not from a message's text
    from runtime.serve.chat import reply_tail
    from runtime.serve.reasoning import reasoning_format, think_state
    think = reasoning_format(fmt.template_text)
    quoting = [{"role": "user", "content": "what does <think> mean?"}]
    for msgs, body, state in ((quoting, {}, None), (MSGS, {}, None),
                              (PREFILLED, {"continue_final_message": True}, True),
                              (MSGS, {"chat_template_kwargs": {"enable_thinking": False}}, False)):
        opts = template_options(body)
        tail = reply_tail(fmt.render(msgs, **opts), msgs, opts["continue_final_message"])
        assert think_state(think, tail) is state, (msgs, body, tail)
    # the fields checked as vLLM checks them: 400s naming the field
    from runtime.serve.params import ApiError
    for body, param in (({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message"),
                        ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
                        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
                        ({"continue_final_message": "yes"}, "continue_final_message"),
                        ({"add_generation_prompt": 1}, "add_generation_prompt")):
        with pytest.raises(ApiError) as e:
            template_options(body)
        assert e.value.status == 400 and e.value.param == param


# -- served: a Qwen3 family with thinking --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    srv = serve_family(tmp_path_factory, "qwen3_think")
    yield srv
    srv.close()


def _post(srv, path, body):
    status, data = raw(srv, "POST", path, body)
    return status, json.loads(data)


def _streamed(chunks) -> "tuple[str, str, str]":
    """(reasoning, content, finish_reason) of a streamed chat reply, as a client accumulates them."""
    r = c = ""
    finish = None
    for x in chunks:
        if x.choices:
            d = x.choices[0].delta
            r += (d.model_extra or {}).get("reasoning_content") or ""
            c += d.content or ""
            finish = x.choices[0].finish_reason or finish
    return r, c, finish


def _reasoning(msg) -> str:
    return (msg.model_extra or {}).get("reasoning_content") or ""


def test_thinking_is_reasoning_content_streamed_and_not(thinker):
    """The reply continues a prefilled <think> (continue_final_message): what the model writes up to </think> is
    reasoning_content, the rest content - as the spec splits the raw reply, which the completions API returns for
    the same prompt ids, seed and logit_bias (</think> pushed up so the random model closes the block sometimes)."""
    c = client(thinker)
    end = thinker.tok.token_id("</think>")
    status, tk = _post(thinker, "/tokenize", {"model": thinker.model_name, "messages": PREFILLED,
                                              "continue_final_message": True})
    assert status == 200
    closed = 0
    for seed in range(6):
        common = dict(model=thinker.model_name, max_tokens=32, temperature=1.0, seed=seed, logit_bias={str(end): 6})
        reply = c.completions.create(prompt=tk["tokens"], **common).choices[0].text
        want = spec_split(reply, opened=True)
        kw = dict(messages=PREFILLED, extra_body={"continue_final_message": True}, **common)
        r = c.chat.completions.create(**kw)
        m = r.choices[0].message
        assert (_reasoning(m), m.content or "") == want, reply
        assert r.usage.prompt_tokens == tk["count"]
        assert _streamed(c.chat.completions.create(stream=True, **kw))[:2] == want
        closed += "</think>" in reply
    assert closed >= 1


def test_structured_output_holds_the_reply_after_the_thinking(thinker):
    """A json_schema with thinking: the thinking is free (not JSON) and the reply after </think> is held to the
    schema (the grammar arms on </think>)."""
    c = client(thinker)
    end = thinker.tok.token_id("</think>")
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    done = 0
    for seed in range(6):
        kw = dict(model=thinker.model_name, messages=PREFILLED, max_tokens=96, temperature=1.0, seed=seed,
                  response_format=rf, logit_bias={str(end): 4}, extra_body={"continue_final_message": True})
        ch = c.chat.completions.create(**kw).choices[0]
        if ch.finish_reason == "stop":
            done += 1
            assert _valid(json.loads(ch.message.content), SCHEMA), ch.message.content
            assert _streamed(c.chat.completions.create(stream=True, **kw)) == (_reasoning(ch.message),
                                                                               ch.message.content, "stop")
    assert done >= 1


def test_enable_thinking_goes_through_the_template(thinker):
    """chat_template_kwargs {"enable_thinking": false}: the template closes an empty block in the prompt (as
    transformers renders it) and the reply is all content, even one that writes <think>; without it, a reply that
    opens <think> is reasoning."""
    from transformers import AutoTokenizer
    c = client(thinker)
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    status, tk = _post(thinker, "/tokenize", {"messages": MSGS, **off})
    status, text = _post(thinker, "/detokenize", {"tokens": tk["tokens"]})
    want = AutoTokenizer.from_pretrained(thinker.hf).apply_chat_template(MSGS, tokenize=False,
                                                                           add_generation_prompt=True,
                                                                           enable_thinking=False)
    assert text["prompt"] == want and want.endswith("<think>\n\n</think>\n\n")
    start = thinker.tok.token_id("<think>")
    kw = dict(model=thinker.model_name, messages=MSGS, max_tokens=6, temperature=0, logit_bias={str(start): 100})
    m = c.chat.completions.create(**kw, extra_body=off).choices[0].message
    assert m.content.startswith("<think>") and not _reasoning(m)
    m = c.chat.completions.create(**kw).choices[0].message
    assert _reasoning(m).startswith("<think>") and m.content is None        # <think><think>...: never closed
    # the Responses API: the thinking as a reasoning item, all 6 tokens of it; off, a message
    r = c.responses.create(model=thinker.model_name, input=MSGS, max_output_tokens=6, temperature=0,
                           extra_body={"logit_bias": {str(start): 100}})
    assert [it.type for it in r.output] == ["reasoning"] and r.output[0].content[0].text == _reasoning(m)
    assert r.usage.output_tokens_details.reasoning_tokens == 6 and r.status == "incomplete"
    r = c.responses.create(model=thinker.model_name, input=MSGS, max_output_tokens=6, temperature=0,
                           extra_body={"logit_bias": {str(start): 100}, **off})
    assert [it.type for it in r.output] == ["message"] and r.output_text == "<think>" * 6
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    for bad in ({"chat_template_kwargs": "enable_thinking=false"}, {"continue_final_message": True,
                                                                   "add_generation_prompt": True}):
        status, err = _post(thinker, "/v1/chat/completions", {"model": thinker.model_name, "messages": MSGS, **bad})
        assert status == 400 and err["error"]["param"] in bad, err


def test_serve_option_names_every_parser():
    """`serve --reasoning-parser` takes each of the registry's names (auto by default) and no other."""
    from runtime.cli import build_parser
    from runtime.serve.reasoning import NAMES
    p = build_parser()
    assert p.parse_args(["serve", "--model", "x"]).reasoning_parser == "auto"
    for name in NAMES:
        assert p.parse_args(["serve", "--model", "x", "--reasoning-parser", name]).reasoning_parser == name
    with pytest.raises(SystemExit):
        p.parse_args(["serve", "--model", "x", "--reasoning-parser", "qwen4"])
