"""The pieces shared by the formats that write each argument by name, strings raw and the rest as JSON (GLM-4.5,
Qwen3.5 / Qwen3-Coder): parsing such calls back with typed values, and the grammar rules of their arguments."""
from __future__ import annotations

import json
import re

from .base import alts, call, json_obj


def raw_string(schema: dict) -> bool:
    """GLM-4.5 and Qwen3.5 / Qwen3-Coder write a string argument as it is, anything else as JSON (their chat
    templates' rule)."""
    return schema.get("type") == "string" or (bool(schema.get("enum")) and all(isinstance(e, str) for e in schema["enum"]))


def typed(v: str, schema: dict):
    """An argument written as text, typed by the tool's parameter schema (as vLLM's parsers for these formats do):
    a string as it is; a boolean from true / false in any case (Qwen3.5's template writes Python's True); else
    JSON, or the text when it is none."""
    if raw_string(schema):
        return v
    if schema.get("type") == "boolean" and v.strip().lower() in ("true", "false"):
        return v.strip().lower() == "true"
    parsed = json_obj(v)
    return parsed if parsed is not None else v


def named_calls(text: str, functions: list, call_re: str, arg_re: str) -> tuple:
    """Calls whose arguments are written by name: ``call_re`` finds each (groups: name, body), ``arg_re`` each
    argument in its body (groups: key, value); values typed by the tool's parameters."""
    props = {f["name"]: (f.get("parameters") or {}).get("properties") or {} for f in functions}
    calls = []
    for m in re.finditer(call_re, text, re.S):
        name = m.group(1).strip()
        args = {k.strip(): typed(v, props.get(name, {}).get(k.strip(), {}))
                for k, v in re.findall(arg_re, m.group(2), re.S)}
        calls.append(call(name, args))
    return text.split("<tool_call>")[0], calls


def raw_regex(schema: dict) -> str:
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


def named_arguments(functions: list, value, arg) -> "tuple[list, list]":
    """The rules of formats that write each argument by name: per function the sequence of its parameters in their
    order, the required ones present (``a{i}_{j}`` rules: ``arg(i, j, key)``), each value's rule ``v{i}_{j}``
    (``value(i, j, schema)``: its rule lines). Returns (rule lines, each function's sequence)."""
    out, seqs = [], []
    for i, f in enumerate(functions):
        params = f["parameters"]
        required = set(params.get("required") or [])
        seq = []
        for j, (k, sch) in enumerate((params.get("properties") or {}).items()):
            out += value(i, j, local(sch, params))
            out.append(f"a{i}_{j}: {arg(i, j, k)}\n")
            seq.append(f"a{i}_{j}" + ("" if k in required else "?"))
        seqs.append(" ".join(seq))
    return out, seqs


def local(sch: dict, params: dict) -> dict:
    """A parameter's schema as a root of its own: with the tool's ``$defs`` / ``definitions`` (so its refs resolve),
    a top-level ``$ref`` to one of them replaced by it (what decides whether the value is written raw)."""
    defs = {k: params[k] for k in ("$defs", "definitions") if isinstance(params.get(k), dict)}
    ref = sch.get("$ref")
    for k, d in defs.items():
        name = ref[len(k) + 3:] if isinstance(ref, str) and ref.startswith(f"#/{k}/") else None
        if isinstance(d.get(name), dict):
            sch = {**d[name], **{x: v for x, v in sch.items() if x != "$ref"}}
            break
    return {**sch, **defs}


def enum(sch: dict) -> str:
    return "(" + alts([json.dumps(e) for e in sch["enum"]]) + ")"

