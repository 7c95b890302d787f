"""Constrained decoding (structured output): a request's grammar masks the tokens sampling may pick, so its
output is in the grammar's language - JSON that validates against a schema, any JSON object, a regular
expression, a Lark grammar. The engine is llguidance (Microsoft's; what vLLM and SGLang ship beside xgrammar):
it computes a token mask from the grammar's state per step (an Earley parser over a lexer with the tokenizer's
token trie; no precompiled per-grammar token tables, so a new schema costs ~ms, not seconds).

What a grammar may cost: the server admits a grammar before the engine sees it (runtime/serve/admission.py:
compiled in a worker process under a CPU-time and a size budget); here every grammar is compiled under
``limits()`` - llguidance's own fuel limits, which also bound each step's mask (``STEP_LEXER_FUEL`` and
``STEP_MAX_ITEMS``: about 14 ms of lexer and 2.5 ms of parser work at llguidance's stated speeds), so one
request's grammar adds a bounded time to every step it is in, however many tools it offers. A grammar the
engine has compiled is kept (``COMPILED``, by its text) and copied for the next request that sends it.

One registry of the formats a request may name (``FORMATS``): adding one is one entry. A grammar that cannot be
served raises ``GrammarError`` (a ValueError: the request's error, a 400), its message short and without the
grammar's text."""
from __future__ import annotations

import json
from collections import OrderedDict

STEP_LEXER_FUEL = 200_000      # llguidance's lexer fuel per mask (~14k per ms: ~14 ms; its default)
STEP_MAX_ITEMS = 50_000        # Earley items per mask (~20k per ms; llguidance's default)
MAX_GRAMMAR_SIZE = 500_000     # symbols in the compiled grammar (llguidance's default)
# Earley items in one row (llguidance's default 2,000): a tool of 1,000 optional parameters starts with ~4,000
# (any may come first); 5,000 serves it, each step's parser work still capped by STEP_MAX_ITEMS
MAX_ITEMS_IN_ROW = 5_000
WALK = 8                       # tokens of a trial output a grammar must take when compiled (its first limits)
MAX_ERROR_CHARS = 200          # of a grammar engine's message in an error: it may quote the grammar
COMPILED = 32                  # compiled grammars a GrammarTokenizer keeps (each copied per request)


class GrammarError(ValueError):
    """A grammar that cannot be served (does not compile, exceeds a limit, fails while generating): the
    request's error, never the engine's."""


def short(message) -> str:
    """A grammar engine's message, first line only and capped: llguidance's may quote the grammar text (internal:
    tool grammars are built here) at length."""
    text = str(message).strip().splitlines()[0] if str(message).strip() else "invalid grammar"
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS - 3] + "..."


def limits():
    """llguidance's resource limits for every grammar the engine and the admission workers compile: the step
    fuel bounds each mask; errors do not echo the grammar (``verbose_errors``)."""
    from llguidance import LLParserLimits
    return LLParserLimits(step_lexer_fuel=STEP_LEXER_FUEL, step_max_items=STEP_MAX_ITEMS,
                          max_grammar_size=MAX_GRAMMAR_SIZE, max_items_in_row=MAX_ITEMS_IN_ROW, verbose_errors=False)


# format -> what llguidance compiles it from (its grammar_from kinds)
def json_schema_text(schema: dict) -> str:
    """The schema with llguidance's JSON options: no free whitespace between tokens (a model left free to put
    newlines there can loop on them until max_tokens, as the greedy test model does); ", " and ": " separate."""
    if not isinstance(schema, dict):
        raise ValueError("a JSON schema must be an object")
    return json.dumps({**schema, "x-guidance": {"whitespace_flexible": False, "item_separator": ", ",
                                                "key_separator": ": "}})


def _schema(text: str) -> str:
    try:
        return json_schema_text(json.loads(text))
    except ValueError as e:
        raise ValueError(f"json_schema: {e}") from None


