"""A request's results as OpenAI's objects: each choice's tokens as they arrive (``Events``: text deltas,
log-probabilities, metrics, stop strings, the engine's errors), the logprobs objects, and a request's ``n``
choices together (``Choices``: the chat message with its tool calls or harmony channels, usage, the
non-streaming response). Streams are built on these in streams.py."""
from __future__ import annotations

import asyncio
import json
import time
from typing import TYPE_CHECKING

from .harmony import split
from .params import ApiError, Detokenizer, PromptShown
from .tool_parsers import constrained_calls, cut_reply, parse_auto
from .transport import ClientGone, disconnect

if TYPE_CHECKING:
    from .api import Server
    from .reasoning import Reasoner
    from .tool_parsers import Tools


def json_response(status: int, body, headers=None):
    from starlette.responses import Response
    return Response(json.dumps(body), status_code=status, media_type="application/json",
                    headers={"server": "tiered-moe", **(headers or {})})


class Events:
    """One choice's tokens as they arrive: text deltas, their tokens' log-probabilities, metrics, stop strings,
    errors."""

    def __init__(self, srv: "Server", q: asyncio.Queue, detok: Detokenizer, t0: float, rid: str, index: int = 0) -> None:
        self.srv, self.q, self.detok, self.t0, self.rid, self.index = srv, q, detok, t0, rid, index
        self.n, self.first, self.last = 0, None, None
        self.finished, self.open = False, True
        self.failed = False        # the engine failed the request (or died): counted as an error, not an abort
        self.closed = False
        self.watch = None          # a task that ends when the client disconnects
        self.logprobs: list = []   # every token's [id, logprob, [[id, logprob], ...]] (when asked for)
        self.pending = 0           # of those, not yet sent with a delta
        self.cached = 0            # prompt tokens the prefix cache held (the engine says with the first token)
        # prompt_logprobs (or echo with logprobs): per prompt position None or [logprob, rank, [[id, logprob], ...]]
        self.prompt_logprobs: "list | None" = None

    async def __aiter__(self):
        """Yields (delta, finish_reason or None, the log-probabilities of the tokens since the last delta)."""
        a = self.srv
        while True:
            try:
                kind, payload, when = await asyncio.wait_for(self.q.get(), 0.25)
            except asyncio.TimeoutError:
                if self.watch is not None and self.watch.done():
                    raise ClientGone() from None
                continue
            if kind != "token":
                self.fail(kind, payload)
            tok, reason, lp, cached, plp = payload
            if cached is not None:
                self.cached = cached
            if plp is not None:
                self.prompt_logprobs = plp
            self.count(when, tok, lp)
            delta, hit_stop = self.detok.push(tok, reason)
            if hit_stop:
                reason = "stop"
            if reason is not None:
                a.failing = 0
                delta += self.detok.finish()
                a.metrics.requests.labels(reason).inc()
                self.finished = True
                a.metrics.e2e.observe(when - self.t0)
                a.engine.release(self.rid)
                self.open = hit_stop   # the engine still runs a request cut by a stop string: abort it
                yield delta, reason, self._take()
                return
            if delta:
                yield delta, None, self._take()

    def fail(self, kind: str, payload) -> None:
        """Raises the error of an engine event that is not a token (``kind``: rejected, shutdown, failed, dead)."""
        a = self.srv
        if kind == "rejected":
            raise ApiError(400, payload)
        if kind == "shutdown":
            raise ApiError(503, payload, type="server_error", code="server_shutting_down")
        if kind == "failed":
            self.failed = True
            a.failing += 1
            a.metrics.request_errors.labels("engine").inc()
            raise ApiError(500, f"the engine failed this request: {payload}", type="server_error", code="engine_error")
        if kind == "dead":
            self.failed = True
            a.metrics.request_errors.labels("engine_exit").inc()
            raise ApiError(503, f"{payload}; it is being restarted - retry the request", type="server_error",
                           code="engine_unavailable")

    def count(self, when: float, tok: int, lp) -> None:
        """A token's metrics (time to first token, inter-token latency) and its log-probabilities."""
        m = self.srv.metrics
        if self.first is None:
            self.first = when
            m.ttft.observe(when - self.t0)
        else:
            m.itl.observe(when - self.last)
        self.last = when
        self.n += 1
        m.generation_tokens.inc()
        if lp is not None:
            self.logprobs.append([tok, lp[0], lp[1]])
            self.pending += 1

    def _take(self) -> list:
        out = self.logprobs[len(self.logprobs) - self.pending:] if self.pending else []
        self.pending = 0
        return out

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.srv.open_requests -= 1
        if self.open:
            self.srv.engine.abort(self.rid)      # frees a disconnected (or stop-string) request's KV and slot
        if not self.finished:
            self.srv.metrics.requests.labels("error" if self.failed else "abort").inc()


