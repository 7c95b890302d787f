"""``tool_choice`` "required" / a named function: the output is constrained (runtime/engine/grammar.py) to JSON
naming the call(s) - required: ``[{"name", "arguments"}, ...]`` (at least one), named: ``{"name", "arguments"}``
of that function - so the calls always parse and their arguments validate against the function's parameters.
The same in every family: no marker, no trigger."""
from __future__ import annotations

import json
import re

from .base import CALL_HEAD, call, json_call_rules, json_spans, span_calls

HEAD = re.compile(CALL_HEAD)


def grammar(functions: list, choice: str, named: "str | None", parallel: bool) -> "list | None":
    """The engine's grammar [format, text] for required / named calls; None for auto. One Lark grammar, the call's
    name an alternative of the functions' and each function's arguments its own JSON schema (``json_call_rules``)."""
    if choice == "named":
        return ["lark", "start: call\n" + json_call_rules([f for f in functions if f["name"] == named])]
    if choice == "required":
        more = ' (", " call)*' if parallel else ""
        return ["lark", f'start: "[" call{more} "]"\n' + json_call_rules(functions)]
    return None


def constrained_calls(tools, text: str) -> list:
    """The tool_calls of a required / named output (JSON by construction), arguments as written."""
    v = json.loads(text)
    calls = [call(c["name"], c["arguments"]) for c in (v if isinstance(v, list) else [v])]
    written = span_calls(json_spans(text, HEAD), text)
    return written if len(written) == len(calls) else calls


def spans(text: str) -> list:
    """(name, start, end or None) of each call in a partial required / named output."""
    return json_spans(text, HEAD)
