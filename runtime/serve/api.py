"""OpenAI-compatible HTTP front-end (the subset vLLM and llama.cpp serve): a Starlette app on
uvicorn (h11), as vLLM and SGLang serve. Requests wait on an asyncio queue that the engine
client's receiver thread feeds; tokenization, JSON parsing of large bodies and waiting for an
engine restart run in the thread pool, never on the event loop.

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (server-sent events
with ``"stream": true``, usage with ``stream_options.include_usage``), GET /health, GET /metrics.
Errors use OpenAI's object ``{"error": {"message", "type", "param", "code"}}`` - for every status,
malformed requests and unknown methods included.

Hostile input fails alone: sampling values are checked against what the engine and the wire
format take (integers within int64; temperatures below 1e-5 are greedy, as in vLLM), a body that
is not JSON, nests too deep or carries lone surrogates is a 400, an error in the engine fails that
request with a 500 naming the cause, and any other exception is a 500 for that request. Every
connection has deadlines (``timeout``): for a request's headers (slowloris), its body, idle
keep-alive, and each write of a stream (a client that stops reading); a non-streaming client that
disconnects has its request aborted.
"""
from __future__ import annotations

import asyncio
import functools
import hmac
import json
import socket
import sys
import threading
import time
import uuid

from .chat import ChatFormatter
from .params import ApiError, Detokenizer, number, refuse_unsupported, response_format, stop_strings
from .client import EngineClient, EngineError
from .metrics import ServerMetrics

MAX_BODY = 8 << 20
PREFIX_MARGIN = 64           # tokens a prefix's cut may add (Server.encode)
MAX_N = 16                   # choices per request
MAX_LOGIT_BIAS = 300         # logit_bias entries (OpenAI's limit)
TOKENIZE_AT_ONCE = 4         # requests tokenizing at the same time (Server.encode)
HEALTH_SILENCE_S = 5.0       # the engine reports at least once a second
HEALTH_FAILURES = 3          # requests failed by the engine in a row before /health says so


