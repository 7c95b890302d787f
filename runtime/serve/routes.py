"""The endpoints as a Starlette app: GET /health, /metrics, /version, /v1/models[/{model}], POST /v1/completions and
/v1/chat/completions, /v1/responses (responses_api.py), vLLM's /tokenize and /detokenize, and OpenAI's error object
for every failure (the exception handlers)."""
from __future__ import annotations

import asyncio
import functools
import json
import sys
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .client import EngineError
from .identity import package_version
from .isolation import matching_key
from .params import ApiError, Detokenizer, Stops, constraint_field, prompt_shown, refuse_unsupported, stop_rules
from .reasoning import Reasoner, reasoner
from .responses import Choices, Events, json_response
from .responses_api import ResponsesApi
from .streams import Stream
from .tool_parsers import Tools, keep_tokens, parse_tools, trigger
from .transport import ClientGone, HostCheck, Sink

if TYPE_CHECKING:
    from .api import Server

HEALTH_SILENCE_S = 5.0       # the engine reports at least once a second
HEALTH_FAILURES = 3          # requests failed by the engine in a row before /health says so


@dataclass
class Prepared:
    """A generation request, checked and tokenized: what its engine requests are submitted with."""
    chat: bool
    prompt: list                   # token ids
    params: dict                   # the engine's sampling parameters (one choice's; n popped)
    n: int                         # choices: one engine request each
    tools: "Tools | None"
    harmony: bool                  # a gpt-oss chat reply: split by its channels
    stops: Stops                   # stop strings, stop token ids, min_tokens, include_stop_str_in_output
    keep: frozenset                # token ids kept in the text (the tool format's markers)
    reasoner: "Reasoner | None" = None   # a chat reply's thinking block, split into reasoning_content


