"""Qwen3.5 / Qwen3-Coder XML: ``<tool_call>\\n<function=name>\\n<parameter=k>\\nv\\n</parameter>\\n...</function>
\\n</tool_call>``; string arguments raw, the rest JSON. Its calls are sent whole when the output ends (no spans)."""
from __future__ import annotations

import json

from .base import ToolFormat, alts, args_rule, start_rule
from .named_args import enum, named_arguments, named_calls, raw_regex, raw_string


def parse(text: str, functions: list):
    return named_calls(text, functions, r"<tool_call>\s*<function=([^>\n]+)>(.*?)</function>\s*</tool_call>",
                       r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>")


def grammar(functions: list, t, parallel: bool) -> str:
    # Qwen3.5's / Qwen3-Coder's template: <tool_call>\n<function=name>\n<parameter=k>\nv\n</parameter>\n...
    # </function>\n</tool_call>; strings raw (a raw value's lexeme takes its closing "\n</parameter>" with it: the
    # text may hold newlines), booleans in either case (the template writes Python's True), the rest JSON
    close = '"\\n</parameter>\\n"'

    def value(i, j, sch):
        if raw_string(sch) and not sch.get("enum"):
            return [f"v{i}_{j}: /{raw_regex(sch)[1:-1]}\\n<\\/parameter>/ \"\\n\"\n"]
        if raw_string(sch):
            return [f"v{i}_{j}: {enum(sch)} {close}\n"]
        if sch.get("type") == "boolean":
            return [f'v{i}_{j}: ("true" | "false" | "True" | "False") {close}\n']
        return [args_rule(f"j{i}_{j}", sch), f"v{i}_{j}: j{i}_{j} {close}\n"]
    out, seqs = named_arguments(functions, value, lambda i, j, k: f'{json.dumps("<parameter=" + k + ">" + chr(10))} '
                                                                  f"v{i}_{j}")
    fns = [f'{json.dumps(f["name"] + ">" + chr(10))} {seq}' for f, seq in zip(functions, seqs)]
    return (start_rule(t, "<tool_call>", parallel) +
            f'body: "\\n<function=" ({alts(fns)}) "</function>\\n" {t("</tool_call>")}\n' + "".join(out))


FORMAT = ToolFormat("qwen3_coder", "<function=", parse, ("<tool_call>", "</tool_call>"), "<tool_call>", grammar)