class Server:
    """Engine client + HTTP server. ``start()`` returns once both listen; ``close()`` stops both."""

    def __init__(self, cfg, *, host: str = "127.0.0.1", port: int = 8000, api_key: "str | None" = None,
                 served_model_name: "str | None" = None, startup_timeout: float = 300.0, timeout: float = 60.0,
                 heartbeat_timeout: float = 60.0, restart_wait: float = 60.0, max_body: int = MAX_BODY,
                 allowed_hosts: "list | None" = None) -> None:
        """``allowed_hosts``: the names the ``Host`` header may carry (a web page's DNS-rebinding attack sends its
        own); None: a keyless server on a loopback address takes only loopback names, any other takes any."""
        from ..tokenizer import Tokenizer
        self.cfg, self.api_key = cfg, api_key
        if allowed_hosts is None and api_key is None and _loopback(host):
            allowed_hosts = ["localhost", "127.0.0.1", "::1", host]
        self.allowed_hosts = None if allowed_hosts is None else {h.strip("[]").lower() for h in allowed_hosts}
        self.tok = Tokenizer(cfg.model)
        if not self.tok.available:
            raise ValueError(f"{cfg.model}: no tokenizer.json; serving needs the checkpoint's tokenizer")
        self.chat = ChatFormatter(cfg.model)
        self._tokenizing = threading.BoundedSemaphore(TOKENIZE_AT_ONCE)
        self.metrics = ServerMetrics()
        self.timeout, self.max_body = timeout, max_body
        self.engine = EngineClient(cfg, metrics=self.metrics, startup_timeout=startup_timeout,
                                   heartbeat_timeout=heartbeat_timeout, restart_wait=restart_wait)
        self.model_name = served_model_name or self.engine.info["model"]
        # The longest request the engine takes: the context, or less when the KV cache holds less (a request
        # without max_tokens gets the room up to it; /v1/models advertises it as max_model_len).
        self.max_context = min(self.engine.info["max_context"],
                               self.engine.info.get("longest_sequence") or self.engine.info["max_context"])
        self.model_context = self.engine.info["max_context"]
        self.vocab_size = self.engine.info["vocab_size"]
        self.created = int(time.time())
        try:
            fam = socket.AF_INET6 if ":" in host else socket.AF_INET
            self.sock = socket.socket(fam, socket.SOCK_STREAM)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.sock.bind((host, port))
            self.sock.listen(512)
        except OSError as e:
            self.engine.close()
            raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}") from None
        self.host, self.port = self.sock.getsockname()[:2]
        self.uv = _uvicorn(self._app(), timeout)
        self._thread = None
        self.open_requests = 0        # requests between submit and their end (the event loop's count)
        self.failing = 0              # requests failed by the engine in a row (/health reports a failing engine)

    def _app(self):
        return _app_for(self)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self) -> "Server":
        """Serve on a background thread (its own event loop); returns once it listens."""
        self._thread = threading.Thread(target=self.serve_forever, name="tiered-moe-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.uv.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not self.uv.started:
            raise ValueError("the HTTP server did not start")
        return self

    def serve_forever(self) -> None:
        self.uv.run(sockets=[self.sock])

    def close(self) -> None:
        if self._thread is not None:
            # open requests end first, each with an error (a stream: an error event and [DONE]), then the loop
            self.engine.fail_all("the server is shutting down")
            deadline = time.monotonic() + 2.0
            while self.open_requests and time.monotonic() < deadline:
                time.sleep(0.02)
            self.uv.should_exit = True
            self._thread.join(10)
        try:
            self.sock.close()
        except OSError:
            pass
        self.engine.close()

    # -- building requests ---------------------------------------------------------------------
    def check_model(self, body: dict) -> None:
        m = body.get("model")
        if not isinstance(m, str):
            raise ApiError(400, "'model' is required (a string)", param="model")
        if m != self.model_name:
            raise ApiError(404, f"The model '{m}' does not exist; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")

    def sampling(self, body: dict, prompt_len: int, default_max: "int | None") -> dict:
        room = self.max_context - prompt_len
        # max_completion_tokens (the newer name) wins when set; a null one falls back to max_tokens
        name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = body.get(name)
        if max_tokens is None:
            max_tokens = min(default_max, room) if default_max else room
            if max_tokens < 1:
                raise ApiError(400, f"This model's maximum context length is {self.max_context} tokens{self._why()}. "
                                    f"However, the prompt has {prompt_len} tokens, leaving no room for a completion.",
                               param="messages" if "messages" in body else "prompt", code="context_length_exceeded")
        else:
            max_tokens = number({name: max_tokens}, name, None, lo=1, integer=True)
        if prompt_len + max_tokens > self.max_context:
            raise ApiError(400, f"This model's maximum context length is {self.max_context} tokens{self._why()}. "
                                f"However, you "
                                f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} "
                                f"for the completion).", param="messages" if "messages" in body else "prompt",
                           code="context_length_exceeded")
        temp = number(body, "temperature", 1.0, lo=0, hi=2)
        top_p = number(body, "top_p", 1.0, lo=0, hi=1, lo_open=True)
        top_k = number(body, "top_k", 0, lo=-1, integer=True)
        seed = number(body, "seed", None, integer=True)
        out = {"max_tokens": int(max_tokens), "temperature": float(temp), "top_p": float(top_p),
               "top_k": 0 if top_k == -1 else int(top_k), "seed": seed,
               "n": int(number(body, "n", 1, lo=1, hi=MAX_N, integer=True)), "logprobs": _logprobs(body)}
        for name in ("presence_penalty", "frequency_penalty"):
            out[name] = float(number(body, name, 0.0, lo=-2, hi=2))
        out["repetition_penalty"] = float(number(body, "repetition_penalty", 1.0, lo=0, hi=100, lo_open=True))
        ie = body.get("ignore_eos", False)          # vLLM's extension: generate max_tokens whatever the model says
        if not isinstance(ie, bool):
            raise ApiError(400, "'ignore_eos' must be a boolean", param="ignore_eos")
        out["ignore_eos"] = ie
        stop_ids = body.get("stop_token_ids")          # vLLM's extension: token ids that end the output
        if stop_ids is not None:
            if not (isinstance(stop_ids, list) and len(stop_ids) <= 64 and all(
                    isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab_size for t in stop_ids)):
                raise ApiError(400, f"'stop_token_ids' must be a list of up to 64 token ids in [0, {self.vocab_size})",
                               param="stop_token_ids")
            out["stop_token_ids"] = list(stop_ids)
        grammar = response_format(body)
        if grammar is not None:
            out["grammar"] = grammar
        bias = body.get("logit_bias")
        if bias is not None:
            if not isinstance(bias, dict):
                raise ApiError(400, "'logit_bias' must be an object of token id -> bias", param="logit_bias")
            pairs = []
            for t, v in bias.items():
                try:
                    tid = int(t)
                except ValueError:
                    raise ApiError(400, f"'logit_bias' keys must be token ids, got {t[:40]!r}", param="logit_bias") from None
                if not 0 <= tid < self.vocab_size:
                    raise ApiError(400, f"'logit_bias' token id {tid} is outside the vocabulary [0, {self.vocab_size})",
                                   param="logit_bias")
                pairs.append([tid, float(number({"logit_bias": v}, "logit_bias", None, lo=-100, hi=100))])
            if len(pairs) > MAX_LOGIT_BIAS:
                raise ApiError(400, f"'logit_bias' has {len(pairs)} entries; at most {MAX_LOGIT_BIAS}", param="logit_bias")
            out["logit_bias"] = pairs or None
        return out

    def _why(self) -> str:
        if self.max_context < self.model_context:
            return f" (its context is {self.model_context}; this server's KV cache holds {self.max_context})"
        return ""

    def completion_prompt(self, body: dict) -> list:
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]
        if isinstance(p, str):
            if not p:
                raise ApiError(400, "'prompt' is empty", param="prompt")
            return self.encode(p, "prompt")
        if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            bad = [t for t in p if not 0 <= t < self.vocab_size]
            if bad:
                raise ApiError(400, f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})",
                               param="prompt")
            return list(p)
        raise ApiError(400, "'prompt' must be a non-empty string or a list of token ids (one prompt per request)",
                       param="prompt")

    def chat_prompt(self, body: dict, tools=None) -> list:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise ApiError(400, "'messages' must be a non-empty list", param="messages")
        clean = []
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant", "tool"):
                raise ApiError(400, f"messages[{i}] needs a role of system, developer, user, assistant or tool",
                               param=f"messages[{i}].role")
            c = m.get("content")
            if c is None and m["role"] == "assistant" and m.get("tool_calls"):
                c = ""                         # an assistant turn that only called tools
            if isinstance(c, list):
                if not all(isinstance(x, dict) and x.get("type") == "text" and isinstance(x.get("text"), str) for x in c):
                    raise ApiError(400, f"messages[{i}].content: only text parts are supported",
                                   param=f"messages[{i}].content")
                c = "".join(x["text"] for x in c)
            if not isinstance(c, str):
                raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts",
                               param=f"messages[{i}].content")
            item = {"role": m["role"], "content": c}
            if m.get("tool_calls") is not None:
                if not isinstance(m["tool_calls"], list):
                    raise ApiError(400, f"messages[{i}].tool_calls must be a list", param=f"messages[{i}].tool_calls")
                # templates read a call's arguments as an object (most) or its JSON text: give the object
                item["tool_calls"] = [{**tc, "function": {**tc["function"], "arguments": _args(tc["function"])}}
                                      if isinstance(tc, dict) and isinstance(tc.get("function"), dict) else tc
                                      for tc in m["tool_calls"]]
            for k in ("tool_call_id", "name"):
                if isinstance(m.get(k), str):
                    item[k] = m[k]
            clean.append(item)
        try:
            text = self.chat.render(clean, tools.template_tools() if tools is not None else None)
        except ValueError as e:
            raise ApiError(400, str(e), param="messages") from None
        return self.encode(text, "messages")

    @functools.cached_property
    def tool_format(self):
        """The family's tool-call format, by the markers its chat template writes (tools.FORMATS); read on every
        streamed token of a tools choice, found once."""
        from .tools import tool_format
        return tool_format(self.chat.template_text)

    def encode(self, text: str, param: str) -> list:
        """Text -> ids; refuses text that cannot be valid UTF-8 (lone surrogates) and text too long for the
        context without tokenizing all of it: past 64 characters per token nothing fits (beyond any
        vocabulary's tokens); below that, growing prefixes are counted first (the context's length in
        characters, then doubling), and one that already has more tokens than the context proves the whole text
        too long. So a refused prompt costs the tokenizer at most about twice the context in tokens, not the
        prompt's, and at most ``TOKENIZE_AT_ONCE`` requests tokenize at a time (the work is CPU-bound: more at
        once only holds more memory): 48 prompts of 64x the context once took the front-end from 58 to 709 MB,
        holding every one's full encoding."""
        limit = self.max_context
        too_long = ApiError(400, f"'{param}' has {len(text):,} characters: more than this model's context of "
                                 f"{limit} tokens can hold", param=param, code="context_length_exceeded")
        if len(text) > 64 * limit:
            raise too_long
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ApiError(400, f"'{param}' is not valid Unicode text ({e.reason} at position {e.start})",
                           param=param) from None
        with self._tokenizing:
            n = limit + 1                 # a token has a character at least: shorter text always fits
            while n < len(text):
                # a prefix ends inside at most one pre-token of the whole text: its count exceeds the whole's share
                # of that prefix by that piece at most (the margin)
                if len(self.tok.encode(text[:n])) > limit + PREFIX_MARGIN:
                    raise too_long
                n *= 2
            return self.tok.encode(text)



