"""What a request body may say, checked before it reaches the engine: OpenAI's error object
(``ApiError``), number and stop-string validation, the output constraint (``response_format`` or vLLM's
``guided_*`` / ``structured_outputs``), vLLM's sampling fields (min_tokens, min_p, allowed_token_ids,
prompt_logprobs, echo, include_stop_str_in_output), the one table of known fields that are refused or ignored on
purpose (``KNOWN``), and the incremental detokenizer that holds back text that may still become a stop string."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Callable

from ..engine.request import MAX_LOGPROBS

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


# -- structured output ----------------------------------------------------------------------------------------
def constraint(body: dict) -> "tuple[str, list] | None":
    """The request's output constraint as (the field that set it, the engine's grammar [format, text]): OpenAI's
    ``response_format``, or vLLM's ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` or
    ``structured_outputs`` ({json | regex | choice | grammar | json_object}); at most one. vLLM's meanings through
    its llguidance backend's formats: a grammar is Lark or GBNF, a choice is one of the strings exactly."""
    found = []
    rf = response_format(body)
    if rf is not None:
        found.append(("response_format", rf))
    for name, fmt in GUIDED.items():
        if body.get(name) is not None:
            found.append((name, _guided(name, fmt, body[name])))
    if body.get("structured_outputs") is not None:
        found.append(("structured_outputs", _structured(body["structured_outputs"])))
    if len(found) > 1:
        raise ApiError(400, f"only one output constraint may be given; got '{found[0][0]}' and '{found[1][0]}'",
                       param=found[1][0])
    return found[0] if found else None


# vLLM's guided_* field -> the engine's grammar format (runtime/engine/grammar.py FORMATS)
GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def _guided(name: str, fmt: str, v) -> list:
    """One constraint's value as the engine's [format, text]; a 400 naming ``name`` when it has the wrong shape."""
    if fmt == "json_schema":
        if isinstance(v, str):             # vLLM takes the schema as JSON text too
            try:
                v = json.loads(v)
            except ValueError as e:
                raise ApiError(400, f"'{name}' is not valid JSON: {e}", param=name) from None
        if not isinstance(v, dict):
            raise ApiError(400, f"'{name}' must be a JSON schema object", param=name)
        return ["json_schema", json.dumps(v)]
    if fmt == "choice":
        if not (isinstance(v, list) and v and all(isinstance(x, str) for x in v)):
            raise ApiError(400, f"'{name}' must be a non-empty list of strings", param=name)
        return ["choice", json.dumps(v)]
    if not isinstance(v, str) or not v:
        raise ApiError(400, f"'{name}' must be a non-empty string", param=name)
    return [fmt, v]


# structured_outputs' keys: its constraints (-> GUIDED's formats), and its options: those that change nothing here
# (no fallback engine; whitespace is never free) and those served only at the value that changes nothing
_STRUCTURED = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}
_STRUCTURED_OPTIONS = {"disable_fallback": None, "disable_any_whitespace": None, "backend": None, "_backend": None,
                       "disable_additional_properties": False, "whitespace_pattern": "", "structural_tag": ""}


def _structured(so) -> list:
    """vLLM's ``structured_outputs`` object as the engine's grammar: exactly one of json, regex, choice, grammar,
    json_object; its options where they change nothing."""
    name = "structured_outputs"
    if not isinstance(so, dict):
        raise ApiError(400, f"'{name}' must be an object", param=name)
    for k, v in so.items():
        if k in _STRUCTURED or k == "json_object" or v is None:
            continue
        if k not in _STRUCTURED_OPTIONS:
            raise ApiError(400, f"'{name}.{k}' is not a structured output field", param=name)
        if _STRUCTURED_OPTIONS[k] is not None and v != _STRUCTURED_OPTIONS[k]:
            raise ApiError(400, f"'{name}.{k}' is not served", param=name)
    given = [k for k in _STRUCTURED if so.get(k) is not None] + (["json_object"] if so.get("json_object") else [])
    if len(given) != 1:
        raise ApiError(400, f"'{name}' must give exactly one of json, regex, choice, grammar, json_object; got "
                            f"{', '.join(given) or 'none'}", param=name)
    if given[0] == "json_object":
        return ["json_object", ""]
    return _guided(f"{name}.{given[0]}", _STRUCTURED[given[0]], so[given[0]])


