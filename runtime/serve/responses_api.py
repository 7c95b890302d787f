"""OpenAI's Responses API (``POST /v1/responses``, ``GET /v1/responses/{id}``), served by the chat path: a request's
``input`` (a string, or message / function_call / function_call_output / reasoning items), ``instructions`` (a
system message first), its previous response's conversation (``previous_response_id``) and its tools become a chat
request - the family's chat template, tool-call format, reasoning parser and the sampling checks are the chat
completions' own - and the reply's message becomes output items: ``reasoning`` (the thinking, as
``reasoning_text``), ``message`` (``output_text``) and ``function_call`` items, with ``usage`` in the Responses'
names. Streamed, the chat chunks are told as the Responses' events (``ResponseStream``): response.created,
response.output_item.added, response.output_text.delta / done, response.reasoning_text.delta / done,
response.function_call_arguments.delta / done, response.output_item.done, then response.completed (or
response.incomplete when max_output_tokens cut it).

A response is kept (unless ``"store": false``) in memory, least recently used first out, at most
``STORE_RESPONSES`` of them and ``STORE_CHARS`` characters of their conversations together: what
``previous_response_id`` continues and ``GET /v1/responses/{id}`` returns. A server restart forgets them; a
missing one is OpenAI's 400 ``previous_response_not_found``. Fields that would change the output and are not
served (``background``, ``conversation``, ``prompt``, ``max_tool_calls``, ``top_logprobs``, a tool that is not a
function, image or file inputs) are 400s naming them, as is any field the API does not have."""
from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .harmony import split
from .params import ApiError, refuse_unsupported
from .reasoning import reasoning_tokens
from .responses import Choices, json_response
from .streams import Stream

if TYPE_CHECKING:
    from .api import Server
    from .routes import Routes

STORE_RESPONSES = 1024
STORE_CHARS = 64 << 20

# The Responses API's own fields; then the chat path's (vLLM's extensions), passed to it as they are.
FIELDS = {"model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "tools", "tool_choice",
          "parallel_tool_calls", "previous_response_id", "store", "stream", "text", "reasoning", "truncation",
          "include", "background", "top_logprobs"}
# (those the chat path ignores on purpose - metadata, user, service_tier, ... - are logged there, params.KNOWN)
PASSED = ("seed", "top_k", "min_p", "min_tokens", "repetition_penalty", "presence_penalty", "frequency_penalty",
          "logit_bias", "stop", "ignore_eos", "stop_token_ids", "chat_template_kwargs", "cache_salt",
          "prompt_cache_key", "metadata", "user", "service_tier", "safety_identifier", "guided_json", "guided_regex",
          "guided_choice", "guided_grammar", "structured_outputs")


@dataclass
class Stored:
    response: dict              # the response object
    messages: list              # its conversation as chat messages (its instructions not among them), its reply last
    size: int                   # characters of the conversation


class ResponseStore:
    """The kept responses, least recently used first out, bounded in count and in characters. Touched only on the
    event loop (no lock)."""

    def __init__(self, limit: int = STORE_RESPONSES, chars: int = STORE_CHARS) -> None:
        self.limit, self.chars = limit, chars
        self.items: "OrderedDict[str, Stored]" = OrderedDict()
        self.size = 0

    def get(self, rid: str) -> "Stored | None":
        s = self.items.get(rid)
        if s is not None:
            self.items.move_to_end(rid)
        return s

    def put(self, rid: str, response: dict, messages: list) -> None:
        size = len(json.dumps(messages))
        if size > self.chars:
            return                     # larger than the whole store: not kept (a continuation is a 400)
        self.items[rid] = Stored(response, messages, size)
        self.size += size
        while len(self.items) > self.limit or self.size > self.chars:
            _, old = self.items.popitem(last=False)
            self.size -= old.size


@dataclass
class Request:
    """A Responses request as the chat path takes it, with what its response object echoes."""
    chat: dict                  # the chat completions body
    history: list               # the conversation before the reply (chat messages, without the instructions)
    echo: dict                  # the request's fields the response repeats
    store: bool
    stream: bool
    rid: str = field(default_factory=lambda: "resp_" + uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))