# -- the HTTP layer ---------------------------------------------------------------------------------
class _ClientGone(Exception):
    pass


def _protocol_class(timeout: float):
    """uvicorn's h11 protocol with what it lacks: a deadline for a request's headers (a client
    that trickles them - slowloris - is cut after ``timeout`` seconds) and JSON for the 400 it
    sends on malformed HTTP."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Protocol(H11Protocol):
        def connection_made(self, transport):
            super().connection_made(transport)
            # uvicorn writes a response's head and body separately: without TCP_NODELAY, Nagle and
            # the client's delayed ACK hold the body ~40 ms on every keep-alive request.
            sock = transport.get_extra_info("socket")
            if sock is not None:
                try:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                except OSError:
                    pass
            self._arm()

        def _arm(self):
            self._disarm()
            self._hdr_timer = self.loop.call_later(timeout, self._too_slow)

        def _disarm(self):
            t = getattr(self, "_hdr_timer", None)
            if t is not None:
                t.cancel()
                self._hdr_timer = None

        def _too_slow(self):
            self._hdr_timer = None
            if not self.transport.is_closing():
                self.transport.close()

        def handle_events(self):
            before = self.cycle
            super().handle_events()
            if self.cycle is not before:        # a request's headers are complete
                self._disarm()

        def on_response_complete(self):
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()                     # the next request's headers get the same deadline

        def connection_lost(self, exc):
            self._disarm()
            super().connection_lost(exc)

        def send_400_response(self, msg: str) -> None:
            import h11
            data = json.dumps(ApiError(400, f"malformed HTTP request: {msg}").body()).encode()
            for ev in (h11.Response(status_code=400, headers=[(b"content-type", b"application/json"),
                                                              (b"content-length", str(len(data)).encode()),
                                                              (b"connection", b"close")], reason=b"Bad Request"),
                       h11.Data(data=data), h11.EndOfMessage()):
                try:
                    self.transport.write(self.conn.send(ev))
                except Exception:  # noqa: BLE001 - h11 refuses in some broken states: just close
                    break
            self.transport.close()

    return Protocol


def _uvicorn(app, timeout: float):
    import uvicorn
    cfg = uvicorn.Config(app, http=_protocol_class(timeout), lifespan="off", log_level="warning", access_log=False,
                         server_header=False, timeout_keep_alive=int(max(1, timeout)), timeout_graceful_shutdown=2,
                         h11_max_incomplete_event_size=64 * 1024, ws="none")
    return uvicorn.Server(cfg)


class _Sink:
    """What the engine client's receiver thread puts into: hands each item to the request's
    asyncio queue on the server's event loop."""

    def __init__(self, loop, q: asyncio.Queue) -> None:
        self.loop, self.q = loop, q

    def put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.q.put_nowait, item)
        except RuntimeError:   # the server's loop is closed (shutting down): nobody waits for this any more
            pass


