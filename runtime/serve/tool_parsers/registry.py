"""One registry of the families' tool-call formats (``FORMATS``: adding a format is one module and one entry
here), and what the server does with the format a model's chat template picks: the marker tokens it keeps, the
engine's trigger for auto calls, parsing a whole output, and the calls of a partial one as far as they stream."""
from __future__ import annotations

import json

from . import deepseek_v3, glm45, harmony, hermes, kimi_k2, qwen3_coder, required
from .base import ToolFormat, call, complete_calls, held, json_obj, span_calls
from .request import Tools

# The first whose marker the template has is the family's (GLM-4.5's and Qwen3.5's before Hermes: all three write
# <tool_call>).
FORMATS = [glm45.FORMAT, qwen3_coder.FORMAT, hermes.FORMAT, kimi_k2.FORMAT, deepseek_v3.FORMAT, harmony.FORMAT]
_BY_NAME = {f.name: f for f in FORMATS}


def tool_format(template_text: "str | None") -> ToolFormat:
    """The family format whose marker the chat template writes; Hermes (the most common) when none does."""
    for f in FORMATS:
        if template_text and f.marker in template_text:
            return f
    return _BY_NAME["hermes"]


def keep_tokens(fmt: ToolFormat, tok) -> frozenset:
    """Ids of the format's marker tokens in this tokenizer (kept in the output text)."""
    return frozenset(i for i in (tok.token_id(m) for m in fmt.tokens) if i is not None)


def trigger(fmt: ToolFormat, tools: Tools, tok) -> "list | None":
    """The engine's trigger for auto calls, [token id, "lark", grammar]: None where the format has none or the
    tokenizer has no single token for its opening marker (then the output is only parsed)."""
    if tools.choice != "auto" or fmt.trigger is None:
        return None
    tid = tok.token_id(fmt.trigger)
    if tid is None:
        return None

    def t(marker: str) -> str:
        i = tok.token_id(marker)
        return f"<[{i}]>" if i is not None else json.dumps(marker)
    return [tid, "lark", fmt.grammar(tools.functions, t, tools.parallel)]


def parse_auto(fmt: ToolFormat, text: str, functions: "list | None" = None) -> "tuple[str | None, list]":
    """(content or None, tool_calls) of a free output. A format that streams its calls: the calls its spans find
    (arguments as written, so they equal what was streamed) when they are whole, else its parser's."""
    content, calls = fmt.parse(text, functions or [])
    if calls and fmt.spans is not None:
        calls = span_calls(fmt.spans(text), text) or calls
    return (content.strip() or None) if calls else text, calls


def cut_reply(tools: Tools, fmt: ToolFormat, text: str) -> "tuple[str | None, list]":
    """(content or None, tool_calls) of an output cut by max_tokens: the calls it completed (a call the cut left
    partial is dropped - what a stream sent, as ``new_calls`` sends only complete ones), the content before them;
    with none completed, required / named calls give no content (their text is the calls' JSON), auto calls the
    text as it is."""
    if tools.choice != "auto":
        return None, complete_calls(required.spans(text), text)
    content, calls = fmt.parse(text, tools.functions)
    if fmt.spans is not None:
        calls = complete_calls(fmt.spans(text), text)
    return ((content.strip() or None), calls) if calls else (text, [])


def new_calls(tools: Tools, fmt: ToolFormat, text: str, sent: list) -> "list | None":
    """OpenAI's tool_calls deltas of the calls a partial output completed since ``sent`` (per call sent: [id, name,
    arguments]; appended to). A call is sent whole (id, name, arguments) once its arguments are complete JSON, so a
    reply cut by max_tokens streams the calls it returns, never a partial one. None: the format's calls are sent
    when the output ends (a format without spans)."""
    spans = stream_spans(tools, fmt, text)
    if spans is None:
        return None
    out = []
    for i, (name, a, b) in enumerate(spans[len(sent):], start=len(sent)):
        if b is None or json_obj(text[a:b]) is None:
            break
        c = call(name, text[a:b])
        sent.append([c["id"], name, text[a:b]])
        out.append({"index": i, **c})
    return out


def stream_spans(tools: Tools, fmt: ToolFormat, text: str) -> "list | None":
    """(name, start, end or None) of the calls in a partial output as far as they can be streamed; None: the calls
    of this output are sent whole when it ends (a format without spans)."""
    if tools.choice != "auto":
        return required.spans(text)
    if fmt.spans is None:
        return None
    return fmt.spans(text)


def streamable_arguments(text: str, start: int, end: "int | None", close: str = "") -> str:
    """What of a call's arguments can be sent now: all of them once their end is known; before, up to the end of
    the text less trailing whitespace and a tail that may be the start of the closing marker."""
    if end is not None:
        return text[start:end]
    part = text[start:]
    part = part[:len(part) - held(part, close)] if close else part
    return part.rstrip()
