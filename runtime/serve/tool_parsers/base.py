"""What every tool-call format shares: the ``ToolFormat`` record a format module fills in, the OpenAI call
object, the Lark helpers of the grammars, and the scanners that find each call's arguments in a partial text
(what streams them)."""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Callable

from ...engine.grammar import json_schema_text


@dataclass(frozen=True)
class ToolFormat:
    """A family's tool-call format."""
    name: str
    marker: str             # a text its chat template writes: how the family is recognised
    parse: Callable         # (text, functions) -> (content, calls)
    tokens: tuple           # its marker tokens (special tokens in its tokenizer): kept in the text when tools are offered
    trigger: "str | None" = None                # the token that opens its calls
    grammar: "Callable | None" = None           # (functions, t, parallel) -> Lark text for what follows the trigger
    spans: "Callable | None" = None             # text -> [(name, arguments' start, end or None)]: streamed calls
    close: str = ""                             # the marker that ends a call's arguments (spans by marker)


def call(name: str, arguments) -> dict:
    """An OpenAI tool call: a new id, the name, the arguments as JSON text."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function", "function": {"name": name, "arguments": args}}


def json_obj(s: str):
    """The JSON value of ``s``; None when it is not JSON."""
    try:
        return json.loads(s)
    except ValueError:
        return None


# -- what follows the trigger token: Lark grammars (llguidance's dialect) --------------------------------------
# ``t(marker)`` is a marker as the grammar names it: ``<[id]>``, its token, where the tokenizer has one for it (the
# model writes a marker as that token, and a special token's bytes are not text), else the quoted text.
# ``%json {schema}`` is a JSON value valid against the schema.
def args_rule(name: str, schema: dict) -> str:
    return f"{name}: %json {json_schema_text(schema or {'type': 'object'})}\n"


def json_call_rules(functions: list) -> str:
    """Lark rules of one call written as the JSON object {"name": ..., "arguments": ...} of an offered function (", "
    and ": " separating, as ``json_schema_text``): rule ``call``, the name one of the functions' and the arguments
    that function's own ``%json`` - its parameters a root schema, so their ``$defs`` / ``$ref`` (what Pydantic
    writes) resolve as in a response_format, and the lexer picks the function by its name once."""
    fns = [f'{json.dumps(json.dumps(f["name"]) + ", " + json.dumps("arguments") + ": ")} args{i}'
           for i, f in enumerate(functions)]
    return (f'call: {json.dumps("{" + json.dumps("name") + ": ")} ({alts(fns)}) "}}"\n'
            + "".join(args_rule(f"args{i}", f["parameters"]) for i, f in enumerate(functions)))


def alts(rules: list) -> str:
    return " | ".join(rules)


def start_rule(t, opener: str, parallel: bool) -> str:
    """The start rule of a format whose every call opens with ``opener`` (after the first: the trigger): one
    ``body``, or (parallel calls) more, each on its line."""
    return 'start: body' + (f' ("\\n"? {t(opener)} body)*\n' if parallel else "\n")


# -- streaming: where each call's arguments are in a partial text ----------------------------------------------
def json_end(text: str, i: int) -> "int | None":
    """Index just past the JSON value that starts at ``text[i]``; None while the text ends inside it."""
    n = len(text)
    if i >= n:
        return None
    if text[i] in "{[\"":
        depth, in_str, esc = 0, False, False
        for j in range(i, n):
            ch = text[j]
            if in_str:
                if esc:
                    esc = False
                elif ch == "\\":
                    esc = True
                elif ch == '"':
                    in_str = False
                    if depth == 0:
                        return j + 1               # a string value
            elif ch == '"':
                in_str = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
        return None
    m = re.compile(r"[^,}\]\s]*").match(text, i)        # a number, true, false, null
    return m.end() if m.end() < n else None


def held(text: str, marker: str) -> int:
    """How many trailing characters of ``text`` may be the start of ``marker`` (or whitespace before it)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def json_spans(text: str, head: re.Pattern) -> list:
    """(name, start, end or None) of each call whose head (``head``: the text up to its arguments, the name its
    group 1) is in the text, arguments a JSON value that starts at ``start``; the next is looked for after it."""
    out, pos = [], 0
    while True:
        m = head.search(text, pos)
        if m is None:
            return out
        end = json_end(text, m.end())
        out.append((m.group(1), m.end(), end))
        if end is None:
            return out
        pos = end


def marker_spans(text: str, head: re.Pattern, close: str) -> list:
    """(name, start, end or None) of each call whose arguments run from its head to the ``close`` marker."""
    out, pos = [], 0
    while True:
        m = head.search(text, pos)
        if m is None:
            return out
        e = text.find(close, m.end())
        out.append((m.group(1), m.end(), None if e < 0 else len(text[:e].rstrip())))
        if e < 0:
            return out
        pos = e + len(close)


def span_calls(spans: list, text: str) -> list:
    """The calls of complete spans whose arguments are JSON, their arguments as written (what was streamed)."""
    calls = complete_calls(spans, text)
    return calls if len(calls) == len(spans) else []


def complete_calls(spans: list, text: str) -> list:
    """The calls of the leading spans that are complete with JSON arguments (a reply cut by max_tokens: the calls
    it finished), their arguments as written."""
    calls = []
    for name, a, b in spans:
        if b is None or json_obj(text[a:b]) is None:
            break
        calls.append(call(name, text[a:b]))
    return calls


# a head ends where its arguments' first character is (so a partial text never moves where they start)
CALL_HEAD = r'\{\s*"name"\s*:\s*"([^"\\]+)"\s*,\s*"arguments"\s*:\s*(?=\S)'