def _json(status: int, body, headers=None):
    from starlette.responses import Response
    return Response(json.dumps(body), status_code=status, media_type="application/json",
                    headers={"server": "tiered-moe", **(headers or {})})


class _Routes:
    """The endpoints, as Starlette handlers over the Server's validation and engine client."""

    def __init__(self, srv: "Server") -> None:
        self.srv = srv

    # -- plumbing ----------------------------------------------------------------------------------
    def auth(self, request) -> None:
        key = self.srv.api_key
        if key is None:
            return
        got = request.headers.get("authorization", "")
        if not (got.startswith("Bearer ") and hmac.compare_digest(got[7:].encode(), key.encode())):
            raise ApiError(401, "Incorrect API key provided", code="invalid_api_key")

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
        or 3 of its longest step), or when its last requests all failed."""
        e = self.srv.engine
        silent = time.monotonic() - e.last_heard
        if not e.alive:
            return _json(503, {"status": "engine restarting", "last_exit": e.last_exit, "restarts": e.restarts})
        if silent > max(HEALTH_SILENCE_S, 3 * e.slowest_step):
            return _json(503, {"status": "engine not answering", "silent_seconds": round(silent, 1),
                               "restarts": e.restarts})
        if self.srv.failing >= HEALTH_FAILURES:
            return _json(503, {"status": "engine failing requests", "failed_in_a_row": self.srv.failing,
                               "restarts": e.restarts})
        return _json(200, {"status": "ok", "restarts": e.restarts})

    async def metrics(self, request):
        from prometheus_client import CONTENT_TYPE_LATEST
        from starlette.responses import Response
        return Response(self.srv.metrics.render(), media_type=CONTENT_TYPE_LATEST, headers={"server": "tiered-moe"})

    async def models(self, request):
        self.auth(request)
        a = self.srv
        return _json(200, {"object": "list", "data": [{"id": a.model_name, "object": "model", "created": a.created,
                                                       "owned_by": "tiered-moe", "max_model_len": a.max_context}]})

    async def model(self, request):
        self.auth(request)
        a = self.srv
        m = request.path_params["model"]
        if m != a.model_name:
            raise ApiError(404, f"The model '{m}' does not exist; this server serves '{a.model_name}'", param="model",
                           code="model_not_found")
        return _json(200, {"id": a.model_name, "object": "model", "created": a.created, "owned_by": "tiered-moe",
                           "max_model_len": a.max_context})

    async def generate(self, request, chat: bool):
        from starlette.concurrency import run_in_threadpool
        a = self.srv
        self.auth(request)
        body = await self.body(request)
        a.check_model(body)
        refuse_unsupported(body)
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
        include_usage = bool(so.get("include_usage", False))
        stops = stop_strings(body)
        from .tools import parse_tools
        tools = parse_tools(body) if chat else None
        # Tokenizing (and rendering a chat template) can take a while: off the event loop.
        prompt = await (run_in_threadpool(a.chat_prompt, body, tools) if chat else
                        run_in_threadpool(a.completion_prompt, body))
        params = a.sampling(body, len(prompt), None if chat else 16)
        if tools is not None and tools.grammar() is not None:
            if "grammar" in params:
                raise ApiError(400, "'response_format' cannot be combined with a required or named 'tool_choice'",
                               param="response_format")
            params["grammar"] = tools.grammar()
        keep = frozenset()
        # a gpt-oss chat reply that is not held to required / named calls' JSON: split by its channels
        harmony = chat and a.tool_format.name == "harmony" and (tools is None or tools.choice == "auto")
        if harmony or (tools is not None and tools.choice == "auto"):
            from .tools import keep_tokens, trigger
            fmt = a.tool_format
            keep = keep_tokens(fmt, a.tok)     # its markers stay in the text: the parser (or harmony's split) reads them
            if tools is not None and tools.choice == "auto" and "grammar" not in params:
                params["trigger"] = trigger(fmt, tools, a.tok)   # response_format constrains everything already
        n = params.pop("n")
        k = params.get("logprobs")
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        t0 = time.monotonic()
        evs = []
        try:
            for i in range(n):
                # n choices: n engine requests (a seed gives each its own: seed + i)
                p = dict(params, seed=None if params["seed"] is None else (params["seed"] + i) % (1 << 63))
                q: asyncio.Queue = asyncio.Queue()
                sub = rid if n == 1 else f"{rid}-{i}"
                try:
                    # waits (bounded) for an engine that is being restarted: in the pool, not on the loop
                    await run_in_threadpool(a.engine.submit, sub, prompt, p, _Sink(asyncio.get_running_loop(), q))
                except EngineError as e:
                    raise ApiError(503, str(e), type="server_error", code="engine_unavailable") from None
                evs.append(_Events(a, q, Detokenizer(a.tok, stops, keep), t0, sub, index=i))
                a.open_requests += 1
        except BaseException:
            for ev in evs:
                ev.close()
            raise
        a.metrics.prompt_tokens.inc(len(prompt) * n)
        ch = _Choices(a, evs, chat, len(prompt), k, tools, harmony)
        if stream:
            return _Stream(a, ch, include_usage)
        try:
            return _json(200, await ch.collect(request))
        finally:
            ch.close()


def _args(fn: dict):
    """A tool call's arguments as an object where they are JSON text (what chat templates expect)."""
    a = fn.get("arguments")
    if isinstance(a, str):
        try:
            return json.loads(a)
        except ValueError:
            return a
    return a