class Logprobs:
    """OpenAI's logprobs objects from [token id, logprob, [[id, logprob], ...]] entries: chat's ``content``
    list (token, logprob, bytes, top_logprobs) and the completions API's ``tokens`` / ``token_logprobs`` /
    ``top_logprobs`` / ``text_offset``. A token's text is its own decoding (bytes: of that text, as vLLM)."""

    def __init__(self, tok, chat: bool, k: int) -> None:
        self.tok, self.chat, self.k = tok, chat, k
        self.offset = 0          # completions: characters before the next token
        self._text: dict = {}

    def text(self, tid: int) -> str:
        t = self._text.get(tid)
        if t is None:
            t = self._text[tid] = self.tok.decode([tid])
        return t

    def format(self, entries: list) -> "dict | None":
        if self.chat:
            def one(tid, lp):
                return {"token": self.text(tid), "logprob": lp, "bytes": list(self.tok.token_bytes(tid))}
            return {"content": [{**one(tid, lp), "top_logprobs": [one(i, v) for i, v in top]}
                                for tid, lp, top in entries]}
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tid, lp, top in entries:
            t = self.text(tid)
            out["tokens"].append(t)
            out["token_logprobs"].append(lp)
            # (echo: the prompt's first token has no logprob and no alternatives)
            out["top_logprobs"].append({self.text(i): v for i, v in top} if self.k and top is not None else None)
            out["text_offset"].append(self.offset)
            self.offset += len(t)
        return out


