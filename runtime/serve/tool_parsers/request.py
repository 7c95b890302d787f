"""What a request offers (OpenAI's ``tools`` / ``tool_choice`` / ``parallel_tool_calls``), validated into
``Tools``."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..params import ApiError
from . import required


@dataclass
class Tools:
    functions: list                 # [{"name", "description", "parameters"}]
    choice: str                     # auto | required | named
    named: "str | None" = None
    parallel: bool = True           # parallel_tool_calls: false allows one call per turn
    _grammar: object = field(default=None, repr=False, compare=False)

    def grammar(self) -> "list | None":
        """The engine's grammar for required / named calls; None for auto (written once: 500 tools' is ~100 KB)."""
        if self._grammar is None:
            self._grammar = [required.grammar(self.functions, self.choice, self.named, self.parallel)]
        return self._grammar[0]

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
    fns = [_function(i, t) for i, t in enumerate(tools)]
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


def _function(i: int, t) -> dict:
    """tools[i] as {"name", "description", "parameters"}, validated."""
    f = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
    if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}",
                                                                                            f["name"]):
        raise ApiError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": "
                            f"[A-Za-z0-9_.-]{{1,64}}, ...}}}}", param=f"tools[{i}]")
    p = f.get("parameters")
    if p is not None and not isinstance(p, dict):
        raise ApiError(400, f"tools[{i}].function.parameters must be a JSON schema object", param=f"tools[{i}]")
    _check_parameters(p or {}, f"tools[{i}].function.parameters")
    strict = f.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ApiError(400, f"tools[{i}].function.strict must be a boolean", param=f"tools[{i}]")
    p = p or {"type": "object"}
    return {"name": f["name"], "description": f.get("description", ""), "parameters": strict_schema(p) if strict else p}


# where a schema holds schemas (JSON Schema 2020-12): one, a list of them, a map of them
_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
        "unevaluatedProperties")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAP = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")


def strict_schema(s):
    """OpenAI's ``strict: true``: no object anywhere in the schema (its $defs too) takes properties it does not
    name - ``additionalProperties: false`` where a schema does not say otherwise."""
    if not isinstance(s, dict):
        return s
    out = dict(s)
    for k in _ONE:
        if isinstance(out.get(k), dict):
            out[k] = strict_schema(out[k])
    for k in _LIST:
        if isinstance(out.get(k), list):
            out[k] = [strict_schema(x) for x in out[k]]
    for k in _MAP:
        if isinstance(out.get(k), dict):
            out[k] = {n: strict_schema(x) for n, x in out[k].items()}
    if (out.get("type") == "object" or isinstance(out.get("properties"), dict)) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


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