def _logprobs(body: dict) -> "int | None":
    """How many alternatives per token the body asks log-probabilities of: chat's ``logprobs`` (a boolean)
    with ``top_logprobs``; the completions API's ``logprobs`` (an integer). None: none asked for."""
    from ..engine.request import MAX_LOGPROBS
    lp = body.get("logprobs")
    if "messages" in body:
        if lp is not None and not isinstance(lp, bool):
            raise ApiError(400, "'logprobs' must be a boolean", param="logprobs")
        top = number(body, "top_logprobs", None, lo=0, hi=MAX_LOGPROBS, integer=True)
        if top is not None and not lp:
            raise ApiError(400, "'top_logprobs' needs \"logprobs\": true", param="top_logprobs")
        return (top or 0) if lp else None
    if isinstance(lp, bool):
        raise ApiError(400, "'logprobs' must be an integer (how many alternatives per token)", param="logprobs")
    return number(body, "logprobs", None, lo=0, hi=MAX_LOGPROBS, integer=True)


class _Events:
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

    async def __aiter__(self):
        """Yields (delta, finish_reason or None, the log-probabilities of the tokens since the last delta)."""
        a = self.srv
        while True:
            try:
                kind, payload, when = await asyncio.wait_for(self.q.get(), 0.25)
            except asyncio.TimeoutError:
                if self.watch is not None and self.watch.done():
                    raise _ClientGone() from None
                continue
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
            tok, reason, lp = payload
            m = a.metrics
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
            delta, hit_stop = self.detok.push(tok)
            if hit_stop:
                reason = "stop"
            if reason is not None:
                a.failing = 0
                delta += self.detok.finish()
                m.requests.labels(reason).inc()
                self.finished = True
                m.e2e.observe(when - self.t0)
                a.engine.release(self.rid)
                self.open = hit_stop   # the engine still runs a request cut by a stop string: abort it
                yield delta, reason, self._take()
                return
            if delta:
                yield delta, None, self._take()

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


