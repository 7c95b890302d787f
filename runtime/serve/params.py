"""What a request body may say, checked before it reaches the engine: OpenAI's error object
(``ApiError``), number and stop-string validation, the parameters tiered-moe refuses, and the
incremental detokenizer that holds back text that may still become a stop string."""
from __future__ import annotations

import json

INT64 = 1 << 63           # integers that cross the msgpack wire as int64
MAX_STOP_CHARS = 256


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param: "str | None" = None, code: "str | None" = None,
                 type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# -- request validation --------------------------------------------------------------------------
def number(body: dict, name: str, default, lo=None, hi=None, integer=False, lo_open=False):
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int if integer else (int, float)):
        raise ApiError(400, f"'{name}' must be {'an integer' if integer else 'a number'}, got {json.dumps(v)[:80]}",
                       param=name)
    if not integer and v != v or v in (float("inf"), float("-inf")):
        raise ApiError(400, f"'{name}' must be a finite number", param=name)
    if integer and not -INT64 <= v < INT64:
        raise ApiError(400, f"'{name}' must fit in a signed 64-bit integer, got {v}", param=name)
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise ApiError(400, f"'{name}' must be {'>' if lo_open else '>='} {lo}, got {v}", param=name)
    if hi is not None and v > hi:
        raise ApiError(400, f"'{name}' must be <= {hi}, got {v}", param=name)
    return v


def response_format(body: dict) -> "list | None":
    """OpenAI's ``response_format`` as the engine's grammar [format, text] (runtime/engine/grammar.py): None for
    text; json_object; json_schema with its ``schema`` (a schema that does not compile is refused by the engine,
    a 400 naming the problem)."""
    rf = body.get("response_format")
    if rf is None:
        return None
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return ["json_object", ""]
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema"), dict):
            raise ApiError(400, "'response_format.json_schema.schema' must be a JSON schema object",
                           param="response_format")
        return ["json_schema", json.dumps(js["schema"])]
    raise ApiError(400, "'response_format' must be {\"type\": \"text\" | \"json_object\" | \"json_schema\"}",
                   param="response_format")


def stop_strings(body: dict) -> list:
    s = body.get("stop")
    if s is None:
        return []
    if isinstance(s, str):
        s = [s]
    if not isinstance(s, list) or not all(isinstance(x, str) and x for x in s) or len(s) > 4:
        raise ApiError(400, "'stop' must be a non-empty string or a list of up to 4 non-empty strings", param="stop")
    long = [x for x in s if len(x) > MAX_STOP_CHARS]
    if long:
        # a stream holds back the last (longest stop - 1) characters: an unbounded stop would hold back everything
        raise ApiError(400, f"'stop' strings may have up to {MAX_STOP_CHARS} characters, got {len(long[0]):,}",
                       param="stop")
    return s


def refuse_unsupported(body: dict) -> None:
    if body.get("echo"):
        raise ApiError(400, "'echo' is not supported", param="echo")
    if body.get("best_of") not in (None, 1, body.get("n", 1)):
        raise ApiError(400, "'best_of' is not supported (n choices are returned as they are)", param="best_of")
    if body.get("logit_bias") is not None and not isinstance(body.get("logit_bias"), dict):
        raise ApiError(400, "'logit_bias' must be an object of token id -> bias", param="logit_bias")


class Detokenizer:
    """Token ids -> text deltas, incrementally: each token decodes only a short window of the
    latest ids (from ``prefix``, a few tokens back, so merges across token boundaries come out
    right), never the whole output again. Holds back a trailing incomplete UTF-8 sequence (decoded
    as U+FFFD) and, with stop strings, the last few characters that could start one."""

    def __init__(self, tok, stops: list, keep: frozenset = frozenset()) -> None:
        self.tok, self.stops, self.keep = tok, stops, keep      # keep: special tokens that stay in the text
        self.ids: list = []
        self.prefix = 0          # ids[prefix:read] decode to text already appended
        self.read = 0
        self.text = ""           # everything decoded so far
        self.sent = 0            # characters of text already returned
        self.hold = max((len(s) for s in stops), default=1) - 1

    def _decode_new(self) -> None:
        prev = self.tok.decode(self.ids[self.prefix:self.read], self.keep)
        cur = self.tok.decode(self.ids[self.prefix:], self.keep)
        if cur.endswith("\ufffd"):
            return                                   # an incomplete character: wait for more tokens
        self.text += cur[len(prev):]
        self.prefix, self.read = max(self.read - 4, 0), len(self.ids)

    def push(self, tid: int) -> "tuple[str, bool]":
        """Returns (delta, hit a stop string)."""
        self.ids.append(tid)
        self._decode_new()
        for s in self.stops:
            i = self.text.find(s, max(0, self.sent - len(s)))
            if i >= 0:
                self.text = self.text[:i]
                return self._flush(), True
        end = len(self.text) - self.hold
        if end <= self.sent:
            return "", False
        d = self.text[self.sent:end]
        self.sent = end
        return d, False

    def _flush(self) -> str:
        d = self.text[self.sent:]
        self.sent = len(self.text)
        return d

    def finish(self) -> str:
        if self.read < len(self.ids):                # a trailing incomplete character: as U+FFFD
            self.text += self.tok.decode(self.ids[self.prefix:], self.keep)[len(self.tok.decode(self.ids[self.prefix:self.read], self.keep)):]
            self.read = len(self.ids)
        return self._flush()