def constraint_field(body: dict) -> str:
    """The field that set the body's output constraint (for an error that names it); response_format if none."""
    c = constraint(body)
    return "response_format" if c is None else c[0]


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
        name = js.get("name")          # required by OpenAI (its pattern and length)
        if not (isinstance(name, str) and 0 < len(name) <= 64 and all(c.isascii() and (c.isalnum() or c in "_-")
                                                                       for c in name)):
            raise ApiError(400, "'response_format.json_schema.name' is required: 1 to 64 of a-z, A-Z, 0-9, _ and -",
                           param="response_format.json_schema.name")
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


@dataclass(frozen=True)
class Stops:
    """How a choice's text ends: OpenAI's ``stop`` strings, and vLLM's ``include_stop_str_in_output`` (the stop
    string - or stop token's text - that ended it stays in the text), ``stop_token_ids`` (such a token's text is
    left out) and ``min_tokens`` (stop strings count only in text after that many tokens)."""
    strings: list
    include: bool = False
    ids: frozenset = frozenset()
    min_tokens: int = 0


def stop_rules(body: dict) -> Stops:
    """The body's Stops (stop_token_ids and min_tokens are checked with the sampling parameters: Server.sampling)."""
    inc = body.get("include_stop_str_in_output")
    if inc is not None and not isinstance(inc, bool):
        raise ApiError(400, "'include_stop_str_in_output' must be a boolean", param="include_stop_str_in_output")
    ids, mt = body.get("stop_token_ids"), body.get("min_tokens")
    return Stops(stop_strings(body), bool(inc), frozenset(t for t in ids if isinstance(t, int))
                 if isinstance(ids, list) else frozenset(), mt if isinstance(mt, int) and mt > 0 else 0)


def vllm_sampling(body: dict, max_tokens: int, vocab_size: int) -> dict:
    """vLLM's sampling fields this server serves, checked, as the engine's SamplingParams fields (those set):
    min_tokens, min_p, allowed_token_ids, prompt_logprobs (also what echo with logprobs needs of the prompt)."""
    out = {}
    mt = number(body, "min_tokens", 0, lo=0, integer=True)
    if mt > max_tokens:
        raise ApiError(400, f"'min_tokens' ({mt}) must be <= the max_tokens of the request ({max_tokens})",
                       param="min_tokens")
    mp = number(body, "min_p", 0.0, lo=0, hi=1)
    if mt:
        out["min_tokens"] = int(mt)
    if mp:
        out["min_p"] = float(mp)
    ids = body.get("allowed_token_ids")
    if ids is not None:
        if not (isinstance(ids, list) and ids and all(isinstance(t, int) and not isinstance(t, bool)
                                                      and 0 <= t < vocab_size for t in ids)):
            raise ApiError(400, f"'allowed_token_ids' must be a non-empty list of token ids in [0, {vocab_size})",
                           param="allowed_token_ids")
        out["allowed_token_ids"] = sorted(set(ids))
    k = _prompt_logprobs(body)
    if k is not None:
        out["prompt_logprobs"] = k
    return out


def _prompt_logprobs(body: dict) -> "int | None":
    """How many alternatives per prompt position the request needs: vLLM's ``prompt_logprobs``, and the completions
    API's ``echo`` with ``logprobs`` (the prompt's tokens come with theirs)."""
    k = body.get("prompt_logprobs")
    if k is not None:
        if k == -1 and not isinstance(k, bool):
            raise ApiError(400, f"'prompt_logprobs': -1 (every token of the vocabulary) is not served; at most "
                                f"{MAX_LOGPROBS}", param="prompt_logprobs")
        k = number(body, "prompt_logprobs", None, lo=0, hi=MAX_LOGPROBS, integer=True)
        if body.get("stream"):
            raise ApiError(400, "'prompt_logprobs' are not available with \"stream\": true", param="prompt_logprobs")
    echo = body.get("echo")
    if "messages" in body or echo is None:
        return k
    if not isinstance(echo, bool):
        raise ApiError(400, "'echo' must be a boolean", param="echo")
    lp = body.get("logprobs")
    if echo and isinstance(lp, int) and not isinstance(lp, bool):
        k = max(k or 0, lp)
    return k