class _Logprobs:
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
            out["top_logprobs"].append({self.text(i): v for i, v in top} if self.k else None)
            out["text_offset"].append(self.offset)
            self.offset += len(t)
        return out


class _Choices:
    """A request's ``n`` choices (n engine requests): collected together, or merged into one stream."""

    def __init__(self, srv: "Server", evs: list, chat: bool, n_prompt: int, k: "int | None", tools=None,
                 harmony: bool = False) -> None:
        self.srv, self.evs, self.chat, self.n_prompt, self.tools = srv, evs, chat, n_prompt, tools
        self.harmony = harmony      # a gpt-oss chat reply: channels split into reasoning, content and calls
        self.rid = evs[0].rid.rsplit("-", 1)[0] if len(evs) > 1 else evs[0].rid
        self.lp = [_Logprobs(srv.tok, chat, k) if k is not None else None for _ in evs]

    def message(self, text: str, finish: str) -> "tuple[str | None, list, str]":
        """(content, tool_calls, finish_reason) of a chat choice: its text, or the tool calls in it."""
        t = self.tools
        if self.harmony:
            content, calls = self.srv.tool_format.parse(text, t.functions if t is not None else [])
            if t is None or finish != "stop":
                return content, [], finish
            return (content.strip() or None) if calls else content, calls, "tool_calls" if calls else finish
        if t is None or finish != "stop":
            return text, [], finish
        from .tools import constrained_calls, parse_auto
        if t.choice in ("required", "named"):
            try:
                return None, constrained_calls(t, text), "tool_calls"
            except (ValueError, KeyError, TypeError):     # cut by a stop string: not whole JSON - the text as it is
                return text, [], finish
        content, calls = parse_auto(self.srv.tool_format, text, t.functions)
        return content, calls, "tool_calls" if calls else finish

    def progress(self, index: int, held: dict) -> "tuple[str, dict]":
        """A streamed tools choice's news: (content not yet sent, {"tool_calls": deltas} or {}), from the text its detokenizer
        has released (stop strings held back). ``held``: what was sent - content characters, and per call
        [id, name, arguments sent]."""
        from .tools import _call, stream_spans, streamable_arguments
        t, ev = self.tools, next(e for e in self.evs if e.index == index)
        fmt = self.srv.tool_format
        text = ev.detok.text[:ev.detok.sent]
        safe = self.open_content(text)
        delta = safe[held["sent"]:]
        held["sent"] = max(held["sent"], len(safe))
        spans = stream_spans(t, fmt, text) or []
        out, sent = [], held["calls"]
        for i, (name, a, b) in enumerate(spans):
            args = streamable_arguments(text, a, b, fmt.close if t.choice == "auto" else "")
            if i == len(sent):
                c = _call(name, args)
                sent.append([c["id"], name, args])
                out.append({"index": i, **c})
            elif len(args) > len(sent[i][2]) and args.startswith(sent[i][2]):
                out.append({"index": i, "function": {"arguments": args[len(sent[i][2]):]}})
                sent[i][2] = args
        return delta, ({"tool_calls": out} if out else {})

    def harmony_progress(self, index: int, held: dict) -> "tuple[str, dict]":
        """A streamed harmony choice's news: (content, {"reasoning_content": ...} or {}) not yet sent, from the
        released text."""
        from .harmony import split
        ev = next(e for e in self.evs if e.index == index)
        h = split(ev.detok.text[:ev.detok.sent])
        r, c = h.reasoning[held["r"]:], h.content[held["sent"]:]
        held["r"], held["sent"] = max(held["r"], len(h.reasoning)), max(held["sent"], len(h.content))
        return c, ({"reasoning_content": r} if r else {})

    def open_content(self, text: str) -> str:
        """What of a tools choice's text is content for sure: the text before its format's opening marker (less a
        tail that may be the marker's start); nothing for required / named calls or a format without one."""
        opener = self.srv.tool_format.trigger if self.tools.choice == "auto" else None
        if opener is None:
            return ""
        i = text.find(opener)
        if i >= 0:
            return text[:i]
        for n in range(min(len(opener) - 1, len(text)), 0, -1):
            if opener.startswith(text[-n:]):
                return text[:-n]
        return text

    def usage(self) -> dict:
        n = sum(ev.n for ev in self.evs)
        return {"prompt_tokens": self.n_prompt, "completion_tokens": n, "total_tokens": self.n_prompt + n}

    def watch(self, receive) -> "asyncio.Future":
        """One task that ends when the client disconnects, for every choice."""
        gone = asyncio.ensure_future(_disconnect(receive))
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
                    raise _ClientGone()
            return "length"
        try:
            finishes = await asyncio.gather(*(one(ev) for ev in self.evs))
        finally:
            gone.cancel()
        a, choices = self.srv, []
        for ev, finish, lp in zip(self.evs, finishes, self.lp):
            logprobs = lp.format(ev.logprobs) if lp is not None else None
            if self.chat:
                content, calls, finish = self.message(ev.detok.text, finish)
                msg = {"role": "assistant", "content": content}
                if calls:
                    msg["tool_calls"] = calls
                if self.harmony:
                    from .harmony import split
                    reasoning = split(ev.detok.text).reasoning
                    if reasoning:
                        msg["reasoning_content"] = reasoning     # vLLM's field for a reasoning model's thinking
                choices.append({"index": ev.index, "message": msg, "logprobs": logprobs, "finish_reason": finish})
            else:
                choices.append({"index": ev.index, "text": ev.detok.text, "logprobs": logprobs, "finish_reason": finish})
        return {"id": self.rid, "object": "chat.completion" if self.chat else "text_completion",
                "created": int(time.time()), "model": a.model_name, "choices": choices, "usage": self.usage()}

    async def merged(self):
        """Every choice's (index, delta, finish_reason, logprobs entries) as they come; an error ends it."""
        q: asyncio.Queue = asyncio.Queue()

        async def pump(ev):
            try:
                async for delta, finish, lps in ev:
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


