"""Reasoning parsers (vLLM's ``--reasoning-parser``): a reasoning model's thinking split from its reply, returned as
``reasoning_content`` (chat messages and stream deltas) and as reasoning items (the Responses API), so the content -
and the tool calls and structured output parsed from it - is what follows the thinking.

One registry of the families' formats (``FORMATS``), picked by what the chat template writes (as the tool-call
formats are) or named by the server's ``reasoning_parser`` option:

* ``qwen3`` (Qwen3, QwQ, GLM-4.5) and ``deepseek_r1``: the thinking is a ``<think> ... </think>`` block at the start
  of the reply. The template may open it (DeepSeek-R1-0528 and Qwen3-Thinking end the prompt with ``<think>``: the
  reply starts inside it), close it (Qwen3 with ``chat_template_kwargs: {"enable_thinking": false}`` writes an empty
  block: no thinking) or leave it to the model (Qwen3 writes ``<think>`` itself). A block never closed (cut by
  max_tokens) is all reasoning. Newlines around the thinking and before the reply are dropped, as Qwen3's and
  DeepSeek-R1's templates drop them when they read a past turn back.
* ``gpt_oss``: harmony's analysis channel (runtime/serve/harmony.py splits a gpt-oss reply by its channels).

Every split is of a text that may still grow: its reasoning and content only grow with it (a marker on its way is
held back), so a stream's deltas are the differences between two splits and add up to the whole reply's."""
from __future__ import annotations

from dataclasses import dataclass

from .tool_parsers.base import held


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    markers: tuple          # texts the chat template writes, all of them: how the family is recognised
    start: str = ""         # the thinking block's markers ("" for harmony, which has channels)
    end: str = ""


# The first whose markers the template has is the family's (DeepSeek-R1's before Qwen3's: both write </think>).
FORMATS = [ReasoningFormat("gpt_oss", ("<|channel|>", "analysis")),
           ReasoningFormat("deepseek_r1", ("</think>", "<｜Assistant｜>"), "<think>", "</think>"),
           ReasoningFormat("qwen3", ("</think>",), "<think>", "</think>")]
NAMES = ("auto", "none", *(f.name for f in FORMATS))


def reasoning_format(template_text: "str | None", name: str = "auto") -> "ReasoningFormat | None":
    """The format ``name`` names (the server option), or for ``auto`` the one whose markers the chat template
    writes; None: the replies are not split (``none``, or a template without thinking)."""
    if name not in NAMES:
        raise ValueError(f"unknown reasoning parser {name!r}: one of {', '.join(NAMES)}")
    if name == "none":
        return None
    if name != "auto":
        return next(f for f in FORMATS if f.name == name)
    return next((f for f in FORMATS if template_text and all(m in template_text for m in f.markers)), None)


def think_state(fmt: ReasoningFormat, prompt_text: str) -> "bool | None":
    """Where the prompt leaves the thinking block: True - opened (the reply starts inside it), False - closed right
    at its end (thinking switched off), None - not there (the model may open one)."""
    i, j = prompt_text.rfind(fmt.start), prompt_text.rfind(fmt.end)
    if i > j:
        return True
    if j >= 0 and not prompt_text[j + len(fmt.end):].strip():
        return False
    return None


@dataclass
class Reasoner:
    """One reply's thinking block: its format and where the prompt left it (``think_state``)."""
    fmt: ReasoningFormat
    state: "bool | None"

    def split(self, text: str, final: bool = False) -> "tuple[str, str]":
        """(reasoning, content) of a reply so far; ``final``: the whole reply (nothing more is coming, so nothing is
        held back as a marker on its way)."""
        start, end = self.fmt.start, self.fmt.end
        if self.state is False:
            return "", text
        body = text
        if self.state is None:
            head = text.lstrip()
            if head.startswith(start):
                body = head[len(start):]
            elif start.startswith(head) and not final:
                return "", ""                  # nothing yet but spaces, or "<thi": which one it is is not known
            else:
                return "", text                # no thinking: the reply is all content
        i = body.find(end)
        if i < 0:
            return (body if final else body[:len(body) - held(body, end)]).strip("\n"), ""
        return body[:i].strip("\n"), body[i + len(end):].lstrip("\n")

    def keep(self, tok) -> frozenset:
        """Ids of its markers where they are single tokens (kept in the text, should a tokenizer mark them special)."""
        return frozenset(i for i in (tok.token_id(self.fmt.start), tok.token_id(self.fmt.end)) if i is not None)


def reasoner(fmt: "ReasoningFormat | None", tail: str) -> "Reasoner | None":
    """A chat reply's reasoner under the server's format, ``tail`` the end of its prompt it follows on from
    (chat.reply_tail); None for harmony (its channels are split apart) or none."""
    if fmt is None or not fmt.start:
        return None
    return Reasoner(fmt, think_state(fmt, tail))


def reasoning_tokens(ids: list, decode, reasoning_of) -> int:
    """How many of a reply's tokens ``ids`` it took to write its reasoning (the Responses API's reasoning_tokens):
    the shortest prefix whose text (``decode``) has all of it (``reasoning_of``: a split's reasoning, which only
    grows with the text); 0 without reasoning."""
    whole = len(reasoning_of(decode(ids)))
    if not whole:
        return 0
    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(reasoning_of(decode(ids[:mid]))) >= whole:
            hi = mid
        else:
            lo = mid + 1
    return lo