FORMATS = {
    "json_object": lambda text: ("json_schema", json_schema_text({"type": "object"})),
    "json_schema": lambda text: ("json_schema", _schema(text)),
    "regex": lambda text: ("regex", text),
    "lark": lambda text: ("lark", text),
    # vLLM's guided_choice / guided_grammar, as its llguidance backend compiles them: a JSON list of strings (the
    # output is one of them), a Lark or GBNF grammar
    "choice": lambda text: ("choice", text),
    "grammar": lambda text: ("grammar", text),
}


def compile_grammar(tok, fmt: str, text: str):
    """``text`` in format ``fmt`` compiled for llguidance's tokenizer ``tok`` under ``limits()``, with its first
    mask computed (a grammar that admits no output, such as a required recursive ``$ref``, fails there): a fresh
    LLMatcher. Raises GrammarError."""
    from llguidance import LLMatcher, grammar_from
    if fmt not in FORMATS:
        raise GrammarError(f"unknown grammar format {fmt!r}; one of {', '.join(FORMATS)}")
    try:
        kind, src = FORMATS[fmt](text)
        grammar = grammar_from(kind, src)
    except Exception as e:  # noqa: BLE001 - the library raises several types for a bad grammar
        raise GrammarError(f"{fmt}: {short(e)}") from None
    try:
        m = LLMatcher(tok, grammar, log_level=0, limits=limits())
        empty = not m.is_error() and not any(m.compute_bitmask())
    except Exception as e:  # noqa: BLE001 - the library raises several types for a bad grammar
        raise GrammarError(f"{fmt}: {short(e)}") from None
    if m.is_error():
        raise GrammarError(f"{fmt}: {short(m.get_error())}")
    if empty:
        raise GrammarError(f"{fmt}: the grammar allows no output (a required property that refers to itself has no "
                           f"finite value)")
    err = trial(m.deep_copy())
    if err:
        raise GrammarError(f"{fmt}: the grammar fails on the first tokens of an output: {short(err)}")
    return m


def trial(m, steps: int = WALK) -> str:
    """A trial output of ``steps`` tokens, each one the grammar allows (picked by a seeded generator): the grammar's
    error on the way ("" when none). Catches what fails at once when generating - a limit of llguidance's that the
    first tokens hit (a row of too many Earley items) - at compile time, a 400, not in the engine's steps."""
    import random
    rng = random.Random(0)
    for _ in range(steps):
        if m.is_stopped():
            return ""
        mask = m.compute_bitmask()
        words = [i for i, b in enumerate(mask) if b]
        if m.is_error() or not words:
            return m.get_error() if m.is_error() else ""
        i = rng.choice(words)
        tok = 8 * i + rng.choice([k for k in range(8) if mask[i] >> k & 1])
        if not m.consume_token(tok):
            return m.get_error()
    return ""