@dataclass(frozen=True)
class PromptShown:
    """What a response shows of its prompt: the completions API's ``echo`` (the prompt's text before each choice's,
    its tokens' logprobs before the output's when logprobs are asked for) and vLLM's ``prompt_logprobs``."""
    echo: "str | None" = None
    logprobs: bool = False
    ids: tuple = ()               # the prompt's token ids, where either is shown


def prompt_shown(body: dict, prompt: list, tok, chat: bool) -> PromptShown:
    echo = None
    if not chat and body.get("echo"):
        p = body.get("prompt")
        p = p[0] if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)) else p
        echo = p if isinstance(p, str) else tok.decode(prompt)      # a prompt of token ids: their text
    shown = body.get("prompt_logprobs") is not None
    return PromptShown(echo, shown, tuple(prompt) if echo is not None or shown else ())


# -- fields this server knows but does not serve -----------------------------------------------------------------
def _off(*defaults):
    """A field harmless at these values (its default: the output is what it would be without it)."""
    return lambda v, body: any(v == d and type(v) is type(d) for d in defaults)


@dataclass(frozen=True)
class Known:
    """A request field of OpenAI's or vLLM's API that this server does not serve: ``refused`` (a 400 naming it,
    unless ``harmless(value, body)``: a value that changes nothing) or ignored on purpose (it never changes the
    output; accepted and logged once). ``only``: the endpoint it belongs to ("chat" / "completions"; None: both)."""
    refused: bool
    why: str
    harmless: Callable = _off()
    only: "str | None" = None


def _refuse(why: str, *defaults, only=None) -> Known:
    return Known(True, why, _off(*defaults), only)


def _ignore(why: str, only=None) -> Known:
    return Known(False, why, only=only)


_IGNORED_META = "metadata for OpenAI's platform; it does not change the output"
# The one table of known fields that are not served. What is served (sampling, structured output, tools, the
# chat template's fields, cache_salt, ...) is read where it is used; a field in neither (a client's extra_body
# of another server) is accepted as vLLM accepts it.
KNOWN = {
    "best_of": Known(True, "n choices are returned as they are, none is picked among more",
                     lambda v, body: v in (1, body.get("n") or 1) and not isinstance(v, bool)),
    "use_beam_search": _refuse("beam search is not served", False),
    "length_penalty": _refuse("it only weighs beam search, which is not served", 1, 1.0),
    "bad_words": _refuse("not served; use logit_bias of -100 on the words' tokens", []),
    "truncate_prompt_tokens": _refuse("prompts are not truncated; send the tokens to keep"),
    "logits_processors": _refuse("custom logits processors are not served", []),
    "vllm_xargs": _refuse("custom logits processors' arguments are not served", {}),
    "skip_special_tokens": _refuse("special tokens are always left out of the text", True),
    "spaces_between_special_tokens": _refuse("not served", True),
    "return_tokens_as_token_ids": _refuse("logprobs name tokens by their text", False),
    "return_token_ids": _refuse("responses carry no token ids", False),
    "prompt_embeds": _refuse("prompts are text or token ids"),
    "kv_transfer_params": _refuse("disaggregated prefill is not served"),
    "priority": _refuse("requests are scheduled first come, first served", 0),
    "guided_whitespace_pattern": _refuse("structured output writes no free whitespace"),
    "mm_processor_kwargs": _refuse("this server takes text only", {}),
    "suffix": _refuse("inserting text (fill in the middle) is not served", "", only="completions"),
    "add_special_tokens": _refuse("the prompt is encoded with the tokenizer's special tokens", True,
                                  only="completions"),
    "echo": _refuse("a chat reply does not repeat the last message; send continue_final_message to continue it",
                    False, only="chat"),
    "functions": _refuse("the deprecated functions API is not served; send tools", only="chat"),
    "function_call": _refuse("the deprecated functions API is not served; send tool_choice", only="chat"),
    "audio": _refuse("this server writes text only", only="chat"),
    "modalities": Known(True, "this server writes text only", lambda v, body: v == ["text"], "chat"),
    "reasoning_effort": _refuse("send it as chat_template_kwargs {\"reasoning_effort\": ...} for a template that "
                                "reads it", only="chat"),
    "verbosity": _refuse("not served", only="chat"),
    "web_search_options": _refuse("web search is not served", only="chat"),
    "documents": _refuse("not served; put the documents in the messages", only="chat"),
    "chat_template": _refuse("the checkpoint's chat template is used; custom templates are not served", only="chat"),
    "user": _ignore(_IGNORED_META),
    "metadata": _ignore(_IGNORED_META),
    "store": _ignore("responses are not stored"),
    "service_tier": _ignore("one tier serves every request"),
    "safety_identifier": _ignore(_IGNORED_META),
    "prompt_cache_key": _ignore("OpenAI's cache routing hint; the prefix cache matches by content (cache_salt "
                                "isolates clients)"),
    "prediction": _ignore("predicted outputs only speed OpenAI's up, they do not change the output", only="chat"),
    "guided_decoding_backend": _ignore("one grammar engine (llguidance) serves every constraint"),
    "request_id": _ignore("responses carry the server's own ids"),
}
_logged: set = set()       # ignored fields already logged
log = logging.getLogger("tiered_moe.serve")