def _bad(msg: str, param: str) -> ApiError:
    return ApiError(400, msg, param=param)


def _text(content, where: str) -> str:
    """A message's content: a string, or a list of text parts (input_text, output_text)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in ("input_text", "output_text", "text")
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise _bad(f"{where}.content must be a string or a list of input_text / output_text parts (this server "
               f"reads text only)", f"{where}.content")


def _item(it, where: str, out: list, names: dict) -> None:
    """One input item, appended to ``out`` as chat messages (a call joins the assistant turn before it)."""
    if not isinstance(it, dict):
        raise _bad(f"{where} must be an object", where)
    kind = it.get("type", "message")
    if kind == "message":
        if it.get("role") not in ("user", "system", "developer", "assistant"):
            raise _bad(f"{where}.role must be user, system, developer or assistant", f"{where}.role")
        out.append({"role": it["role"], "content": _text(it.get("content"), where)})
    elif kind == "function_call":
        name, args, cid = it.get("name"), it.get("arguments"), it.get("call_id")
        if not all(isinstance(x, str) for x in (name, args, cid)):
            raise _bad(f"{where}: a function_call needs call_id, name and arguments (strings)", where)
        tc = {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}
        names[cid] = name
        if out and out[-1]["role"] == "assistant":
            out[-1].setdefault("tool_calls", []).append(tc)
        else:
            out.append({"role": "assistant", "content": None, "tool_calls": [tc]})
    elif kind == "function_call_output":
        cid, output = it.get("call_id"), it.get("output")
        if not isinstance(cid, str):
            raise _bad(f"{where}: a function_call_output needs call_id (a string)", where)
        msg = {"role": "tool", "tool_call_id": cid, "content": _text(output, where)}
        if cid in names:
            msg["name"] = names[cid]       # templates that name the function a result comes from (harmony)
        out.append(msg)
    elif kind != "reasoning":          # a past turn's thinking: templates drop it (Qwen3's, DeepSeek-R1's) - so here
        raise _bad(f"{where}.type {kind!r} is not supported: message, function_call, function_call_output or "
                   f"reasoning", f"{where}.type")


def _messages(inp, history: list) -> list:
    if isinstance(inp, str):
        return [{"role": "user", "content": inp}]
    if not isinstance(inp, list) or not inp:
        raise _bad("'input' must be a string or a non-empty list of items", "input")
    names = {tc["id"]: tc["function"]["name"] for m in history for tc in m.get("tool_calls") or []}
    out: list = []
    for i, it in enumerate(inp):
        _item(it, f"input[{i}]", out, names)
    return out


def _tools(body: dict) -> dict:
    """tools / tool_choice / parallel_tool_calls in the chat API's shapes (a Responses function tool is flat)."""
    out = {}
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise _bad("'tools' must be a list", "tools")
        chat = []
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or t.get("type") != "function":
                raise _bad(f"tools[{i}]: only function tools are served ({{\"type\": \"function\", \"name\", "
                           f"\"parameters\"}})", f"tools[{i}].type")
            chat.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters",
                                                                            "strict") if t.get(k) is not None}})
        out["tools"] = chat
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise _bad("'tool_choice' must be none, auto, required or {\"type\": \"function\", \"name\": ...}",
                       "tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    if choice is not None:
        out["tool_choice"] = choice
    if "parallel_tool_calls" in body:
        out["parallel_tool_calls"] = body["parallel_tool_calls"]
    return out


def _format(text) -> "dict | None":
    """``text.format`` as the chat API's ``response_format``."""
    if text is None:
        return None
    f = text.get("format") if isinstance(text, dict) else ""
    if f is None:
        return None
    kind = f.get("type") if isinstance(f, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {k: f[k] for k in ("name", "schema", "strict") if k in f}}
    raise _bad("'text.format' must be {\"type\": \"text\" | \"json_object\" | \"json_schema\", ...}", "text")


def _refused(body: dict) -> None:
    for k in body:
        if k not in FIELDS and k not in PASSED:
            raise _bad(f"'{k}' is not a field of the Responses API this server serves", k)
    if body.get("background"):
        raise _bad("'background' responses are not supported: send the request and wait, or stream it", "background")
    if body.get("top_logprobs"):
        raise _bad("'top_logprobs' is not supported by /v1/responses (use /v1/chat/completions)", "top_logprobs")
    for k in ("instructions", "previous_response_id", "user"):
        if body.get(k) is not None and not isinstance(body[k], str):
            raise _bad(f"'{k}' must be a string", k)
    for k in ("store", "stream"):
        if not isinstance(body.get(k, False), bool):
            raise _bad(f"'{k}' must be a boolean", k)
    if body.get("metadata") is not None and not isinstance(body["metadata"], dict):
        raise _bad("'metadata' must be an object", "metadata")
    if body.get("truncation") not in (None, "disabled", "auto"):
        raise _bad("'truncation' must be disabled or auto", "truncation")
    r = body.get("reasoning")
    if r is not None and (not isinstance(r, dict) or not isinstance(r.get("effort"), (str, type(None)))):
        raise _bad("'reasoning' must be {\"effort\": low | medium | high, ...}", "reasoning")


def parse(body: dict, store: ResponseStore) -> Request:
    """The Responses body as a chat request (checked; the chat path checks the rest)."""
    _refused(body)
    history: list = []
    prev = body.get("previous_response_id")
    if prev is not None:
        s = store.get(prev)
        if s is None:
            raise ApiError(400, f"Previous response with id '{prev}' not found.", param="previous_response_id",
                           code="previous_response_not_found")
        history = s.messages
    new = _messages(body.get("input"), history)
    instr = body.get("instructions")
    chat = {"model": body.get("model"), "messages": ([{"role": "system", "content": instr}] if instr else []) +
            history + new, **_tools(body), **{k: body[k] for k in PASSED if k in body}}
    for ours, theirs in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p")):
        if body.get(ours) is not None:
            chat[theirs] = body[ours]
    rf = _format(body.get("text"))
    if rf is not None:
        chat["response_format"] = rf
    effort = (body.get("reasoning") or {}).get("effort")
    if effort is not None:       # gpt-oss's template reads it (its system message's "Reasoning: high"), as vLLM has it
        kw = chat.get("chat_template_kwargs")
        chat["chat_template_kwargs"] = {**(kw if isinstance(kw, dict) else {}), "reasoning_effort": effort}
    refuse_unsupported(chat)
    echo = {"instructions": instr, "max_output_tokens": body.get("max_output_tokens"),
            "metadata": body.get("metadata") or {}, "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": prev, "reasoning": {"effort": effort, "summary": None},
            "temperature": body.get("temperature", 1.0), "text": {"format": (body.get("text") or {}).get("format")
                                                                   or {"type": "text"}},
            "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
            "top_p": body.get("top_p", 1.0), "truncation": body.get("truncation") or "disabled",
            "user": body.get("user")}
    return Request(chat, history + new, echo, body.get("store", True), body.get("stream", False))


# -- the reply as output items ---------------------------------------------------------------------------------------
def _id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


def reasoning_item(text: str, status: str = "completed") -> dict:
    return {"type": "reasoning", "id": _id("rs_"), "summary": [], "content": [{"type": "reasoning_text",
                                                                                "text": text}], "status": status}


def message_item(text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": _id("msg_"), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"type": "function_call", "id": _id("fc_"), "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def output_items(msg: dict, finish: str) -> list:
    """A chat message (reasoning_content, content, tool_calls) as the Responses' output items; the last one
    incomplete when max_output_tokens cut it (those before it were whole)."""
    out = []
    if msg.get("reasoning_content"):
        out.append(reasoning_item(msg["reasoning_content"]))
    if msg.get("content"):
        out.append(message_item(msg["content"]))
    for c in msg.get("tool_calls") or []:
        out.append(call_item(c["id"], c["function"]["name"], c["function"]["arguments"]))
    if out and finish == "length":
        out[-1]["status"] = "incomplete"
    return out


def reply_message(output: list) -> dict:
    """The output items as the assistant turn a continuation sends back through the chat template."""
    text = "".join(p["text"] for it in output if it["type"] == "message" for p in it["content"])
    calls = [{"id": it["call_id"], "type": "function", "function": {"name": it["name"], "arguments": it["arguments"]}}
             for it in output if it["type"] == "function_call"]
    return {"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}


def usage(ch: Choices) -> dict:
    """The Responses' usage: input / output tokens, the cached ones, and the reply's tokens up to the end of its
    reasoning."""
    u = ch.usage()
    ev = ch.evs[0]
    of = (lambda t: split(t).reasoning) if ch.harmony else (lambda t: ch.parts(t)[0])
    thinking = reasoning_tokens(ev.detok.ids, lambda ids: ch.srv.tok.decode(ids, ev.detok.keep), of)
    return {"input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"],
            "total_tokens": u["total_tokens"],
            "input_tokens_details": {"cached_tokens": (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)},
            "output_tokens_details": {"reasoning_tokens": thinking}}


def response_object(srv: "Server", req: Request, status: str, output: list, use: "dict | None",
                    error: "dict | None" = None) -> dict:
    return {"id": req.rid, "object": "response", "created_at": req.created, "status": status, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "model": srv.model_name, "output": output, "usage": use, "store": req.store, "background": False,
            **req.echo}


# -- streamed: the chat chunks told as the Responses' events -----------------------------------------------------------
class ResponseStream(Stream):
    """The Responses API's server-sent events for a streamed request: the chat stream's chunks (reasoning_content,
    content, tool-call deltas, the finish) as they come, each told as the events of the output item it belongs to;
    an item is done when the next one opens or the reply ends. Whitespace before a call is not a message (as the
    chat reply's content is null then)."""

    def __init__(self, api: "ResponsesApi", ch: Choices, req: Request) -> None:
        super().__init__(api.srv, ch, include_usage=False)
        self.api, self.req = api, req
        self.seq = 0
        self.items: list = []          # the output items so far (the last one open until the next)
        self.calls: dict = {}          # a chat tool-call index -> its item's index
        self.space = ""                # whitespace not yet known to be a message's
        self.finish = None
        self.failed = False

    async def emit(self, kind: str, **fields) -> None:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        await self.write(f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode())

    def snapshot(self, status: str, use: "dict | None" = None, error: "dict | None" = None) -> dict:
        return response_object(self.srv, self.req, status, self.items, use, error)

    async def event(self, data) -> None:
        """A chat chunk (the first names the role: the response is created), an error, or the end."""
        if data == b"[DONE]":
            await self.done()
        elif isinstance(data, dict) and "error" in data:
            e = data["error"]
            self.failed = True
            await self.emit("error", code=e.get("code"), message=e.get("message"), param=e.get("param"))
            await self.emit("response.failed", response=self.snapshot("failed", error={
                "code": e.get("code") or "server_error", "message": e.get("message")}))
        elif not self.seq:
            await self.emit("response.created", response=self.snapshot("in_progress"))
            await self.emit("response.in_progress", response=self.snapshot("in_progress"))
        for c in data.get("choices", []) if isinstance(data, dict) else []:
            d = c["delta"]
            if d.get("reasoning_content"):
                await self.text("reasoning", d["reasoning_content"])
            if d.get("content"):
                await self.text("message", d["content"])
            for tc in d.get("tool_calls") or []:
                await self.call(tc)
            self.finish = c.get("finish_reason") or self.finish

    def current(self, kind: str) -> "dict | None":
        return self.items[-1] if self.items and self.items[-1]["type"] == kind and \
            self.items[-1]["status"] == "in_progress" else None

    async def open(self, item: dict) -> None:
        await self.close()
        self.items.append(item)
        i = len(self.items) - 1
        await self.emit("response.output_item.added", output_index=i, item=item)
        if item["type"] != "function_call":
            await self.emit("response.content_part.added", item_id=item["id"], output_index=i, content_index=0,
                            part=item["content"][0])

    async def close(self) -> None:
        """The open item, done."""
        if not self.items or self.items[-1]["status"] != "in_progress":
            return
        it, i = self.items[-1], len(self.items) - 1
        it["status"] = "incomplete" if self.finish == "length" else "completed"
        if it["type"] == "function_call":
            await self.emit("response.function_call_arguments.done", item_id=it["id"], output_index=i,
                            name=it["name"], arguments=it["arguments"])
        else:
            part = it["content"][0]
            kind = "response.output_text.done" if it["type"] == "message" else "response.reasoning_text.done"
            await self.emit(kind, item_id=it["id"], output_index=i, content_index=0, text=part["text"],
                            **({"logprobs": []} if it["type"] == "message" else {}))
            await self.emit("response.content_part.done", item_id=it["id"], output_index=i, content_index=0,
                            part=part)
        await self.emit("response.output_item.done", output_index=i, item=it)

    async def text(self, kind: str, delta: str, last: bool = False) -> None:
        """A reasoning or content delta, in the open item of its kind or a new one; ``last``: the reply's end
        (whitespace held back is its content after all)."""
        if kind == "message" and self.current("message") is None:
            if not (self.space + delta).strip() and not last:
                self.space += delta
                return
            delta, self.space = self.space + delta, ""
        it = self.current(kind)
        if it is None:
            it = reasoning_item("", "in_progress") if kind == "reasoning" else message_item("", "in_progress")
            await self.open(it)
        it["content"][0]["text"] += delta
        name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        await self.emit(name, item_id=it["id"], output_index=len(self.items) - 1, content_index=0, delta=delta,
                        **({"logprobs": []} if kind == "message" else {}))

    async def call(self, tc: dict) -> None:
        fn = tc.get("function") or {}
        if tc["index"] not in self.calls:
            self.space = ""
            await self.open(call_item(tc["id"], fn.get("name", ""), "", "in_progress"))
            self.calls[tc["index"]] = len(self.items) - 1
        i = self.calls[tc["index"]]
        if fn.get("arguments"):
            self.items[i]["arguments"] += fn["arguments"]
            await self.emit("response.function_call_arguments.delta", item_id=self.items[i]["id"], output_index=i,
                            delta=fn["arguments"])

    async def done(self) -> None:
        """The reply's end: the open item done, the response completed (or incomplete) and kept."""
        if self.failed:
            return
        if self.space and not self.calls:
            await self.text("message", "", last=True)
        await self.close()
        status = "incomplete" if self.finish == "length" else "completed"
        resp = self.snapshot(status, usage(self.ch))
        self.api.keep(self.req, resp)
        await self.emit("response.completed" if status == "completed" else "response.incomplete", response=resp)


class ResponsesApi:
    """The endpoints: POST /v1/responses, GET /v1/responses/{id}; the kept responses."""

    def __init__(self, srv: "Server", routes: "Routes") -> None:
        self.srv, self.routes = srv, routes
        self.store = ResponseStore()

    def keep(self, req: Request, resp: dict) -> None:
        if req.store:
            self.store.put(req.rid, resp, req.history + [reply_message(resp["output"])])

    async def create(self, request):
        a, r = self.srv, self.routes
        key, body = await r.checked(request)
        req = parse(body, self.store)
        salt = a.isolation.salt(req.chat, key)
        p = await r.prepare(req.chat, True)
        ch = await r.choices(p, salt)
        if req.stream:
            return ResponseStream(self, ch, req)
        try:
            result = await ch.collect(request)
            c = result["choices"][0]
            output = output_items(c["message"], c["finish_reason"])
            resp = response_object(a, req, "incomplete" if c["finish_reason"] == "length" else "completed", output,
                                   usage(ch))
        finally:
            ch.close()
        self.keep(req, resp)
        return json_response(200, resp)

    async def retrieve(self, request):
        self.routes.auth(request)
        rid = request.path_params["response_id"]
        s = self.store.get(rid)
        if s is None:
            raise ApiError(404, f"Response with id '{rid}' not found.", param="response_id", code="not_found")
        return json_response(200, s.response)
