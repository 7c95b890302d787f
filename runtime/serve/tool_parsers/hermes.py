"""Hermes / Qwen3: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, calls one per line; each
call streams whole once its arguments are complete."""
from __future__ import annotations

import re

from .base import CALL_HEAD, ToolFormat, call, json_call_rules, json_obj, json_spans, start_rule

HEAD = re.compile(r"<tool_call>\s*" + CALL_HEAD)


def parse(text: str, functions: list):
    calls = []
    for m in re.finditer(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", text, re.S):
        v = json_obj(m.group(1))
        if isinstance(v, dict) and isinstance(v.get("name"), str):
            calls.append(call(v["name"], v.get("arguments", {})))
    return text.split("<tool_call>")[0], calls


def grammar(functions: list, t, parallel: bool) -> str:
    # Qwen3's template: <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>, calls one per line
    return (start_rule(t, "<tool_call>", parallel) +
            f'body: "\\n" call "\\n" {t("</tool_call>")}\n' + json_call_rules(functions))


FORMAT = ToolFormat("hermes", "<tool_call>", parse, ("<tool_call>", "</tool_call>"), "<tool_call>", grammar,
                    lambda text: json_spans(text, HEAD))