def refuse_unsupported(body: dict, chat: bool = True) -> None:
    """400 for a known field (``KNOWN``) that would change the output and is not served; the fields ignored on
    purpose are logged once each."""
    for name, value in body.items():
        f = KNOWN.get(name)
        if f is None or value is None or (f.only is not None and f.only != ("chat" if chat else "completions")):
            continue
        if f.refused and not f.harmless(value, body):
            raise ApiError(400, f"'{name}' is not supported: {f.why}", param=name)
        if not f.refused and name not in _logged:
            _logged.add(name)
            log.info("request field %r accepted and ignored: %s (logged once)", name, f.why)
    if body.get("logit_bias") is not None and not isinstance(body.get("logit_bias"), dict):
        raise ApiError(400, "'logit_bias' must be an object of token id -> bias", param="logit_bias")


class Detokenizer:
    """Token ids -> text deltas, incrementally: each token decodes only a short window of the
    latest ids (from ``prefix``, a few tokens back, so merges across token boundaries come out
    right), never the whole output again. Holds back a trailing incomplete UTF-8 sequence (decoded
    as U+FFFD) and, with stop strings, the last few characters that could start one."""

    def __init__(self, tok, stops: "Stops | list", keep: frozenset = frozenset()) -> None:
        rules = stops if isinstance(stops, Stops) else Stops(list(stops))
        self.tok, self.stops, self.keep = tok, rules.strings, keep      # keep: special tokens that stay in the text
        self.rules = rules
        self.min_end = 0         # characters of text after min_tokens tokens: a stop string must end beyond them
        self.ids: list = []
        self.prefix = 0          # ids[prefix:read] decode to text already appended
        self.read = 0
        self.text = ""           # everything decoded so far
        self.sent = 0            # characters of text already returned
        self.hold = max((len(s) for s in self.stops), default=1) - 1

    def _decode_new(self) -> None:
        prev = self.tok.decode(self.ids[self.prefix:self.read], self.keep)
        cur = self.tok.decode(self.ids[self.prefix:], self.keep)
        if cur.endswith("\ufffd"):
            return                                   # an incomplete character: wait for more tokens
        self.text += cur[len(prev):]
        self.prefix, self.read = max(self.read - 4, 0), len(self.ids)

    def push(self, tid: int, reason: "str | None" = None) -> "tuple[str, bool]":
        """Returns (delta, hit a stop string). ``reason``: the engine's finish reason with this token (the text of
        a stop token id that ended the output is left out, as vLLM does, unless include_stop_str_in_output)."""
        r = self.rules
        if reason == "stop" and tid in r.ids and not r.include:
            return "", False
        self.ids.append(tid)
        self._decode_new()
        if len(self.ids) <= r.min_tokens:
            self.min_end = len(self.text)        # vLLM looks for stop strings only after min_tokens tokens
        else:
            for s in self.stops:
                i = self.text.find(s, max(0, self.sent - len(s), self.min_end - len(s) + 1))
                if i >= 0:
                    self.text = self.text[:i + len(s)] if r.include else self.text[:i]
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
