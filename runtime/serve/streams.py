"""Server-sent events (``"stream": true``): a request's choices merged into one stream of OpenAI's chunks - plain
text deltas; a tools choice's content before its format's opening marker, then each call whole (id, name,
arguments) as soon as its arguments are complete (so a reply cut by max_tokens streams the calls it returns); a
gpt-oss choice's channels as reasoning_content and content."""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .harmony import split
from .params import ApiError
from .responses import Choices
from .tool_parsers import new_calls
from .transport import ClientGone

if TYPE_CHECKING:
    from .api import Server


@dataclass
class Sent:
    """What a streamed tools or harmony choice has sent so far (its text is held back until it is known to be
    content, reasoning or a call's arguments)."""
    content: int = 0                                  # characters of its content
    reasoning: int = 0                                # characters of its reasoning (harmony)
    lps: list = field(default_factory=list)           # log-probability entries not yet sent (with the next chunk)
    calls: list = field(default_factory=list)         # per call [id, name, arguments sent]


class Stream:
    """Server-sent events as a raw ASGI response: every write has a deadline (a client that stops
    reading is cut and its request aborted), and a disconnect stops the request at once."""

    def __init__(self, srv: "Server", ch: Choices, include_usage: bool) -> None:
        self.srv, self.ch, self.include_usage = srv, ch, include_usage
        self.obj = "chat.completion.chunk" if ch.chat else "text_completion"
        self.created = int(time.time())
        self._send = self._watch = None

    # -- what a tools or harmony choice has to send --------------------------------------------------------------
    def open_content(self, text: str) -> str:
        """What of a tools choice's text is content for sure: the text before its format's opening marker (less a
        tail that may be the marker's start); nothing for required / named calls or a format without one."""
        opener = self.srv.tool_format.trigger if self.ch.tools.choice == "auto" else None
        if opener is None:
            return ""
        i = text.find(opener)
        if i >= 0:
            return text[:i]
        for n in range(min(len(opener) - 1, len(text)), 0, -1):
            if opener.startswith(text[-n:]):
                return text[:-n]
        return text

    def progress(self, index: int, sent: Sent) -> "tuple[str, dict]":
        """A streamed tools choice's news: (content not yet sent, {"tool_calls": deltas} or {}), from the text its
        detokenizer has released (stop strings held back)."""
        t, ev = self.ch.tools, self.ch.events(index)
        fmt = self.srv.tool_format
        text = self.ch.parts(ev.detok.text[:ev.detok.sent])[1]     # the calls follow the thinking
        safe = self.open_content(text)
        delta = safe[sent.content:]
        sent.content = max(sent.content, len(safe))
        out = new_calls(t, fmt, text, sent.calls)      # each call whole once complete: a cut leaves none partial
        return delta, ({"tool_calls": out} if out else {})

    def harmony_progress(self, index: int, sent: Sent) -> "tuple[str, dict]":
        """A streamed harmony choice's news: (content, {"reasoning_content": ...} or {}) not yet sent, from the
        released text."""
        ev = self.ch.events(index)
        h = split(ev.detok.text[:ev.detok.sent])
        r, c = h.reasoning[sent.reasoning:], h.content[sent.content:]
        sent.reasoning, sent.content = max(sent.reasoning, len(h.reasoning)), max(sent.content, len(h.content))
        return c, ({"reasoning_content": r} if r else {})

    def think_progress(self, index: int, sent: Sent) -> "tuple[str, dict]":
        """A streamed choice's news with its thinking split off (``progress`` for a tools choice, else its content),
        with {"reasoning_content": ...} not yet sent."""
        ev = self.ch.events(index)
        reasoning, content = self.ch.parts(ev.detok.text[:ev.detok.sent])
        r = reasoning[sent.reasoning:]
        sent.reasoning = max(sent.reasoning, len(reasoning))
        if self.ch.tools is not None:
            text, extra = self.progress(index, sent)
        else:
            text, extra = content[sent.content:], {}
            sent.content = max(sent.content, len(content))
        return text, {**({"reasoning_content": r} if r else {}), **extra}

    def tool_chunk(self, index: int, finish: str, sent: Sent) -> dict:
        """A tools choice's last chunk: the content not yet sent, what its calls' streamed deltas left out (the
        calls of a format that does not stream them, whole), with every log-probability held back."""
        ev = self.ch.events(index)
        content, calls, finish = self.ch.message(ev.detok.text, finish)
        reasoning, text = self.ch.parts(ev.detok.text, final=True)
        # required / named calls: the reply's content (null, or the text a stop string cut), never partial JSON
        rest = (content or "")[sent.content:] if calls or self.ch.tools.choice != "auto" else text[sent.content:]
        out = self.chunk(index, rest, finish, sent.lps)
        if calls:
            deltas, done = [], sent.calls
            for i, c in enumerate(calls):
                fn = c["function"]
                if i < len(done) and done[i][1] == fn["name"] and fn["arguments"].startswith(done[i][2]):
                    if len(fn["arguments"]) > len(done[i][2]):
                        deltas.append({"index": i, "function": {"arguments": fn["arguments"][len(done[i][2]):]}})
                else:        # not streamed (or, never expected, streamed otherwise): the call whole, at a new index
                    deltas.append({"index": max(i, len(done)), **c})
                    done.append([c["id"], fn["name"], fn["arguments"]])
            out["choices"][0]["delta"] = {**({"content": rest} if rest.strip() else {}),
                                          **({"tool_calls": deltas} if deltas else {})}
        if reasoning[sent.reasoning:]:
            out["choices"][0]["delta"]["reasoning_content"] = reasoning[sent.reasoning:]
        return out

    def think_chunk(self, index: int, finish: str, sent: Sent) -> dict:
        """A thinking choice's last chunk (no tools): its reasoning and content not yet sent."""
        reasoning, content = self.ch.parts(self.ch.events(index).detok.text, final=True)
        out = self.chunk(index, content[sent.content:], finish, sent.lps)
        if reasoning[sent.reasoning:]:
            out["choices"][0]["delta"]["reasoning_content"] = reasoning[sent.reasoning:]
        return out

    def harmony_chunk(self, index: int, finish: str, sent: Sent) -> dict:
        """A harmony choice's last chunk: the reasoning and content not yet sent, its tool calls whole."""
        ev = self.ch.events(index)
        content, calls, finish = self.ch.message(ev.detok.text, finish)
        out = self.chunk(index, (content or "")[sent.content:], finish, sent.lps)
        d = out["choices"][0]["delta"]
        rest = split(ev.detok.text).reasoning[sent.reasoning:]
        if rest:
            d["reasoning_content"] = rest
        if calls:
            d["tool_calls"] = [{"index": i, **c} for i, c in enumerate(calls)]
        return out

    # -- the wire ------------------------------------------------------------------------------------------------
    async def event(self, data) -> None:
        await self.write(b"data: " + (data if isinstance(data, bytes) else json.dumps(data).encode()) + b"\n\n")

    async def write(self, payload: bytes) -> None:
        """One event's bytes, within the write deadline."""
        if self._watch.done():
            raise ClientGone()
        try:
            await asyncio.wait_for(self._send({"type": "http.response.body", "body": payload, "more_body": True}),
                                   self.srv.timeout)
        except asyncio.TimeoutError:
            raise ClientGone() from None

    def chunk(self, index, delta, finish, lps, first=False) -> dict:
        ch = self.ch
        base = {"id": ch.rid, "object": self.obj, "created": self.created, "model": self.srv.model_name,
                "system_fingerprint": self.srv.fingerprint}
        lp = ch.lp[index].format(lps) if ch.lp[index] is not None and lps else None
        if ch.chat:
            # required / named calls: content null, as in the reply (and OpenAI's stream of a forced call)
            calls_only = ch.tools is not None and ch.tools.choice != "auto" and not delta
            d = {"role": "assistant", "content": None if calls_only else delta} if first else \
                ({"content": delta} if (delta or not finish) and not calls_only else {})
            c = {"index": index, "delta": d, "logprobs": lp, "finish_reason": finish}
        else:
            c = {"index": index, "text": delta, "logprobs": lp, "finish_reason": finish}
        out = {**base, "choices": [c]}
        if self.include_usage:
            out["usage"] = None
        return out

    async def held_news(self, index: int, finish, lps: list, sent: Sent) -> None:
        """A tools, harmony or thinking choice's news. gpt-oss: the analysis channel streams as reasoning_content, the
        final one as content; a <think> block streams as reasoning_content, what follows it as below. Tools: the content before the format's opening marker streams, then each call: its id and
        name, then its arguments as they are written (OpenAI's deltas); a format without spans (and harmony) sends
        its calls whole at the end."""
        harmony = self.ch.harmony
        sent.lps += lps
        if finish:
            last = self.harmony_chunk if harmony else self.tool_chunk if self.ch.tools is not None else \
                self.think_chunk
            await self.event(last(index, finish, sent))
            return
        text, extra = self.harmony_progress(index, sent) if harmony else self.think_progress(index, sent)
        if text or extra:
            c = self.chunk(index, text, None, sent.lps)
            c["choices"][0]["delta"].update(extra)
            await self.event(c)
            sent.lps = []

    async def choices(self) -> None:
        """Every choice's chunks as they come; an error ends the stream with an error event."""
        ch = self.ch
        if ch.chat:
            for ev in ch.evs:
                await self.event(self.chunk(ev.index, "", None, [], first=True))
        sent = {ev.index: Sent() for ev in ch.evs}
        held = ch.harmony or (ch.tools is not None and ch.chat) or ch.reasoner is not None
        try:
            async for index, delta, finish, lps in ch.merged():
                if held:
                    await self.held_news(index, finish, lps, sent[index])
                elif delta or finish:
                    await self.event(self.chunk(index, delta, finish, lps))
        except ApiError as e:
            await self.event(e.body())   # headers are gone: the error travels as an event, as OpenAI does

    async def __call__(self, scope, receive, send) -> None:
        ch = self.ch
        self.created = int(time.time())
        self._send = send
        # The disconnect watch the events loop checks while it waits (as for a non-streaming request).
        self._watch = ch.watch(receive)
        try:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
                                    (b"server", b"tiered-moe")]})
            await self.choices()
            if self.include_usage:
                await self.event({"id": ch.rid, "object": self.obj, "created": self.created,
                                  "model": self.srv.model_name, "system_fingerprint": self.srv.fingerprint,
                                  "choices": [], "usage": ch.usage()})
            await self.event(b"[DONE]")
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except (ClientGone, OSError):
            pass
        finally:
            self._watch.cancel()
            ch.close()