class Choices:
    """A request's ``n`` choices (n engine requests): collected together, or merged into one stream."""

    def __init__(self, srv: "Server", evs: list, chat: bool, n_prompt: int, k: "int | None",
                 tools: "Tools | None" = None, harmony: bool = False, reasoner: "Reasoner | None" = None) -> None:
        self.srv, self.evs, self.chat, self.n_prompt, self.tools = srv, evs, chat, n_prompt, tools
        self.harmony = harmony      # a gpt-oss chat reply: channels split into reasoning, content and calls
        self.reasoner = reasoner    # a reply's thinking block (reasoning.py): split off before anything is parsed
        self.rid = evs[0].rid.rsplit("-", 1)[0] if len(evs) > 1 else evs[0].rid
        self.lp = [Logprobs(srv.tok, chat, k) if k is not None else None for _ in evs]
        self.shown = PromptShown()  # what the response shows of the prompt (echo, prompt_logprobs): routes.py sets it

    def events(self, index: int) -> Events:
        return next(e for e in self.evs if e.index == index)

    def parts(self, text: str, final: bool = False) -> "tuple[str, str]":
        """(reasoning, the rest) of a chat choice's text so far (all of it the rest without a thinking block)."""
        return ("", text) if self.reasoner is None else self.reasoner.split(text, final)

    def message(self, text: str, finish: str) -> "tuple[str | None, list, str]":
        """(content, tool_calls, finish_reason) of a chat choice: its text, or the tool calls in it."""
        t = self.tools
        text = self.parts(text, final=True)[1]         # the calls and the content follow the thinking
        if self.harmony:
            content, calls = self.srv.tool_format.parse(text, t.functions if t is not None else [])
            if t is None or finish != "stop":
                return content, [], finish
            return (content.strip() or None) if calls else content, calls, "tool_calls" if calls else finish
        if t is not None and finish == "length":        # cut: the calls it completed, as a stream sends them
            content, calls = cut_reply(t, self.srv.tool_format, text)
            return content, calls, finish
        if t is None or finish != "stop":
            return text, [], finish
        if t.choice in ("required", "named"):
            try:
                return None, constrained_calls(t, text), "tool_calls"
            except (ValueError, KeyError, TypeError):     # cut by a stop string: not whole JSON - the text as it is
                return text, [], finish
        content, calls = parse_auto(self.srv.tool_format, text, t.functions)
        return content, calls, "tool_calls" if calls else finish

    def usage(self) -> dict:
        """OpenAI's usage; ``cached_tokens``: the prompt tokens the prefix cache held (the first choice's: the
        prompt is counted once)."""
        n = sum(ev.n for ev in self.evs)
        return {"prompt_tokens": self.n_prompt, "completion_tokens": n, "total_tokens": self.n_prompt + n,
                "prompt_tokens_details": {"cached_tokens": self.events(0).cached}}

    def watch(self, receive) -> "asyncio.Future":
        """One task that ends when the client disconnects, for every choice."""
        gone = asyncio.ensure_future(disconnect(receive))
        for ev in self.evs:
            ev.watch = gone
        return gone

    async def collect(self, request) -> dict:
        """A non-streaming request: wait for every choice's end, watching for the client going away (the body
        is read, so the next ASGI message is the disconnect)."""
        gone = self.watch(request.receive)

        async def one(ev) -> str:
            async for _, reason, _ in ev:
                if reason is not None:
                    return reason
                if gone.done():
                    raise ClientGone()
            return "length"
        try:
            finishes = await asyncio.gather(*(one(ev) for ev in self.evs))
        finally:
            gone.cancel()
        choices = [self.choice(ev, finish, lp) for ev, finish, lp in zip(self.evs, finishes, self.lp)]
        out = {"id": self.rid, "object": "chat.completion" if self.chat else "text_completion",
               "created": int(time.time()), "model": self.srv.model_name,
               "system_fingerprint": self.srv.fingerprint, "choices": choices, "usage": self.usage()}
        if self.chat and self.shown.logprobs:
            out["prompt_logprobs"] = self.prompt_logprobs(self.events(0))     # vLLM's place for chat: the response's
        return out

    def prompt_logprobs(self, ev: Events) -> "list | None":
        """vLLM's ``prompt_logprobs``: per prompt token None (the first), else {token id: {logprob, rank,
        decoded_token}} of the prompt's token and the most likely ones (logprobs floored at -9999, as vLLM's)."""
        if ev.prompt_logprobs is None:
            return None
        text: dict = {}

        def one(tid, v, rank) -> dict:
            if tid not in text:
                text[tid] = self.srv.tok.decode([tid])
            return {"logprob": max(v, -9999.0), "rank": rank, "decoded_token": text[tid]}
        out = []
        for tid, e in zip(self.shown.ids, ev.prompt_logprobs):
            if e is None:
                out.append(None)
                continue
            d = {str(tid): one(tid, e[0], e[1])}
            for j, (i, v) in enumerate(e[2]):
                d.setdefault(str(i), one(i, v, j + 1))
            out.append(d)
        return out

    def echoed(self, ev: Events) -> list:
        """echo with logprobs: the prompt tokens' entries [id, logprob, [[id, logprob], ...]] before the output's
        (the first token has neither: None, None)."""
        if self.lp[0] is None or ev.prompt_logprobs is None:
            return []
        ids, k = self.shown.ids, self.lp[0].k
        return [[ids[0], None, None]] + [[t, e[0], e[2][:k]] for t, e in zip(ids[1:], ev.prompt_logprobs[1:])]

    def choice(self, ev: Events, finish: str, lp: "Logprobs | None") -> dict:
        """A finished choice of a non-streaming response."""
        echo = self.shown.echo
        logprobs = lp.format((self.echoed(ev) if echo is not None else []) + ev.logprobs) if lp is not None else None
        if not self.chat:
            out = {"index": ev.index, "text": (echo or "") + ev.detok.text, "logprobs": logprobs,
                   "finish_reason": finish}
            if self.shown.logprobs:
                out["prompt_logprobs"] = self.prompt_logprobs(ev)         # vLLM's place for completions: each choice's
            return out
        content, calls, finish = self.message(ev.detok.text, finish)
        msg = {"role": "assistant", "content": content}
        if calls:
            msg["tool_calls"] = calls
        reasoning = split(ev.detok.text).reasoning if self.harmony else self.parts(ev.detok.text, final=True)[0]
        if reasoning:
            msg["reasoning_content"] = reasoning         # vLLM's field for a reasoning model's thinking
            msg["content"] = msg["content"] or None      # thinking alone (cut by max_tokens): no content
        return {"index": ev.index, "message": msg, "logprobs": logprobs, "finish_reason": finish}

    async def merged(self):
        """Every choice's (index, delta, finish_reason, logprobs entries) as they come; an error ends it."""
        q: asyncio.Queue = asyncio.Queue()

        async def pump(ev):
            try:
                echo = self.shown.echo           # the completions API's echo: the prompt leads the first chunk
                async for delta, finish, lps in ev:
                    if echo is not None:
                        delta, lps, echo = echo + delta, self.echoed(ev) + lps, None
                    await q.put((ev.index, delta, finish, lps))
            except BaseException as e:  # noqa: BLE001 - handed to the consumer
                await q.put(e)
            finally:
                await q.put(None)
        tasks = [asyncio.ensure_future(pump(ev)) for ev in self.evs]
        try:
            left = len(tasks)
            while left:
                item = await q.get()
                if item is None:
                    left -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for t in tasks:
                t.cancel()

    def close(self) -> None:
        for ev in self.evs:
            ev.close()
