"""Tool calls (OpenAI's ``tools`` / ``tool_choice``): what a request offers, how the output is constrained or
parsed into ``tool_calls``.

* ``tool_choice`` "required" / a named function: the output is constrained (runtime/engine/grammar.py) to JSON
  naming the call(s) - required: ``[{"name", "arguments"}, ...]`` (at least one), named: ``{"name", "arguments"}``
  of that function - so the calls always parse and their arguments validate against the function's parameters.
* "auto": the tools are rendered into the chat template (the ``tools`` variable Hugging Face templates read) and
  the model's text is parsed by its family's tool-call format (``FORMATS``, picked by the markers its chat template
  writes). The model is free until it samples the token that opens its family's calls; from there on the output is
  constrained (``ToolFormat.grammar``: a Lark grammar for llguidance) to well-formed calls of offered tools whose
  arguments validate against their parameters, ending with the format's closing marker - what llguidance calls a
  lazy grammar and vLLM / SGLang a structural tag. The family's marker tokens are special tokens in its tokenizer:
  they are kept in the text (``ToolFormat.tokens``; vLLM keeps special tokens when tools are offered) so the parser
  sees them: Hermes / Qwen3 ``<tool_call>{json}</tool_call>``; GLM-4.5 ``<tool_call>name<arg_key>k</arg_key>
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
from typing import Callable

from .params import ApiError


@dataclass
class Tools:
    functions: list                 # [{"name", "description", "parameters"}]
    choice: str                     # auto | required | named
    named: "str | None" = None
    parallel: bool = True           # parallel_tool_calls: false allows one call per turn

    def grammar(self) -> "list | None":
        """The engine's grammar for required / named calls; None for auto."""
        def call(f):
            return {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                    "properties": {"name": {"const": f["name"]}, "arguments": f.get("parameters") or {"type": "object"}}}
        if self.choice == "named":
            return ["json_schema", json.dumps(call(next(f for f in self.functions if f["name"] == self.named)))]
        if self.choice == "required":
            return ["json_schema", json.dumps({"type": "array", "minItems": 1, **({} if self.parallel else {"maxItems": 1}),
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
        _check_parameters(p or {}, f"tools[{i}].function.parameters")
        fns.append({"name": f["name"], "description": f.get("description", ""), "parameters": p or {"type": "object"}})
    names = [f["name"] for f in fns]
    if len(set(names)) != len(names):
        raise ApiError(400, "tool names must be unique", param="tools")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise ApiError(400, "'parallel_tool_calls' must be a boolean", param="parallel_tool_calls")
    if choice in (None, "auto"):
        return Tools(fns, "auto", parallel=parallel)
    if choice == "none":
        return None
    if choice == "required":
        return Tools(fns, "required", parallel=parallel)
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in names:
            raise ApiError(400, f"'tool_choice' names {name!r}, which is not among the tools", param="tool_choice")
        return Tools(fns, "named", name)
    raise ApiError(400, "'tool_choice' must be none, auto, required or {\"type\": \"function\", \"function\": "
                        "{\"name\": ...}}", param="tool_choice")


def _check_parameters(p: dict, where: str) -> None:
    """The parts of a tool's parameters the call grammars read: properties an object of schemas, required a list of
    names, string and number bounds numbers (the grammar engine checks the rest of the schema)."""
    props = p.get("properties", {})
    if not isinstance(props, dict):
        raise ApiError(400, f"{where}.properties must be an object of JSON schemas", param="tools")
    req = p.get("required", [])
    if not isinstance(req, list) or not all(isinstance(r, str) for r in req):
        raise ApiError(400, f"{where}.required must be a list of property names", param="tools")
    for k, sch in props.items():
        if not isinstance(sch, dict):
            raise ApiError(400, f"{where}.properties.{k} must be a JSON schema object, got {type(sch).__name__}",
                           param="tools")
        for n in ("minLength", "maxLength"):
            if n in sch and (not isinstance(sch[n], int) or isinstance(sch[n], bool) or sch[n] < 0):
                raise ApiError(400, f"{where}.properties.{k}.{n} must be a non-negative integer", param="tools")
        if "pattern" in sch and not isinstance(sch["pattern"], str):
            raise ApiError(400, f"{where}.properties.{k}.pattern must be a string", param="tools")
        if "enum" in sch and not isinstance(sch["enum"], list):
            raise ApiError(400, f"{where}.properties.{k}.enum must be a list", param="tools")


def _call(name: str, arguments) -> dict:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function", "function": {"name": name, "arguments": args}}


def constrained_calls(tools: Tools, text: str) -> list:
    """The tool_calls of a required / named output (JSON by construction), arguments as written."""
    v = json.loads(text)
    calls = [_call(c["name"], c["arguments"]) for c in (v if isinstance(v, list) else [v])]
    written = _span_calls(_json_spans(text, _CONSTRAINED_HEAD), text)
    return written if len(written) == len(calls) else calls


# -- the families' formats (auto) ------------------------------------------------------------------------------
def _json_obj(s: str):
    try:
        return json.loads(s)
    except ValueError:
        return None


def _hermes(text: str, functions: list):
    calls = []
    for m in re.finditer(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", text, re.S):
        v = _json_obj(m.group(1))
        if isinstance(v, dict) and isinstance(v.get("name"), str):
            calls.append(_call(v["name"], v.get("arguments", {})))
    return text.split("<tool_call>")[0], calls


def _raw_string(schema: dict) -> bool:
    """GLM-4.5 and Qwen3.5 / Qwen3-Coder write a string argument as it is, anything else as JSON (their chat
    templates' rule)."""
    return schema.get("type") == "string" or (bool(schema.get("enum")) and all(isinstance(e, str) for e in schema["enum"]))


def _typed(v: str, schema: dict):
    """An argument written as text, typed by the tool's parameter schema (as vLLM's parsers for these formats do):
    a string as it is; a boolean from true / false in any case (Qwen3.5's template writes Python's True); else
    JSON, or the text when it is none."""
    if _raw_string(schema):
        return v
    if schema.get("type") == "boolean" and v.strip().lower() in ("true", "false"):
        return v.strip().lower() == "true"
    parsed = _json_obj(v)
    return parsed if parsed is not None else v


def _named_calls(text: str, functions: list, call: str, arg: str) -> tuple:
    """Calls whose arguments are written by name (GLM-4.5, Qwen3.5): ``call`` finds each (groups: name, body),
    ``arg`` each argument in its body (groups: key, value); values typed by the tool's parameters."""
    props = {f["name"]: (f.get("parameters") or {}).get("properties") or {} for f in functions}
    calls = []
    for m in re.finditer(call, text, re.S):
        name = m.group(1).strip()
        args = {k.strip(): _typed(v, props.get(name, {}).get(k.strip(), {})) for k, v in re.findall(arg, m.group(2), re.S)}
        calls.append(_call(name, args))
    return text.split("<tool_call>")[0], calls


def _glm45(text: str, functions: list):
    return _named_calls(text, functions, r"<tool_call>\s*([^<\n]+)(.*?)</tool_call>",
                        r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>")


def _qwen3_coder(text: str, functions: list):
    return _named_calls(text, functions, r"<tool_call>\s*<function=([^>\n]+)>(.*?)</function>\s*</tool_call>",
                        r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>")


def _kimi_k2(text: str, functions: list):
    calls = []
    for m in re.finditer(r"<\|tool_call_begin\|>\s*(?:functions\.)?([\w.-]+?)(?::\d+)?\s*<\|tool_call_argument_begin\|>"
                         r"(.*?)<\|tool_call_end\|>", text, re.S):
        v = _json_obj(m.group(2).strip())
        if v is not None:
            calls.append(_call(m.group(1), v))
    return text.split("<|tool_calls_section_begin|>")[0], calls


def _deepseek_v3(text: str, functions: list):
    calls = []
    for m in re.finditer(r"<｜tool▁call▁begin｜>\s*function\s*<｜tool▁sep｜>\s*([\w.-]+)\s*```(?:json)?\s*(.*?)\s*```"
                         r"\s*<｜tool▁call▁end｜>", text, re.S):
        v = _json_obj(m.group(2))
        if v is not None:
            calls.append(_call(m.group(1), v))
    return text.split("<｜tool▁calls▁begin｜>")[0], calls


def _harmony(text: str, functions: list):
    from .harmony import split
    h = split(text)
    calls = [_call(name, args) for name, args in h.calls if _json_obj(args) is not None]
    return h.content, calls


# -- what follows the trigger token: Lark grammars (llguidance's dialect) --------------------------------------
# ``t(marker)`` is a marker as the grammar names it: ``<[id]>``, its token, where the tokenizer has one for it (the
# model writes a marker as that token, and a special token's bytes are not text), else the quoted text. ``%json {schema}`` is a JSON value valid against the schema.
def _args_rule(name: str, schema: dict) -> str:
    from ..engine.grammar import json_schema_text
    return f"{name}: %json {json_schema_text(schema or {'type': 'object'})}\n"


def _alts(rules: list) -> str:
    return " | ".join(rules)


def _hermes_grammar(functions: list, t, parallel: bool) -> str:
    from ..engine.grammar import json_schema_text
    call = {"anyOf": [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                       "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]}} for f in functions]}
    # Qwen3's template: <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>, calls one per line
    return (f'start: body' + (f' ("\\n"? {t("<tool_call>")} body)*\n' if parallel else "\n") +
            f'body: "\\n" call "\\n" {t("</tool_call>")}\n'
            f"call: %json {json_schema_text(call)}\n")


def _raw_regex(schema: dict) -> str:
    """A raw (unquoted) string of a string schema as a Lark regex: its pattern (a JSON-schema pattern is unanchored
    unless it says ^...$; a lexeme matches whole), else any text without "<" (which would open the closing marker)
    within minLength / maxLength."""
    p = schema.get("pattern")
    if isinstance(p, str):
        body = p[1:] if p.startswith("^") else ".*" + p
        body = body[:-1] if body.endswith("$") and not body.endswith("\\$") else body + ".*"
        return "/" + body.replace("/", "\\/") + "/"
    lo, hi = schema.get("minLength", 0), schema.get("maxLength")
    return "/[^<]{%d,%s}/" % (lo, hi if isinstance(hi, int) else "")


def _named_arguments(functions: list, value, arg) -> "tuple[list, list]":
    """The rules of formats that write each argument by name (GLM-4.5, Qwen3.5): per function the sequence of its
    parameters in their order, the required ones present (``a{i}_{j}`` rules: ``arg(i, j, key)``), each value's
    rule ``v{i}_{j}`` (``value(i, j, schema)``: its rule lines). Returns (rule lines, each function's sequence)."""
    out, seqs = [], []
    for i, f in enumerate(functions):
        params = f["parameters"]
        required = set(params.get("required") or [])
        seq = []
        for j, (k, sch) in enumerate((params.get("properties") or {}).items()):
            out += value(i, j, sch)
            out.append(f"a{i}_{j}: {arg(i, j, k)}\n")
            seq.append(f"a{i}_{j}" + ("" if k in required else "?"))
        seqs.append(" ".join(seq))
    return out, seqs


def _enum(sch: dict) -> str:
    return "(" + _alts([json.dumps(e) for e in sch["enum"]]) + ")"


def _glm45_grammar(functions: list, t, parallel: bool) -> str:
    # GLM-4.5's template: <tool_call>name\n<arg_key>k</arg_key>\n<arg_value>v</arg_value>\n...</tool_call>; strings
    # raw and the rest JSON
    def value(i, j, sch):
        if not _raw_string(sch):
            return [_args_rule(f"v{i}_{j}", sch)]
        return [f"v{i}_{j}: {_enum(sch) if sch.get('enum') else _raw_regex(sch)}\n"]

    def arg(i, j, k):
        return (f'{t("<arg_key>")} {json.dumps(k)} {t("</arg_key>")} "\\n" {t("<arg_value>")} v{i}_{j} '
                f'{t("</arg_value>")} "\\n"')
    out, seqs = _named_arguments(functions, value, arg)
    fns = [f'{json.dumps(f["name"] + chr(10))} {seq} {t("</tool_call>")}' for f, seq in zip(functions, seqs)]
    return (f'start: body' + (f' ("\\n"? {t("<tool_call>")} body)*\n' if parallel else "\n") +
            f"body: {_alts(fns)}\n" + "".join(out))


def _qwen3_coder_grammar(functions: list, t, parallel: bool) -> str:
    # Qwen3.5's / Qwen3-Coder's template: <tool_call>\n<function=name>\n<parameter=k>\nv\n</parameter>\n...
    # </function>\n</tool_call>; strings raw (a raw value's lexeme takes its closing "\n</parameter>" with it: the
    # text may hold newlines), booleans in either case (the template writes Python's True), the rest JSON
    close = '"\\n</parameter>\\n"'

    def value(i, j, sch):
        if _raw_string(sch) and not sch.get("enum"):
            return [f"v{i}_{j}: /{_raw_regex(sch)[1:-1]}\\n<\\/parameter>/ \"\\n\"\n"]
        if _raw_string(sch):
            return [f"v{i}_{j}: {_enum(sch)} {close}\n"]
        if sch.get("type") == "boolean":
            return [f'v{i}_{j}: ("true" | "false" | "True" | "False") {close}\n']
        return [_args_rule(f"j{i}_{j}", sch), f"v{i}_{j}: j{i}_{j} {close}\n"]
    out, seqs = _named_arguments(functions, value, lambda i, j, k: f'{json.dumps("<parameter=" + k + ">" + chr(10))} '
                                                                   f"v{i}_{j}")
    fns = [f'{json.dumps(f["name"] + ">" + chr(10))} {seq}' for f, seq in zip(functions, seqs)]
    return (f'start: body' + (f' ("\\n"? {t("<tool_call>")} body)*\n' if parallel else "\n") +
            f'body: "\\n<function=" ({_alts(fns)}) "</function>\\n" {t("</tool_call>")}\n' + "".join(out))


def _kimi_k2_grammar(functions: list, t, parallel: bool) -> str:
    # Kimi K2's template: <|tool_call_begin|>functions.name:index<|tool_call_argument_begin|>{json}<|tool_call_end|>
    # per call inside <|tool_calls_section_begin|> ... <|tool_calls_section_end|>; the index (the call's number in the turn)
    # of at most two digits
    fns = [f'{json.dumps("functions." + f["name"] + ":")} /[0-9]{{1,2}}/ {t("<|tool_call_argument_begin|>")} args{i}'
           for i, f in enumerate(functions)]
    return (f'start: call{"+" if parallel else ""} {t("<|tool_calls_section_end|>")}\n'
            f'call: {t("<|tool_call_begin|>")} ({_alts(fns)}) {t("<|tool_call_end|>")}\n'
            + "".join(_args_rule(f"args{i}", f["parameters"]) for i, f in enumerate(functions)))


def _deepseek_v3_grammar(functions: list, t, parallel: bool) -> str:
    # DeepSeek-V3's template: <｜tool▁call▁begin｜>function<｜tool▁sep｜>name\n```json\n{json}\n```<｜tool▁call▁end｜>,
    # calls one per line inside <｜tool▁calls▁begin｜> ... <｜tool▁calls▁end｜>
    fns = [f'{json.dumps(f["name"] + chr(10) + "```json" + chr(10))} args{i} "\\n```"' for i, f in enumerate(functions)]
    more = ' ("\\n"? call)*' if parallel else ""
    return (f'start: call{more} {t("<｜tool▁calls▁end｜>")}\n'
            f'call: {t("<｜tool▁call▁begin｜>")} "function" {t("<｜tool▁sep｜>")} ({_alts(fns)}) '
            f'{t("<｜tool▁call▁end｜>")}\n'
            + "".join(_args_rule(f"args{i}", f["parameters"]) for i, f in enumerate(functions)))


# -- streaming: where each call's arguments are in a partial text ----------------------------------------------
def _json_end(text: str, i: int) -> "int | None":
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


def _held(text: str, marker: str) -> int:
    """How many trailing characters of ``text`` may be the start of ``marker`` (or whitespace before it)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def _json_spans(text: str, head: re.Pattern) -> list:
    """(name, start, end or None) of each call whose head (``head``: the text up to its arguments, the name its
    group 1) is in the text, arguments a JSON value that starts at ``start``; the next is looked for after it."""
    out, pos = [], 0
    while True:
        m = head.search(text, pos)
        if m is None:
            return out
        end = _json_end(text, m.end())
        out.append((m.group(1), m.end(), end))
        if end is None:
            return out
        pos = end


def _marker_spans(text: str, head: re.Pattern, close: str) -> list:
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


# a head ends where its arguments' first character is (so a partial text never moves where they start)
_CALL_HEAD = r'\{\s*"name"\s*:\s*"([^"\\]+)"\s*,\s*"arguments"\s*:\s*(?=\S)'
_HERMES_HEAD = re.compile(r"<tool_call>\s*" + _CALL_HEAD)
_CONSTRAINED_HEAD = re.compile(_CALL_HEAD)
_KIMI_HEAD = re.compile(r"<\|tool_call_begin\|>\s*(?:functions\.)?([\w.-]+?)(?::\d+)?\s*"
                        r"<\|tool_call_argument_begin\|>\s*(?=\S)")
_DEEPSEEK_HEAD = re.compile(r"<｜tool▁call▁begin｜>\s*function\s*<｜tool▁sep｜>\s*([\w.-]+)\s*```(?:json)?\s*(?=[^\sj])")


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


HARMONY_TOKENS = ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|call|>", "<|return|>")

# One registry: the first whose marker the template has is the family's (GLM-4.5's and Qwen3.5's before Hermes:
# all three write <tool_call>). gpt-oss's harmony calls are parsed, not constrained: a call opens with a channel header whose
# tokens also open its analysis and final messages.
FORMATS = [
    ToolFormat("glm45", "<arg_key>", _glm45,
               ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"),
               "<tool_call>", _glm45_grammar),
    ToolFormat("qwen3_coder", "<function=", _qwen3_coder, ("<tool_call>", "</tool_call>"), "<tool_call>",
               _qwen3_coder_grammar),
    ToolFormat("hermes", "<tool_call>", _hermes, ("<tool_call>", "</tool_call>"), "<tool_call>", _hermes_grammar,
               lambda text: _json_spans(text, _HERMES_HEAD)),
    ToolFormat("kimi_k2", "<|tool_call_begin|>", _kimi_k2,
               ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                "<|tool_call_argument_begin|>", "<|tool_call_end|>"),
               "<|tool_calls_section_begin|>", _kimi_k2_grammar,
               lambda text: _marker_spans(text, _KIMI_HEAD, "<|tool_call_end|>"), "<|tool_call_end|>"),
    ToolFormat("deepseek_v3", "<｜tool▁call▁begin｜>", _deepseek_v3,
               ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>",
                "<｜tool▁call▁end｜>"),
               "<｜tool▁calls▁begin｜>", _deepseek_v3_grammar,
               lambda text: _marker_spans(text, _DEEPSEEK_HEAD, "```"), "```"),
    ToolFormat("harmony", "<|channel|>", _harmony, HARMONY_TOKENS),
]
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


def _span_calls(spans: list, text: str) -> list:
    """The calls of complete spans whose arguments are JSON, their arguments as written (what was streamed)."""
    calls = []
    for name, a, b in spans:
        if b is None or _json_obj(text[a:b]) is None:
            return []
        calls.append(_call(name, text[a:b]))
    return calls


def parse_auto(fmt: ToolFormat, text: str, functions: "list | None" = None) -> "tuple[str | None, list]":
    """(content or None, tool_calls) of a free output. A format that streams its calls: the calls its spans find
    (arguments as written, so they equal what was streamed) when they are whole, else its parser's."""
    content, calls = fmt.parse(text, functions or [])
    if calls and fmt.spans is not None:
        calls = _span_calls(fmt.spans(text), text) or calls
    return (content.strip() or None) if calls else text, calls


def stream_spans(tools: Tools, fmt: ToolFormat, text: str) -> "list | None":
    """(name, start, end or None) of the calls in a partial output as far as they can be streamed; None: the calls
    of this output are sent whole when it ends (a format without spans)."""
    if tools.choice != "auto":
        return _json_spans(text, _CONSTRAINED_HEAD)
    if fmt.spans is None:
        return None
    return fmt.spans(text)


def streamable_arguments(text: str, start: int, end: "int | None", close: str = "") -> str:
    """What of a call's arguments can be sent now: all of them once their end is known; before, up to the end of
    the text less trailing whitespace and a tail that may be the start of the closing marker."""
    if end is not None:
        return text[start:end]
    part = text[start:]
    part = part[:len(part) - _held(part, close)] if close else part
    return part.rstrip()