async def _disconnect(receive) -> None:
    """Returns when the client disconnects (after the request body, receive() yields nothing else)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class _Stream:
    """Server-sent events as a raw ASGI response: every write has a deadline (a client that stops
    reading is cut and its request aborted), and a disconnect stops the request at once."""

    def __init__(self, srv: "Server", ch: _Choices, include_usage: bool) -> None:
        self.srv, self.ch, self.include_usage = srv, ch, include_usage

    def tool_chunk(self, chunk, index: int, finish: str, held: dict) -> dict:
        """A tools choice's last chunk: the content not yet sent, what its calls' streamed deltas left out (the
        calls of a format that does not stream them, whole), with every log-probability held back."""
        ev = next(e for e in self.ch.evs if e.index == index)
        content, calls, finish = self.ch.message(ev.detok.text, finish)
        rest = (content or "")[held["sent"]:] if calls else ev.detok.text[held["sent"]:]
        out = chunk(index, rest, finish, held["lps"])
        if calls:
            deltas, sent = [], held["calls"]
            for i, c in enumerate(calls):
                fn = c["function"]
                if i < len(sent) and sent[i][1] == fn["name"] and fn["arguments"].startswith(sent[i][2]):
                    if len(fn["arguments"]) > len(sent[i][2]):
                        deltas.append({"index": i, "function": {"arguments": fn["arguments"][len(sent[i][2]):]}})
                else:        # not streamed (or, never expected, streamed otherwise): the call whole, at a new index
                    deltas.append({"index": max(i, len(sent)), **c})
                    sent.append([c["id"], fn["name"], fn["arguments"]])
            out["choices"][0]["delta"] = {**({"content": rest} if rest.strip() else {}),
                                          **({"tool_calls": deltas} if deltas else {})}
        return out

    def harmony_chunk(self, chunk, index: int, finish: str, held: dict) -> dict:
        """A harmony choice's last chunk: the reasoning and content not yet sent, its tool calls whole."""
        from .harmony import split
        ev = next(e for e in self.ch.evs if e.index == index)
        content, calls, finish = self.ch.message(ev.detok.text, finish)
        out = chunk(index, (content or "")[held["sent"]:], finish, held["lps"])
        d = out["choices"][0]["delta"]
        rest = split(ev.detok.text).reasoning[held["r"]:]
        if rest:
            d["reasoning_content"] = rest
        if calls:
            d["tool_calls"] = [{"index": i, **c} for i, c in enumerate(calls)]
        return out

    async def __call__(self, scope, receive, send) -> None:
        a, ch = self.srv, self.ch
        chat = ch.chat
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        # The disconnect watch the events loop checks while it waits (as for a non-streaming request).
        watch = ch.watch(receive)

        async def event(data) -> None:
            if watch.done():
                raise _ClientGone()
            payload = b"data: " + (data if isinstance(data, bytes) else json.dumps(data).encode()) + b"\n\n"
            try:
                await asyncio.wait_for(send({"type": "http.response.body", "body": payload, "more_body": True}),
                                       a.timeout)
            except asyncio.TimeoutError:
                raise _ClientGone() from None

        def chunk(index, delta, finish, lps, first=False) -> dict:
            base = {"id": ch.rid, "object": obj, "created": created, "model": a.model_name}
            lp = ch.lp[index].format(lps) if ch.lp[index] is not None and lps else None
            if chat:
                d = {"role": "assistant", "content": delta} if first else ({"content": delta} if delta or not finish else {})
                c = {"index": index, "delta": d, "logprobs": lp, "finish_reason": finish}
            else:
                c = {"index": index, "text": delta, "logprobs": lp, "finish_reason": finish}
            out = {**base, "choices": [c]}
            if self.include_usage:
                out["usage"] = None
            return out

        try:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
                                    (b"server", b"tiered-moe")]})
            if chat:
                for ev in ch.evs:
                    await event(chunk(ev.index, "", None, [], first=True))
            held = {ev.index: {"sent": 0, "r": 0, "lps": [], "calls": []} for ev in ch.evs}
            harmony = ch.harmony
            try:
                async for index, delta, finish, lps in ch.merged():
                    if harmony or (ch.tools is not None and chat):
                        # gpt-oss: the analysis channel streams as reasoning_content, the final one as content. Tools:
                        # the content before the format's opening marker streams, then each call: its id and name,
                        # then its arguments as they are written (OpenAI's deltas); a format without spans (and
                        # harmony) sends its calls whole at the end.
                        h = held[index]
                        h["lps"] += lps
                        if finish:
                            last = self.harmony_chunk if harmony else self.tool_chunk
                            await event(last(chunk, index, finish, h))
                            continue
                        text, extra = ch.harmony_progress(index, h) if harmony else ch.progress(index, h)
                        if text or extra:
                            c = chunk(index, text, None, h["lps"])
                            c["choices"][0]["delta"].update(extra)
                            await event(c)
                            h["lps"] = []
                        continue
                    if delta or finish:
                        await event(chunk(index, delta, finish, lps))
            except ApiError as e:
                await event(e.body())   # headers are gone: the error travels as an event, as OpenAI does
            if self.include_usage:
                await event({"id": ch.rid, "object": obj, "created": created, "model": a.model_name, "choices": [],
                             "usage": ch.usage()})
            await event(b"[DONE]")
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except (_ClientGone, OSError):
            pass
        finally:
            watch.cancel()
            ch.close()


