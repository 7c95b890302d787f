"""Constrained decoding (structured output): a request's grammar masks the tokens sampling may pick, so its
output is in the grammar's language - JSON that validates against a schema, any JSON object, a regular
expression, a Lark grammar. The engine is llguidance (Microsoft's; what vLLM and SGLang ship beside xgrammar):
it computes a token mask from the grammar's state per step (an Earley parser over a lexer with the tokenizer's
token trie; no precompiled per-grammar token tables, so a new schema costs ~ms, not seconds).

One registry of the formats a request may name (``FORMATS``): adding one is one entry."""
from __future__ import annotations

import json

import torch

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
}


class GrammarTokenizer:
    """The model's tokenizer as llguidance sees it (built once per engine: it indexes every token)."""

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

    def matcher(self, fmt: str, text: str) -> "Matcher":
        return Matcher(self, fmt, text)


class Matcher:
    """One request's grammar state: the mask of the next token, and the tokens it has taken."""

    def __init__(self, gt: GrammarTokenizer, fmt: str, text: str) -> None:
        from llguidance import LLMatcher, grammar_from
        if fmt not in FORMATS:
            raise ValueError(f"unknown grammar format {fmt!r}; one of {', '.join(FORMATS)}")
        kind, src = FORMATS[fmt](text)
        try:
            grammar = grammar_from(kind, src)
        except Exception as e:  # noqa: BLE001 - the library raises several types for a bad grammar
            raise ValueError(f"{fmt}: {e}") from None
        self.gt = gt
        try:
            self.m = LLMatcher(gt.tok, grammar)
        except Exception as e:  # noqa: BLE001 - the library raises several types for a bad grammar
            raise ValueError(f"{fmt}: {e}") from None
        if self.m.is_error():
            raise ValueError(f"{fmt}: {self.m.get_error()}")

    def allowed(self) -> torch.Tensor:
        """The tokens the grammar allows next: bool [vocab]."""
        words = torch.frombuffer(bytearray(self.m.compute_bitmask()), dtype=torch.int32)   # words: [ceil(vocab/32)]
        bits = (words[:, None] >> torch.arange(32, dtype=torch.int32)) & 1
        return bits.reshape(-1)[:self.gt.vocab_size].bool()

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """logits with every token the grammar forbids at -inf (a new tensor). logits: [vocab]."""
        ok = self.allowed().to(logits.device)
        return logits.masked_fill(~ok[:logits.shape[-1]], float("-inf"))

    def take(self, token: int) -> None:
        if not self.m.consume_token(token):
            raise ValueError(f"the grammar refused token {token}: {self.m.get_error()}")

    def done(self) -> bool:
        """The grammar is complete: stopped, or accepting with nothing but EOS allowed next."""
        if self.m.is_stopped():
            return True
        if not self.m.is_accepting():
            return False
        ok = self.allowed()
        ok[self.gt.eos] = False
        return not bool(ok.any())
