"""DeepSeek-V3: ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>name\\n```json\\n{json}\\n```
<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>``; each call streams whole once complete."""
from __future__ import annotations

import json
import re

from .base import ToolFormat, alts, args_rule, call, json_obj, marker_spans

HEAD = re.compile(r"<｜tool▁call▁begin｜>\s*function\s*<｜tool▁sep｜>\s*([\w.-]+)\s*```(?:json)?\s*(?=[^\sj])")


def parse(text: str, functions: list):
    calls = []
    for m in re.finditer(r"<｜tool▁call▁begin｜>\s*function\s*<｜tool▁sep｜>\s*([\w.-]+)\s*```(?:json)?\s*(.*?)\s*```"
                         r"\s*<｜tool▁call▁end｜>", text, re.S):
        v = json_obj(m.group(2))
        if v is not None:
            calls.append(call(m.group(1), v))
    return text.split("<｜tool▁calls▁begin｜>")[0], calls


def grammar(functions: list, t, parallel: bool) -> str:
    # DeepSeek-V3's template: <｜tool▁call▁begin｜>function<｜tool▁sep｜>name\n```json\n{json}\n```<｜tool▁call▁end｜>,
    # calls one per line inside <｜tool▁calls▁begin｜> ... <｜tool▁calls▁end｜>
    fns = [f'{json.dumps(f["name"] + chr(10) + "```json" + chr(10))} args{i} "\\n```"' for i, f in enumerate(functions)]
    more = ' ("\\n"? call)*' if parallel else ""
    return (f'start: call{more} {t("<｜tool▁calls▁end｜>")}\n'
            f'call: {t("<｜tool▁call▁begin｜>")} "function" {t("<｜tool▁sep｜>")} ({alts(fns)}) '
            f'{t("<｜tool▁call▁end｜>")}\n'
            + "".join(args_rule(f"args{i}", f["parameters"]) for i, f in enumerate(functions)))


FORMAT = ToolFormat("deepseek_v3", "<｜tool▁call▁begin｜>", parse,
                    ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>",
                     "<｜tool▁call▁end｜>"),
                    "<｜tool▁calls▁begin｜>", grammar,
                    lambda text: marker_spans(text, HEAD, "```"), "```")
