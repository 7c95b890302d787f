"""gpt-oss harmony: ``<|channel|>commentary to=functions.name ... <|message|>{json}<|call|>`` (runtime/serve/
harmony.py splits the channels). Parsed, not constrained: a call opens with a channel header whose tokens also
open the analysis and final messages, so there is no trigger; its calls are sent whole when the output ends."""
from __future__ import annotations

from ..harmony import split
from .base import ToolFormat, call, json_obj

# harmony's markers: kept in the text of a harmony model's chat replies, so split() can read them
HARMONY_TOKENS = ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|call|>", "<|return|>")


def parse(text: str, functions: list):
    h = split(text)
    calls = [call(name, args) for name, args in h.calls if json_obj(args) is not None]
    return h.content, calls


FORMAT = ToolFormat("harmony", "<|channel|>", parse, HARMONY_TOKENS)
