"""Tool calls (OpenAI's ``tools`` / ``tool_choice``): what a request offers, how the output is constrained or
parsed into ``tool_calls``.

* ``tool_choice`` "required" / a named function: the output is constrained (runtime/engine/grammar.py) to JSON
  naming the call(s) - required: ``[{"name", "arguments"}, ...]`` (at least one), named: ``{"name", "arguments"}``
  of that function - so the calls always parse and their arguments validate against the function's parameters.
* "auto": the tools are rendered into the chat template (the ``tools`` variable Hugging Face templates read) and
  the model's text is parsed by its family's tool-call format (``PARSERS``, picked by the markers its chat template
  writes): Hermes / Qwen3 ``<tool_call>{json}</tool_call>``; GLM-4.5 ``<tool_call>name<arg_key>k</arg_key>
  <arg_value>v</arg_value></tool_call>``; Kimi K2 ``<|tool_call_begin|>functions.name:i<|tool_call_argument_begin|>
  {json}<|tool_call_end|>``; DeepSeek-V3 ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>name\\n```json\\n{json}\\n```
  <｜tool▁call▁end｜>``; gpt-oss harmony ``<|channel|>commentary to=functions.name ... <|message|>{json}<|call|>``.
* "none" (or no tools): plain text.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from .params import ApiError


@dataclass
class Tools:
    functions: list                 # [{"name", "description", "parameters"}]
    choice: str                     # auto | required | named
    named: "str | None" = None

    def grammar(self) -> "list | None":
        """The engine's grammar for required / named calls; None for auto."""
        def call(f):
            return {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                    "properties": {"name": {"const": f["name"]}, "arguments": f.get("parameters") or {"type": "object"}}}
        if self.choice == "named":
            return ["json_schema", json.dumps(call(next(f for f in self.functions if f["name"] == self.named)))]
        if self.choice == "required":
            return ["json_schema", json.dumps({"type": "array", "minItems": 1,
                                               "items": {"anyOf": [call(f) for f in self.functions]}})]
        return None

    def template_tools(self) -> list:
        return [{"type": "function", "function": f} for f in self.functions]


def parse_tools(body: dict) -> "Tools | None":
    """The request's tools and tool_choice, validated; None when it offers none or chose "none"."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise ApiError(400, "'tool_choice' needs 'tools'", param="tool_choice")
        return None
    if not isinstance(tools, list):
        raise ApiError(400, "'tools' must be a list", param="tools")
    fns = []
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}",
                                                                                                f["name"]):
            raise ApiError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": "
                                f"[A-Za-z0-9_.-]{{1,64}}, ...}}}}", param=f"tools[{i}]")
        p = f.get("parameters")
        if p is not None and not isinstance(p, dict):
            raise ApiError(400, f"tools[{i}].function.parameters must be a JSON schema object", param=f"tools[{i}]")
        fns.append({"name": f["name"], "description": f.get("description", ""), "parameters": p or {"type": "object"}})
    names = [f["name"] for f in fns]
    if len(set(names)) != len(names):
        raise ApiError(400, "tool names must be unique", param="tools")
    if choice in (None, "auto"):
        return Tools(fns, "auto")
    if choice == "none":
        return None
    if choice == "required":
        return Tools(fns, "required")
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in names:
            raise ApiError(400, f"'tool_choice' names {name!r}, which is not among the tools", param="tool_choice")
        return Tools(fns, "named", name)
    raise ApiError(400, "'tool_choice' must be none, auto, required or {\"type\": \"function\", \"function\": "
                        "{\"name\": ...}}", param="tool_choice")


def _call(name: str, arguments) -> dict:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function", "function": {"name": name, "arguments": args}}


def constrained_calls(tools: Tools, text: str) -> list:
    """The tool_calls of a required / named output (JSON by construction)."""
    v = json.loads(text)
    return [_call(c["name"], c["arguments"]) for c in (v if isinstance(v, list) else [v])]


# -- the families' formats (auto) ------------------------------------------------------------------------------
def _json_obj(s: str):
    try:
        return json.loads(s)
    except ValueError:
        return None


def _hermes(text: str):
    calls = []
    for m in re.finditer(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", text, re.S):
        v = _json_obj(m.group(1))
        if isinstance(v, dict) and isinstance(v.get("name"), str):
            calls.append(_call(v["name"], v.get("arguments", {})))
    return text.split("<tool_call>")[0], calls


def _glm45(text: str):
    calls = []
    for m in re.finditer(r"<tool_call>\s*([^<\n]+)(.*?)</tool_call>", text, re.S):
        args = {}
        for k, v in re.findall(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", m.group(2), re.S):
            parsed = _json_obj(v)
            args[k.strip()] = parsed if parsed is not None else v
        calls.append(_call(m.group(1).strip(), args))
    return text.split("<tool_call>")[0], calls


def _kimi_k2(text: str):
    calls = []
    for m in re.finditer(r"<\|tool_call_begin\|>\s*(?:functions\.)?([\w.-]+?)(?::\d+)?\s*<\|tool_call_argument_begin\|>"
                         r"(.*?)<\|tool_call_end\|>", text, re.S):
        v = _json_obj(m.group(2).strip())
        if v is not None:
            calls.append(_call(m.group(1), v))
    return text.split("<|tool_calls_section_begin|>")[0], calls


def _deepseek_v3(text: str):
    calls = []
    for m in re.finditer(r"<｜tool▁call▁begin｜>\s*function\s*<｜tool▁sep｜>\s*([\w.-]+)\s*```(?:json)?\s*(.*?)\s*```"
                         r"\s*<｜tool▁call▁end｜>", text, re.S):
        v = _json_obj(m.group(2))
        if v is not None:
            calls.append(_call(m.group(1), v))
    return text.split("<｜tool▁calls▁begin｜>")[0], calls


def _harmony(text: str):
    calls = []
    for m in re.finditer(r"to=functions\.([\w.-]+).*?<\|message\|>(.*?)(?:<\|call\|>|$)", text, re.S):
        v = _json_obj(m.group(2).strip())
        if v is not None:
            calls.append(_call(m.group(1), v))
    final = re.search(r"<\|channel\|>final<\|message\|>(.*?)(?:<\|return\|>|<\|end\|>|$)", text, re.S)
    return (final.group(1) if final else ("" if calls else text)), calls


# (name, a marker its chat template writes, parser): the first whose marker the template has is the family's
PARSERS = [
    ("glm45", "<arg_key>", _glm45),
    ("hermes", "<tool_call>", _hermes),
    ("kimi_k2", "<|tool_call_begin|>", _kimi_k2),
    ("deepseek_v3", "<｜tool▁call▁begin｜>", _deepseek_v3),
    ("harmony", "<|channel|>", _harmony),
]


def parser_for(template_text: "str | None"):
    """The family parser whose marker the chat template writes; Hermes (the most common) when none does."""
    for name, marker, fn in PARSERS:
        if template_text and marker in template_text:
            return name, fn
    return "hermes", _hermes


def parse_auto(parser, text: str) -> "tuple[str | None, list]":
    """(content or None, tool_calls) of a free output."""
    content, calls = parser(text)
    return (content.strip() or None) if calls else text, calls
