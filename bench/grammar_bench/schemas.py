"""The JSON schemas the engines compile, a validator of the keywords they use (the bench's own check of every
output), and the string probes (RFC 8259) fed inside each schema's strings."""
from __future__ import annotations

import json

SCHEMAS = {
    "flat": {"type": "object", "additionalProperties": False, "required": ["name", "age", "role"],
             "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"},
                            "role": {"enum": ["admin", "user", "guest"]}}},
    "nested": {"type": "object", "additionalProperties": False, "required": ["id", "items"],
               "properties": {
                   "id": {"type": "integer"},
                   "items": {"type": "array", "maxItems": 5, "items": {
                       "type": "object", "additionalProperties": False, "required": ["sku", "qty", "tags"],
                       "properties": {"sku": {"type": "string", "maxLength": 12}, "qty": {"type": "integer"},
                                      "tags": {"type": "array", "maxItems": 3,
                                               "items": {"type": "string", "maxLength": 8}}}}}}},
    "json_object": {"type": "object"},
}


KNOWN = {"type", "properties", "required", "additionalProperties", "items", "maxItems", "minItems", "maxLength",
         "minLength", "enum"}


def validate(v, s: dict, path: str = "$") -> list:
    """The ways v breaks schema s (empty: valid)."""
    unknown = set(s) - KNOWN
    if unknown:
        raise ValueError(f"validator does not know {sorted(unknown)}")
    errs = []
    if "enum" in s and not any(v == e and type(v) is type(e) for e in s["enum"]):
        errs.append(f"{path}: {v!r} not in enum")
    t = s.get("type")
    ok = {None: True, "object": isinstance(v, dict), "array": isinstance(v, list), "string": isinstance(v, str),
          "integer": isinstance(v, int) and not isinstance(v, bool),
          "number": isinstance(v, (int, float)) and not isinstance(v, bool), "boolean": isinstance(v, bool),
          "null": v is None}[t]
    if not ok:
        return errs + [f"{path}: {type(v).__name__} is not {t}"]
    if isinstance(v, str):
        if len(v) > s.get("maxLength", len(v)) or len(v) < s.get("minLength", 0):
            errs.append(f"{path}: string length {len(v)} outside [{s.get('minLength', 0)}, {s.get('maxLength')}]")
    if isinstance(v, list):
        if len(v) > s.get("maxItems", len(v)) or len(v) < s.get("minItems", 0):
            errs.append(f"{path}: {len(v)} items outside [{s.get('minItems', 0)}, {s.get('maxItems')}]")
        if "items" in s:
            for i, x in enumerate(v):
                errs += validate(x, s["items"], f"{path}[{i}]")
    if isinstance(v, dict):
        props = s.get("properties", {})
        errs += [f"{path}: missing {k!r}" for k in s.get("required", []) if k not in v]
        if s.get("additionalProperties", True) is False:
            errs += [f"{path}: extra property {k!r}" for k in v if k not in props]
        for k, x in v.items():
            if k in props:
                errs += validate(x, props[k], f"{path}.{k}")
    return errs


def check_output(text: str, schema: dict) -> list:
    """Parse (strict JSON: no NaN / Infinity) and validate; the problems found."""
    def no_const(c):
        raise ValueError(f"non-JSON constant {c}")
    try:
        v = json.loads(text, parse_constant=no_const)
    except ValueError as e:
        return [f"not JSON: {e}"]
    return validate(v, schema)


# JSON string conformance: inside a string of the schema (bounded by maxLength in flat and nested, unbounded in
# json_object), is each of these accepted? RFC 8259: control characters U+0000-001F must be escaped; every other
# character may appear raw (DEL included); \n, \uXXXX and \/ are escapes every string may use. Accepting a raw
# control character is a bug (the output is not JSON); rejecting something else only narrows what the model may
# write (an engine may insist on one spelling: "A" rather than \u0041).
PROBE_PREFIX = {"flat": '{"name":"a', "nested": '{"id":1,"items":[{"sku":"a', "json_object": '{"k":"a'}
PROBES = {"raw \\x01": ("\x01", False), "raw DEL": ("\x7f", True), "é": ("é", True), "\\n": ("\\n", True),
          "\\u0001": ("\\u0001", True), "\\u0041": ("\\u0041", True), "\\/": ("\\/", True)}