def build_app(srv: "Server"):
    """The ASGI app of ``srv``: the routes, the error handlers, the Host check."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.responses import Response
    from starlette.routing import Route
    r = Routes(srv)
    resp = ResponsesApi(srv, r)

    async def api_error(request, exc: ApiError):
        return json_response(exc.status, exc.body(), {"connection": "close"} if exc.status in (408, 411, 413) else None)

    async def http_error(request, exc: HTTPException):
        msg = f"{request.method} {request.url.path}: {'method not allowed' if exc.status_code == 405 else exc.detail.lower()}"
        return json_response(exc.status_code, ApiError(exc.status_code, msg).body())

    async def gone(request, exc):
        return Response(b"", status_code=499)     # nobody is there to read it

    async def crash(request, exc: Exception):
        print(f"tiered-moe: {request.method} {request.url.path}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return json_response(500, ApiError(500, f"internal error: {type(exc).__name__}", type="server_error").body())

    routes = [Route("/health", r.health, methods=["GET"]), Route("/metrics", r.metrics, methods=["GET"]),
              Route("/v1/models", r.models, methods=["GET"]),
              Route("/v1/models/{model:path}", r.model, methods=["GET"]),
              Route("/v1/completions", functools.partial(r.generate, chat=False), methods=["POST"]),
              Route("/v1/chat/completions", functools.partial(r.generate, chat=True), methods=["POST"]),
              Route("/v1/responses", resp.create, methods=["POST"]),
              Route("/v1/responses/{response_id}", resp.retrieve, methods=["GET"]),
              Route("/tokenize", r.tokenize, methods=["POST"]), Route("/detokenize", r.detokenize, methods=["POST"]),
              Route("/version", r.version, methods=["GET"])]
    app = Starlette(routes=routes, exception_handlers={ApiError: api_error, HTTPException: http_error,
                                                       ClientGone: gone, Exception: crash})
    app.router.redirect_slashes = False       # its 307 echoed the request's Host header; a wrong path is a 404
    return HostCheck(app, srv.allowed_hosts)


class Routes:
    """The endpoints, as Starlette handlers over the Server's validation and engine client."""

    def __init__(self, srv: "Server") -> None:
        self.srv = srv

    # -- plumbing ----------------------------------------------------------------------------------
    def auth(self, request) -> "str | None":
        """The API key the request carries, one of the server's (401 otherwise); None when the server has none."""
        keys = self.srv.api_keys
        if not keys:
            return None
        key = matching_key(keys, request.headers.get("authorization", ""))
        if key is None:
            raise ApiError(401, "Incorrect API key provided", code="invalid_api_key")
        return key

    async def body(self, request) -> dict:
        from starlette.concurrency import run_in_threadpool
        srv = self.srv
        if request.headers.get("transfer-encoding", "").lower() == "chunked":
            raise ApiError(411, "chunked request bodies are not accepted: send Content-Length")
        try:
            n = int(request.headers.get("content-length", "0"))
        except ValueError:
            raise ApiError(400, "bad Content-Length header") from None
        if n < 0:
            raise ApiError(400, f"bad Content-Length header ({n})")
        if n > srv.max_body:
            raise ApiError(413, f"request body of {n:,} bytes exceeds the limit of {srv.max_body:,}")
        # JSON only: a web page can POST text/plain (or a form) to any address without asking first (no CORS
        # preflight); application/json it cannot.
        ct = request.headers.get("content-type")
        if ct is not None and ct.split(";")[0].strip().lower() != "application/json":
            raise ApiError(415, f"Content-Type must be application/json, got {ct[:80]!r}")
        try:
            raw = await asyncio.wait_for(request.body(), srv.timeout)
        except asyncio.TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {srv.timeout:g} s") from None

        def parse():
            try:
                return json.loads(raw)
            except RecursionError:
                raise ApiError(400, "request body nests too deeply") from None
            except ValueError as e:
                raise ApiError(400, f"request body is not valid JSON: {e}") from None
        body = parse() if len(raw) < 65536 else await run_in_threadpool(parse)
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object")
        return body

    # -- endpoints ---------------------------------------------------------------------------------
    async def health(self, request):
        """200 only while the engine answers and serves: 503 while it restarts, when it has sent nothing for 5 s
        or 3 of its longest step), or when its last requests all failed - in the engine: a request refused for
        what it sent (a 400, a grammar that fails while generating included) never counts."""
        e = self.srv.engine
        silent = time.monotonic() - e.last_heard
        if not e.alive:
            return json_response(503, {"status": "engine restarting", "last_exit": e.last_exit, "restarts": e.restarts})
        if silent > max(HEALTH_SILENCE_S, 3 * e.slowest_step):
            return json_response(503, {"status": "engine not answering", "silent_seconds": round(silent, 1),
                                       "restarts": e.restarts})
        if self.srv.failing >= HEALTH_FAILURES:
            return json_response(503, {"status": "engine failing requests", "failed_in_a_row": self.srv.failing,
                                       "restarts": e.restarts})
        return json_response(200, {"status": "ok", "restarts": e.restarts})

    async def metrics(self, request):
        from prometheus_client import CONTENT_TYPE_LATEST
        from starlette.responses import Response
        return Response(self.srv.metrics.render(), media_type=CONTENT_TYPE_LATEST, headers={"server": "tiered-moe"})

    async def models(self, request):
        self.auth(request)
        a = self.srv
        return json_response(200, {"object": "list", "data": [{"id": a.model_name, "object": "model",
                                                               "created": a.created, "owned_by": "tiered-moe",
                                                               "max_model_len": a.max_context}]})

    async def model(self, request):
        self.auth(request)
        a = self.srv
        m = request.path_params["model"]
        if m != a.model_name:
            raise ApiError(404, f"The model '{m}' does not exist; this server serves '{a.model_name}'", param="model",
                           code="model_not_found")
        return json_response(200, {"id": a.model_name, "object": "model", "created": a.created,
                                   "owned_by": "tiered-moe", "max_model_len": a.max_context})

    async def tokenize(self, request):
        """vLLM's /tokenize: a ``prompt``, or ``messages`` rendered by the chat template (with ``tools`` and the
        template fields), as the token ids a request of it is fed; ``add_special_tokens``: false leaves out those the
        tokenizer adds (its BOS)."""
        a = self.srv
        self.auth(request)
        body = await self.body(request)
        if body.get("model") is not None:
            a.check_model(body)
        special = body.get("add_special_tokens", True)
        if not isinstance(special, bool):
            raise ApiError(400, "'add_special_tokens' must be a boolean", param="add_special_tokens")
        if body.get("return_token_strs"):
            raise ApiError(400, "'return_token_strs' is not supported: /detokenize gives the ids' text",
                           param="return_token_strs")
        lane = a.lane(body)          # off the event loop, a long prompt in its lane (as a generation request's)
        if "messages" in body:
            text = await lane(a.chat_text, body, parse_tools(body))
        elif isinstance(body.get("prompt"), str) and body["prompt"]:
            text = body["prompt"]
        else:
            raise ApiError(400, "/tokenize needs 'prompt' (a non-empty string) or 'messages'", param="prompt")
        param = "messages" if "messages" in body else "prompt"
        ids = await lane(a.encode, text, param, special)
        return json_response(200, {"count": len(ids), "max_model_len": a.max_context, "tokens": ids,
                                   "token_strs": None})

    async def detokenize(self, request):
        """vLLM's /detokenize: token ids -> their text, special tokens (the chat template's markers) included."""
        from starlette.concurrency import run_in_threadpool
        a = self.srv
        self.auth(request)
        body = await self.body(request)
        if body.get("model") is not None:
            a.check_model(body)
        ids = body.get("tokens")
        if not (isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < a.vocab_size
                                              for t in ids)):
            raise ApiError(400, f"'tokens' must be a list of token ids in [0, {a.vocab_size})", param="tokens")
        text = await run_in_threadpool(a.tok.decode, ids, a.tok.special_ids)
        return json_response(200, {"prompt": text})

    async def version(self, request):
        return json_response(200, {"version": package_version()})

    async def checked(self, request) -> tuple:
        """(API key, body) of a generation request (completions, chat, responses): authorized, parsed, its model
        checked."""
        key = self.auth(request)
        body = await self.body(request)
        self.srv.check_model(body)
        return key, body

    async def choices(self, p: Prepared, salt: "str | None", k: "int | None" = None) -> Choices:
        """The request's choices, its engine requests submitted (``salt``: their prefix-cache salt)."""
        return Choices(self.srv, await self.submit(p, salt), p.chat, len(p.prompt), k, p.tools, p.harmony,
                       reasoner=p.reasoner)

    async def generate(self, request, chat: bool):
        a = self.srv
        key, body = await self.checked(request)
        salt = a.isolation.salt(body, key)      # its prefix-cache salt (cache_salt, the key under isolation)
        refuse_unsupported(body, chat)
        stream, include_usage = _stream_options(body)
        p = await self.prepare(body, chat)
        ch = await self.choices(p, salt, p.params.get("logprobs"))
        ch.shown = prompt_shown(body, p.prompt, a.tok, chat)     # echo, prompt_logprobs
        if stream:
            return Stream(a, ch, include_usage)
        try:
            return json_response(200, await ch.collect(request))
        finally:
            ch.close()

    async def prepare(self, body: dict, chat: bool) -> Prepared:
        """The body's prompt tokenized and its sampling parameters checked, with its tools' grammar or trigger."""
        a = self.srv
        stops = stop_rules(body)
        tools = parse_tools(body) if chat else None
        # Tokenizing (and rendering a chat template) can take a while: off the event loop (a long prompt: in its lane).
        lane = a.lane(body)
        text, tail = await lane(a.chat_render, body, tools) if chat else (None, None)
        prompt = await (lane(a.encode, text, "messages") if chat else lane(a.completion_prompt, body))
        think = reasoner(a.reasoning, tail) if chat else None
        params = a.sampling(body, len(prompt), None if chat else 16)
        if tools is not None and tools.grammar() is not None:
            if "grammar" in params:
                field = constraint_field(body)
                raise ApiError(400, f"'{field}' cannot be combined with a required or named 'tool_choice'", param=field)
            params["grammar"] = tools.grammar()
        keep = frozenset()
        # a gpt-oss chat reply that is not held to required / named calls' JSON: split by its channels
        harmony = chat and a.tool_format.name == "harmony" and (tools is None or tools.choice == "auto")
        if harmony or (tools is not None and tools.choice == "auto"):
            fmt = a.tool_format
            keep = keep_tokens(fmt, a.tok)     # its markers stay in the text: the parser (or harmony's split) reads them
            if tools is not None and tools.choice == "auto" and "grammar" not in params:
                params["trigger"] = trigger(fmt, tools, a.tok)   # response_format constrains everything already
        if think is not None:
            keep |= think.keep(a.tok)
            end = a.tok.token_id(think.fmt.end)
            if "grammar" in params and think.state is True and end is not None:
                # the prompt opened the thinking: structured output and required / named calls hold the reply after
                # it (armed by its end). Left to the model, the block is not waited for - a model that never opens
                # one (an instruct model under a template that knows <think>) would go unconstrained: the grammar
                # holds the whole reply.
                params["trigger"] = [end, *params.pop("grammar")]
        if params.get("grammar") is not None or params.get("trigger") is not None:
            # compiled in admission's workers under its budgets (a 400 naming the limit), not in the engine loop
            await a.admission.admit_async(params, body, tools)
        n = params.pop("n")
        return Prepared(chat, prompt, params, n, tools, harmony, stops, keep, think)

    async def submit(self, p: Prepared, salt: "str | None" = None) -> list:
        """The request's n engine requests, submitted (``salt``: their prefix-cache salt, isolation.py): their
        ``Events``, in choice order."""
        from starlette.concurrency import run_in_threadpool
        a = self.srv
        rid = ("chatcmpl-" if p.chat else "cmpl-") + uuid.uuid4().hex
        t0 = time.monotonic()
        evs = []
        try:
            for i in range(p.n):
                # n choices: n engine requests (a seed gives each its own: seed + i)
                params = dict(p.params, seed=None if p.params["seed"] is None else (p.params["seed"] + i) % (1 << 63))
                q: asyncio.Queue = asyncio.Queue()
                sub = rid if p.n == 1 else f"{rid}-{i}"
                try:
                    # waits (bounded) for an engine that is being restarted: in the pool, not on the loop
                    await run_in_threadpool(a.engine.submit, sub, p.prompt, params, Sink(asyncio.get_running_loop(), q),
                                            salt)
                except EngineError as e:
                    raise ApiError(503, str(e), type="server_error", code="engine_unavailable") from None
                evs.append(Events(a, q, Detokenizer(a.tok, p.stops, p.keep), t0, sub, index=i))
                a.open_requests += 1
        except BaseException:
            for ev in evs:
                ev.close()
            raise
        a.metrics.prompt_tokens.inc(len(p.prompt) * p.n)
        return evs


def _stream_options(body: dict) -> "tuple[bool, bool]":
    """(stream, include_usage) of the body, checked."""
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be a boolean", param="stream")
    so = body.get("stream_options")
    if so is None:
        so = {}
    elif not isinstance(so, dict):
        raise ApiError(400, "'stream_options' must be an object", param="stream_options")
    elif not stream:
        raise ApiError(400, "'stream_options' is only allowed with \"stream\": true", param="stream_options")
    return stream, bool(so.get("include_usage", False))

