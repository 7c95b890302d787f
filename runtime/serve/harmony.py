"""gpt-oss's output in OpenAI's harmony format: messages on channels, each ``<|channel|>NAME[ header]<|message|>
BODY`` ended by ``<|end|>``, ``<|return|>`` (the last, final one) or ``<|call|>`` (a tool call), the next one opened
by ``<|start|>assistant[ header]``. The analysis channel is the model's reasoning (``reasoning_content``, as vLLM
returns it), the final channel the reply (``content``), a commentary message addressed ``to=functions.NAME`` a tool
call whose body is its JSON arguments; a commentary message to nobody is a preamble, shown as content.

The markers are special tokens of gpt-oss's tokenizer: the server keeps them in the text of a harmony model's chat
replies (``tool_parsers.HARMONY_TOKENS``) so this can split it. Text without channels is content as it is."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

_MARKER = re.compile(r"(<\|(?:start|end|message|channel|constrain|return|call)\|>)")
_RECIPIENT = re.compile(r"to=functions\.([\w.-]+)")


@dataclass
class Split:
    reasoning: str = ""
    content: str = ""
    calls: list = field(default_factory=list)       # [(name, arguments text)] of messages addressed to a function


def split(text: str) -> Split:
    """The channels of a (possibly partial) harmony output; a trailing marker not yet whole is left out. Text before
    any marker is content (a reply that opened no channel); a message's header (role, channel, recipient,
    ``<|constrain|>`` type) is never shown; its body goes where its header says."""
    cut = text.rfind("<|")
    if cut >= 0 and text.find("|>", cut) < 0:
        text = text[:cut]                      # "<|chan": a marker on its way (where markers are not single tokens)
    elif text.endswith("<"):
        text = text[:-1]
    out = Split()
    mode, header = "body", ""                  # body: text goes to ``target``; header: gathered; between: dropped
    target = "content"
    for part in _MARKER.split(text):
        if part == "<|start|>":
            mode, header = "header", ""
        elif part in ("<|channel|>", "<|constrain|>"):
            mode, header = "header", header + " " + part
        elif part == "<|message|>":
            to = _RECIPIENT.search(header)
            channel = re.search(r"<\|channel\|>\s*(\w+)", header)
            if to is not None:
                out.calls.append([to.group(1), ""])
                target = "call"
            else:
                target = "reasoning" if channel is not None and channel.group(1) == "analysis" else "content"
            mode = "body"
        elif part in ("<|end|>", "<|return|>", "<|call|>"):
            mode = "between"
        elif mode == "header":
            header += part
        elif mode == "body":
            if target == "call":
                out.calls[-1][1] += part
            elif target == "reasoning":
                out.reasoning += part
            else:
                out.content += part
    out.calls = [(name, args.strip()) for name, args in out.calls]
    return out