class GrammarTokenizer:
    """The model's tokenizer as llguidance sees it (built once per engine: it indexes every token), and the
    grammars compiled for it lately (``COMPILED`` of them, by format and text)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: "list | tuple") -> None:
        from llguidance import LLTokenizer
        self.vocab_size = vocab_size
        # A model without an EOS token: llguidance still needs one to mean "the grammar is done"; token 0 stands
        # in and is never sampled (the request ends when only it would be allowed: Matcher.done).
        self.eos = list(eos_ids) or [0]
        self.has_eos = bool(eos_ids)
        try:
            self.tok = LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=self.eos)
        except Exception as e:  # noqa: BLE001 - a request's error (ValueError), never the engine's
            raise ValueError(f"structured output: the grammar engine cannot read {tokenizer_json}: {e}") from None
        self._compiled: OrderedDict = OrderedDict()

    def compiled(self, fmt: str, text: str):
        """A fresh LLMatcher of the grammar: a copy of the one compiled before for the same text (a client's
        tools, sent with every turn, compile once), else compiled now."""
        key = (fmt, text)
        m = self._compiled.get(key)
        if m is None:
            m = self._compiled[key] = compile_grammar(self.tok, fmt, text)
            if len(self._compiled) > COMPILED:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(key)
        return m.deep_copy()

    def matcher(self, fmt: str, text: str) -> "Matcher":
        return Matcher(self, fmt, text)


class Matcher:
    """One request's grammar state: the mask of the next token, and the tokens it has taken."""

    def __init__(self, gt: GrammarTokenizer, fmt: str, text: str) -> None:
        self.gt = gt
        self.m = gt.compiled(fmt, text)
        self._stuck = False

    @property
    def failed(self) -> bool:
        """The grammar has failed (a limit hit, a token refused, no token allowed): the request's error."""
        return self._stuck or self.m.is_error()

    def allowed(self):
        """The tokens the grammar allows next: bool [vocab]."""
        import torch
        words = torch.frombuffer(bytearray(self.m.compute_bitmask()), dtype=torch.int32)   # words: [ceil(vocab/32)]
        if self.m.is_error():
            raise GrammarError(f"the grammar cannot continue: {short(self.m.get_error())}")
        if not bool(words.any()):
            self._stuck = True
            raise GrammarError("the grammar allows no token here (it has no finite output)")
        bits = (words[:, None] >> torch.arange(32, dtype=torch.int32)) & 1
        return bits.reshape(-1)[:self.gt.vocab_size].bool()

    def mask(self, logits):
        """logits with every token the grammar forbids at -inf (a new tensor). logits: [vocab]."""
        ok = self.allowed().to(logits.device)
        return logits.masked_fill(~ok[:logits.shape[-1]], float("-inf"))

    def take(self, token: int) -> None:
        if not self.m.consume_token(token):
            raise GrammarError(f"the grammar refused token {token}: {short(self.m.get_error())}")

    def done(self) -> bool:
        """The grammar is complete: stopped, or accepting with nothing but EOS allowed next."""
        if self.m.is_stopped():
            return True
        if not self.m.is_accepting():
            return False
        ok = self.allowed()
        ok[self.gt.eos] = False
        return not bool(ok.any())


class GrammarBuilds:
    """Requests whose grammars compile on a thread of their own (llguidance drops the GIL while it compiles), so the
    engine loop steps every other request meanwhile: a grammar's compile delays nobody else's tokens (beyond sharing
    the CPU). One thread: compiles run one at a time, each bounded by what admission measured."""

    def __init__(self) -> None:
        self._pool = None
        self.pending: list = []          # [(request, future)] in submission order

    def __len__(self) -> int:
        return len(self.pending)

    def submit(self, r, gt: GrammarTokenizer) -> None:
        """Compile ``r``'s grammar (``r.matcher``) or trigger grammar (``r.armed``) for ``gt``."""
        from concurrent.futures import ThreadPoolExecutor
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="tiered-moe-grammar", initializer=_lower_priority)
        self.pending.append((r, self._pool.submit(build, r, gt)))

    def finished(self, wait: float = 0.0) -> list:
        """[(request, its GrammarError or None)] of the compiles done, in submission order (waiting up to ``wait``
        seconds for one when none is)."""
        if wait and self.pending and not any(f.done() for _, f in self.pending):
            from concurrent.futures import FIRST_COMPLETED
            from concurrent.futures import wait as wait_for
            wait_for([f for _, f in self.pending], timeout=wait, return_when=FIRST_COMPLETED)
        done = [(r, f) for r, f in self.pending if f.done()]
        self.pending = [(r, f) for r, f in self.pending if not f.done()]
        return [(r, f.exception()) for r, f in done]

    def remove(self, rid: int):
        """Drop request ``rid`` (aborted while its grammar compiles); the request, or None."""
        for r, f in self.pending:
            if r.id == rid:
                self.pending.remove((r, f))
                return r
        return None


def _lower_priority() -> None:
    """The compiling thread yields the CPU to the engine loop (Linux: a thread's nice value is its own)."""
    import os
    import threading
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass


def build(r, gt: GrammarTokenizer) -> None:
    """A request's grammar state, compiled: ``r.matcher`` from its grammar, ``r.armed`` from its trigger's."""
    p = r.params
    if p.grammar is not None:
        r.matcher = gt.matcher(*p.grammar)
    if p.trigger is not None:
        try:
            r.armed = gt.matcher(*p.trigger[1:])
        except ValueError as e:
            raise GrammarError(f"the grammar of the tools' calls (after the trigger token) does not compile: {e}") \
                from None
