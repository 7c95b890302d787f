"""Kimi K2: ``<|tool_calls_section_begin|><|tool_call_begin|>functions.name:i<|tool_call_argument_begin|>{json}
<|tool_call_end|>...<|tool_calls_section_end|>``; each call streams whole once complete."""
from __future__ import annotations

import json
import re

from .base import ToolFormat, alts, args_rule, call, json_obj, marker_spans

HEAD = re.compile(r"<\|tool_call_begin\|>\s*(?:functions\.)?([\w.-]+?)(?::\d+)?\s*"
                  r"<\|tool_call_argument_begin\|>\s*(?=\S)")


def parse(text: str, functions: list):
    calls = []
    for m in re.finditer(r"<\|tool_call_begin\|>\s*(?:functions\.)?([\w.-]+?)(?::\d+)?\s*<\|tool_call_argument_begin\|>"
                         r"(.*?)<\|tool_call_end\|>", text, re.S):
        v = json_obj(m.group(2).strip())
        if v is not None:
            calls.append(call(m.group(1), v))
    return text.split("<|tool_calls_section_begin|>")[0], calls


def grammar(functions: list, t, parallel: bool) -> str:
    # Kimi K2's template: <|tool_call_begin|>functions.name:index<|tool_call_argument_begin|>{json}<|tool_call_end|>
    # per call inside <|tool_calls_section_begin|> ... <|tool_calls_section_end|>; the index (the call's number in the turn)
    # of at most two digits
    fns = [f'{json.dumps("functions." + f["name"] + ":")} /[0-9]{{1,2}}/ {t("<|tool_call_argument_begin|>")} args{i}'
           for i, f in enumerate(functions)]
    return (f'start: call{"+" if parallel else ""} {t("<|tool_calls_section_end|>")}\n'
            f'call: {t("<|tool_call_begin|>")} ({alts(fns)}) {t("<|tool_call_end|>")}\n'
            + "".join(args_rule(f"args{i}", f["parameters"]) for i, f in enumerate(functions)))


FORMAT = ToolFormat("kimi_k2", "<|tool_call_begin|>", parse,
                    ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                     "<|tool_call_argument_begin|>", "<|tool_call_end|>"),
                    "<|tool_calls_section_begin|>", grammar,
                    lambda text: marker_spans(text, HEAD, "<|tool_call_end|>"), "<|tool_call_end|>")
