"""GLM-4.5: ``<tool_call>name\\n<arg_key>k</arg_key>\\n<arg_value>v</arg_value>\\n...</tool_call>``; string
arguments raw, the rest JSON. Its calls are sent whole when the output ends (no spans)."""
from __future__ import annotations

import json

from .base import ToolFormat, alts, args_rule, start_rule
from .named_args import enum, named_arguments, named_calls, raw_regex, raw_string


def parse(text: str, functions: list):
    return named_calls(text, functions, r"<tool_call>\s*([^<\n]+)(.*?)</tool_call>",
                       r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>")


def grammar(functions: list, t, parallel: bool) -> str:
    # GLM-4.5's template: <tool_call>name\n<arg_key>k</arg_key>\n<arg_value>v</arg_value>\n...</tool_call>; strings
    # raw and the rest JSON
    def value(i, j, sch):
        if not raw_string(sch):
            return [args_rule(f"v{i}_{j}", sch)]
        return [f"v{i}_{j}: {enum(sch) if sch.get('enum') else raw_regex(sch)}\n"]

    def arg(i, j, k):
        return (f'{t("<arg_key>")} {json.dumps(k)} {t("</arg_key>")} "\\n" {t("<arg_value>")} v{i}_{j} '
                f'{t("</arg_value>")} "\\n"')
    out, seqs = named_arguments(functions, value, arg)
    fns = [f'{json.dumps(f["name"] + chr(10))} {seq} {t("</tool_call>")}' for f, seq in zip(functions, seqs)]
    return start_rule(t, "<tool_call>", parallel) + f"body: {alts(fns)}\n" + "".join(out)


FORMAT = ToolFormat("glm45", "<arg_key>", parse,
                    ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"),
                    "<tool_call>", grammar)