def _app_for(srv: "Server"):
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.routing import Route
    r = _Routes(srv)

    async def api_error(request, exc: ApiError):
        return _json(exc.status, exc.body(), {"connection": "close"} if exc.status in (408, 411, 413) else None)

    async def http_error(request, exc: HTTPException):
        msg = f"{request.method} {request.url.path}: {'method not allowed' if exc.status_code == 405 else exc.detail.lower()}"
        return _json(exc.status_code, ApiError(exc.status_code, msg).body())

    async def gone(request, exc):
        from starlette.responses import Response
        return Response(b"", status_code=499)     # nobody is there to read it

    async def crash(request, exc: Exception):
        print(f"tiered-moe: {request.method} {request.url.path}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return _json(500, ApiError(500, f"internal error: {type(exc).__name__}", type="server_error").body())

    routes = [Route("/health", r.health, methods=["GET"]), Route("/metrics", r.metrics, methods=["GET"]),
              Route("/v1/models", r.models, methods=["GET"]),
              Route("/v1/models/{model:path}", r.model, methods=["GET"]),
              Route("/v1/completions", functools.partial(r.generate, chat=False), methods=["POST"]),
              Route("/v1/chat/completions", functools.partial(r.generate, chat=True), methods=["POST"])]
    app = Starlette(routes=routes, exception_handlers={ApiError: api_error, HTTPException: http_error,
                                                       _ClientGone: gone, Exception: crash})
    app.router.redirect_slashes = False       # its 307 echoed the request's Host header; a wrong path is a 404
    return _HostCheck(app, srv.allowed_hosts)


def _loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


class _HostCheck:
    """ASGI wrapper: a request whose Host header names none of ``allowed`` gets a 403 (a page on evil.example whose
    name an attacker re-points at 127.0.0.1 - DNS rebinding - sends Host: evil.example). None: no check."""

    def __init__(self, app, allowed: "set | None") -> None:
        self.app, self.allowed = app, allowed

    async def __call__(self, scope, receive, send):
        if self.allowed is not None and scope["type"] == "http":
            host = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"host"), None)
            if host is not None:
                name = host.rsplit("]", 1)[0].lstrip("[") if host.startswith("[") else host.rsplit(":", 1)[0]
                if name.lower() not in self.allowed:
                    body = json.dumps(ApiError(403, f"Host {host[:100]!r} is not one this server answers to (DNS "
                                                    f"rebinding protection); start it with --allowed-host {name[:60]}",
                                               code="host_not_allowed").body()).encode()
                    await send({"type": "http.response.start", "status": 403,
                                "headers": [(b"content-type", b"application/json"), (b"server", b"tiered-moe"),
                                            (b"content-length", str(len(body)).encode())]})
                    await send({"type": "http.response.body", "body": body})
                    return
        await self.app(scope, receive, send)
