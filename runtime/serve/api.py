"""OpenAI-compatible HTTP front-end (the subset vLLM and llama.cpp serve), on the standard
library's threaded HTTP server: one thread per connection, each waiting on its request's queue
while the engine process decodes.

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (server-sent events
with ``"stream": true``, usage with ``stream_options.include_usage``), GET /health, GET /metrics.
Errors use OpenAI's object ``{"error": {"message", "type", "param", "code"}}`` - for every status,
malformed requests and unknown methods included.

Hostile input fails alone: sampling values are checked against what the engine and the wire
format take (integers within int64; temperatures below 1e-5 are greedy, as in vLLM), a body that
is not JSON, nests too deep or carries lone surrogates is a 400, an error in the engine fails that
request with a 500 naming the cause, and any other exception is a 500 for that request. Sockets
have a read/write timeout (``timeout``), responses go out with TCP_NODELAY, a non-streaming client
that disconnects has its request aborted, and so does a stream whose client stops reading
(its writes time out).
"""
from __future__ import annotations

import hmac
import json
import queue
import select
import socket
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from .chat import ChatFormatter
from .client import EngineClient, EngineError
from .metrics import ServerMetrics

MAX_BODY = 8 << 20
INT64 = 1 << 63           # integers that cross the msgpack wire as int64


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param: "str | None" = None, code: "str | None" = None,
                 type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# -- request validation --------------------------------------------------------------------------
def _num(body: dict, name: str, default, lo=None, hi=None, integer=False, lo_open=False):
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int if integer else (int, float)):
        raise ApiError(400, f"'{name}' must be {'an integer' if integer else 'a number'}, got {json.dumps(v)[:80]}",
                       param=name)
    if not integer and v != v or v in (float("inf"), float("-inf")):
        raise ApiError(400, f"'{name}' must be a finite number", param=name)
    if integer and not -INT64 <= v < INT64:
        raise ApiError(400, f"'{name}' must fit in a signed 64-bit integer, got {v}", param=name)
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise ApiError(400, f"'{name}' must be {'>' if lo_open else '>='} {lo}, got {v}", param=name)
    if hi is not None and v > hi:
        raise ApiError(400, f"'{name}' must be <= {hi}, got {v}", param=name)
    return v


def _stops(body: dict) -> list:
    s = body.get("stop")
    if s is None:
        return []
    if isinstance(s, str):
        s = [s]
    if not isinstance(s, list) or not all(isinstance(x, str) and x for x in s) or len(s) > 4:
        raise ApiError(400, "'stop' must be a non-empty string or a list of up to 4 non-empty strings", param="stop")
    return s


def _unsupported(body: dict) -> None:
    if body.get("n", 1) != 1:
        raise ApiError(400, "only n=1 is supported", param="n")
    if body.get("echo"):
        raise ApiError(400, "'echo' is not supported", param="echo")
    for name in ("logprobs", "top_logprobs", "best_of"):
        if body.get(name) not in (None, False, 0, 1 if name == "best_of" else 0):
            raise ApiError(400, f"'{name}' is not supported", param=name)
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            raise ApiError(400, f"'{name}' is not supported (only 0)", param=name)


class Detokenizer:
    """Token ids -> text deltas, incrementally: each token decodes only a short window of the
    latest ids (from ``prefix``, a few tokens back, so merges across token boundaries come out
    right), never the whole output again. Holds back a trailing incomplete UTF-8 sequence (decoded
    as U+FFFD) and, with stop strings, the last few characters that could start one."""

    def __init__(self, tok, stops: list) -> None:
        self.tok, self.stops = tok, stops
        self.ids: list = []
        self.prefix = 0          # ids[prefix:read] decode to text already appended
        self.read = 0
        self.text = ""           # everything decoded so far
        self.sent = 0            # characters of text already returned
        self.hold = max((len(s) for s in stops), default=1) - 1

    def _decode_new(self) -> None:
        prev = self.tok.decode(self.ids[self.prefix:self.read])
        cur = self.tok.decode(self.ids[self.prefix:])
        if cur.endswith("\ufffd"):
            return                                   # an incomplete character: wait for more tokens
        self.text += cur[len(prev):]
        self.prefix, self.read = max(self.read - 4, 0), len(self.ids)

    def push(self, tid: int) -> "tuple[str, bool]":
        """Returns (delta, hit a stop string)."""
        self.ids.append(tid)
        self._decode_new()
        for s in self.stops:
            i = self.text.find(s, max(0, self.sent - len(s)))
            if i >= 0:
                self.text = self.text[:i]
                return self._flush(), True
        end = len(self.text) - self.hold
        if end <= self.sent:
            return "", False
        d = self.text[self.sent:end]
        self.sent = end
        return d, False

    def _flush(self) -> str:
        d = self.text[self.sent:]
        self.sent = len(self.text)
        return d

    def finish(self) -> str:
        if self.read < len(self.ids):                # a trailing incomplete character: as U+FFFD
            self.text += self.tok.decode(self.ids[self.prefix:])[len(self.tok.decode(self.ids[self.prefix:self.read])):]
            self.read = len(self.ids)
        return self._flush()


class Server:
    """Engine client + HTTP server. ``start()`` returns once both listen; ``close()`` stops both."""

    def __init__(self, cfg, *, host: str = "127.0.0.1", port: int = 8000, api_key: "str | None" = None,
                 served_model_name: "str | None" = None, startup_timeout: float = 300.0, timeout: float = 60.0,
                 heartbeat_timeout: float = 60.0, restart_wait: float = 60.0, max_body: int = MAX_BODY) -> None:
        from ..tokenizer import Tokenizer
        self.cfg, self.api_key = cfg, api_key
        self.tok = Tokenizer(cfg.model)
        if not self.tok.available:
            raise ValueError(f"{cfg.model}: no tokenizer.json; serving needs the checkpoint's tokenizer")
        self.chat = ChatFormatter(cfg.model)
        self.metrics = ServerMetrics()
        self.timeout, self.max_body = timeout, max_body
        self.engine = EngineClient(cfg, metrics=self.metrics, startup_timeout=startup_timeout,
                                   heartbeat_timeout=heartbeat_timeout, restart_wait=restart_wait)
        self.model_name = served_model_name or self.engine.info["model"]
        self.max_context = self.engine.info["max_context"]
        self.vocab_size = self.engine.info["vocab_size"]
        self.created = int(time.time())
        try:
            self.httpd = _HTTPServer((host, port), _Handler)
        except OSError as e:
            self.engine.close()
            raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}") from None
        self.httpd.app = self
        self.httpd.timeout_s = timeout
        self.host, self.port = self.httpd.server_address[:2]
        self._thread = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> "Server":
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.1},
                                        name="tiered-moe-http", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self.httpd.serve_forever(poll_interval=0.1)

    def close(self) -> None:
        if self._thread is not None:
            self.httpd.shutdown()
            self._thread.join(5)
        self.httpd.server_close()
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
        else:
            max_tokens = _num({name: max_tokens}, name, None, lo=1, integer=True)
        if prompt_len + max_tokens > self.max_context:
            raise ApiError(400, f"This model's maximum context length is {self.max_context} tokens. However, you "
                                f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} "
                                f"for the completion).", param="messages" if "messages" in body else "prompt",
                           code="context_length_exceeded")
        temp = _num(body, "temperature", 1.0, lo=0, hi=2)
        top_p = _num(body, "top_p", 1.0, lo=0, hi=1, lo_open=True)
        top_k = _num(body, "top_k", 0, lo=-1, integer=True)
        seed = _num(body, "seed", None, integer=True)
        return {"max_tokens": int(max_tokens), "temperature": float(temp), "top_p": float(top_p),
                "top_k": 0 if top_k == -1 else int(top_k), "seed": seed}

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

    def chat_prompt(self, body: dict) -> list:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise ApiError(400, "'messages' must be a non-empty list", param="messages")
        clean = []
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant", "tool"):
                raise ApiError(400, f"messages[{i}] needs a role of system, developer, user, assistant or tool",
                               param=f"messages[{i}].role")
            c = m.get("content")
            if isinstance(c, list):
                if not all(isinstance(x, dict) and x.get("type") == "text" and isinstance(x.get("text"), str) for x in c):
                    raise ApiError(400, f"messages[{i}].content: only text parts are supported",
                                   param=f"messages[{i}].content")
                c = "".join(x["text"] for x in c)
            if not isinstance(c, str):
                raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts",
                               param=f"messages[{i}].content")
            clean.append({"role": m["role"], "content": c})
        try:
            text = self.chat.render(clean)
        except ValueError as e:
            raise ApiError(400, str(e), param="messages") from None
        return self.encode(text, "messages")

    def encode(self, text: str, param: str) -> list:
        """Text -> ids; refuses text that cannot be valid UTF-8 (lone surrogates) and text so long
        that it cannot fit the context whatever the tokenizer does (64 characters per token is
        beyond any vocabulary's tokens), before spending the tokenizer's time on it."""
        if len(text) > 64 * self.max_context:
            raise ApiError(400, f"'{param}' has {len(text):,} characters: more than this model's context of "
                                f"{self.max_context} tokens can hold", param=param, code="context_length_exceeded")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ApiError(400, f"'{param}' is not valid Unicode text ({e.reason} at position {e.start})",
                           param=param) from None
        return self.tok.encode(text)


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128   # many clients connecting at once are queued, not refused

    def handle_error(self, request, client_address):
        import sys
        if isinstance(sys.exc_info()[1], (ConnectionResetError, BrokenPipeError, TimeoutError)):
            return   # a client went away between requests: not an error of ours
        super().handle_error(request, client_address)


class _ClientGone(Exception):
    pass


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "tiered-moe"

    def setup(self) -> None:
        # A read/write timeout per socket: slow or idle clients (slowloris, a stream nobody reads)
        # time out instead of holding a thread forever. TCP_NODELAY: a response's small writes go
        # out at once (Nagle + delayed ACK cost 40 ms per keep-alive request).
        self.timeout = getattr(self.server, "timeout_s", 60.0)
        super().setup()
        try:
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass

    def version_string(self) -> str:
        return self.server_version      # no Python version in the Server header

    def log_message(self, fmt, *args):   # quiet by default; access logs are not our job
        pass

    def send_error(self, code, message=None, explain=None):
        """The standard library's errors (bad request line, headers too long, unknown method) as
        OpenAI error objects, not HTML pages."""
        try:
            self.close_connection = True
            self._send(code, ApiError(code, message or self.responses.get(code, ("error",))[0]).body())
        except OSError:
            pass

    @property
    def app(self) -> Server:
        return self.server.app

    # -- plumbing ------------------------------------------------------------------------------
    def _send(self, status: int, body, ctype: str = "application/json") -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        # Headers and body in one write (one segment for small responses).
        self._headers_buffer.append(b"\r\n")
        head = b"".join(self._headers_buffer)
        self._headers_buffer = []
        self.wfile.write(head + (b"" if getattr(self, "command", None) == "HEAD" else data))

    def _error(self, e: ApiError) -> None:
        self._send(e.status, e.body())

    def _auth(self) -> None:
        key = self.app.api_key
        if key is None or not self.path.startswith("/v1"):
            return
        got = self.headers.get("Authorization", "")
        if not (got.startswith("Bearer ") and hmac.compare_digest(got[7:].encode(), key.encode())):
            raise ApiError(401, "Incorrect API key provided", code="invalid_api_key")

    def _body(self) -> dict:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            raise ApiError(411, "chunked request bodies are not accepted: send Content-Length")
        try:
            n = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            raise ApiError(400, "bad Content-Length header") from None
        if n < 0:
            raise ApiError(400, f"bad Content-Length header ({n})")
        if n > self.app.max_body:
            raise ApiError(413, f"request body of {n:,} bytes exceeds the limit of {self.app.max_body:,}")
        raw = self.rfile.read(n)
        if len(raw) < n:
            raise _ClientGone()
        try:
            body = json.loads(raw)
        except RecursionError:
            raise ApiError(400, "request body nests too deeply") from None
        except ValueError as e:
            raise ApiError(400, f"request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object")
        return body

    def _route(self, method: str) -> None:
        path = self.path.split("?", 1)[0]
        routes = {("GET", "/health"): self._health, ("GET", "/metrics"): self._metrics,
                  ("GET", "/v1/models"): self._models,
                  ("POST", "/v1/completions"): lambda: self._generate(chat=False),
                  ("POST", "/v1/chat/completions"): lambda: self._generate(chat=True)}
        try:
            fn = routes.get((method, path))
            if fn is None:
                known = any(p == path for _, p in routes)
                raise ApiError(405 if known else 404, f"{method} {path}: {'method not allowed' if known else 'not found'}")
            self._auth()
            fn()
        except ApiError as e:
            if method == "POST" and e.status >= 400 and not getattr(self, "_body_read", False):
                self.close_connection = True   # an unread body must not be parsed as the next request
            self._error(e)
        except (BrokenPipeError, ConnectionResetError, _ClientGone, TimeoutError, socket.timeout):
            self.close_connection = True
        except Exception as e:  # noqa: BLE001 - a bug of ours fails this request, not the server
            print(f"tiered-moe: {method} {path}: {type(e).__name__}: {e}", file=sys.stderr)
            self.close_connection = True
            try:
                self._error(ApiError(500, f"internal error: {type(e).__name__}", type="server_error"))
            except OSError:
                pass

    def do_GET(self):
        self._route("GET")

    def do_POST(self):
        self._route("POST")

    def _no_such_method(self):
        self._route(self.command)

    do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_HEAD = _no_such_method

    def _client_gone(self) -> bool:
        """Whether the client closed its connection (a readable socket with nothing to read). A
        client that pipelines its next request is still there."""
        try:
            r, _, _ = select.select([self.connection], [], [], 0)
            return bool(r) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    # -- endpoints -----------------------------------------------------------------------------
    def _health(self) -> None:
        e = self.app.engine
        if e.alive:
            self._send(200, {"status": "ok", "restarts": e.restarts})
        else:
            self._send(503, {"status": "engine restarting", "last_exit": e.last_exit, "restarts": e.restarts})

    def _metrics(self) -> None:
        from prometheus_client import CONTENT_TYPE_LATEST
        self._send(200, self.app.metrics.render(), CONTENT_TYPE_LATEST)

    def _models(self) -> None:
        a = self.app
        self._send(200, {"object": "list", "data": [{"id": a.model_name, "object": "model", "created": a.created,
                                                     "owned_by": "tiered-moe", "max_model_len": a.max_context}]})

    def _generate(self, chat: bool) -> None:
        a = self.app
        body = self._body()
        self._body_read = True
        a.check_model(body)
        _unsupported(body)
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise ApiError(400, "'stream' must be a boolean", param="stream")
        so = body.get("stream_options") or {}
        if not isinstance(so, dict):
            raise ApiError(400, "'stream_options' must be an object", param="stream_options")
        include_usage = bool(so.get("include_usage", False))
        stops = _stops(body)
        prompt = a.chat_prompt(body) if chat else a.completion_prompt(body)
        params = a.sampling(body, len(prompt), None if chat else 16)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        t0 = time.monotonic()
        try:
            q = a.engine.submit(rid, prompt, params)
        except EngineError as e:
            raise ApiError(503, str(e), type="server_error", code="engine_unavailable") from None
        a.metrics.prompt_tokens.inc(len(prompt))
        detok = Detokenizer(a.tok, stops)
        state = {"n": 0, "last": None, "first": None}
        try:
            if stream:
                self._stream(chat, rid, q, detok, state, t0, len(prompt), include_usage)
            else:
                finish = self._collect(q, detok, state, t0, rid)
                self._send(200, self._full(chat, rid, detok.text, finish, len(prompt), state["n"]))
        finally:
            if state.get("open", True):
                a.engine.abort(rid)   # frees a disconnected (or stop-string) request's KV and slot
            if not state.get("finished"):
                a.metrics.requests.labels("abort").inc()

    def _events(self, q, detok, state, t0, rid):
        """Yields (delta, finish_reason or None) as tokens arrive."""
        a = self.app
        while True:
            if not state.get("streaming") and time.monotonic() - state.get("checked", 0.0) > 0.25:
                state["checked"] = time.monotonic()
                if self._client_gone():
                    raise _ClientGone()        # nobody will read the answer: the caller aborts it
            try:
                kind, payload, when = q.get(timeout=0.25)
            except queue.Empty:
                continue
            if kind == "rejected":
                raise ApiError(400, payload)
            if kind == "failed":
                a.metrics.request_errors.labels("engine").inc()
                raise ApiError(500, f"the engine failed this request: {payload}", type="server_error",
                               code="engine_error")
            if kind == "dead":
                a.metrics.request_errors.labels("engine_exit").inc()
                raise ApiError(503, f"{payload}; it is being restarted - retry the request", type="server_error",
                               code="engine_unavailable")
            tok, reason = payload
            m = a.metrics
            if state["first"] is None:
                state["first"] = when
                m.ttft.observe(when - t0)
            else:
                m.itl.observe(when - state["last"])
            state["last"] = when
            state["n"] += 1
            m.generation_tokens.inc()
            delta, hit_stop = detok.push(tok)
            if hit_stop:
                reason = "stop"
            if reason is not None:
                delta += detok.finish()
                m.requests.labels(reason).inc()
                state["finished"] = True
                m.e2e.observe(when - t0)
                a.engine.release(rid)
                state["open"] = hit_stop   # the engine still runs a request cut by a stop string: abort it
                yield delta, reason
                return
            yield delta, None

    def _collect(self, q, detok, state, t0, rid) -> str:
        for _, reason in self._events(q, detok, state, t0, rid):
            if reason is not None:
                return reason
        return "length"

    def _full(self, chat, rid, text, finish, n_prompt, n_gen) -> dict:
        a = self.app
        usage = {"prompt_tokens": n_prompt, "completion_tokens": n_gen, "total_tokens": n_prompt + n_gen}
        if chat:
            return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": a.model_name,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                                 "finish_reason": finish}], "usage": usage}
        return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": a.model_name,
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}], "usage": usage}

    def _stream(self, chat, rid, q, detok, state, t0, n_prompt, include_usage) -> None:
        a = self.app
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

        def event(data) -> None:
            payload = b"data: " + (data if isinstance(data, bytes) else json.dumps(data).encode()) + b"\n\n"
            try:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(payload), payload))
                self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError, OSError):
                raise _ClientGone() from None

        def chunk(delta, finish, first=False) -> dict:
            base = {"id": rid, "object": obj, "created": created, "model": a.model_name}
            if chat:
                d = {"role": "assistant", "content": delta} if first else ({"content": delta} if delta or not finish else {})
                ch = {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}
            else:
                ch = {"index": 0, "text": delta, "logprobs": None, "finish_reason": finish}
            out = {**base, "choices": [ch]}
            if include_usage:
                out["usage"] = None
            return out

        state["streaming"] = True
        if chat:
            event(chunk("", None, first=True))
        try:
            for delta, finish in self._events(q, detok, state, t0, rid):
                if delta or finish:
                    event(chunk(delta, finish))
        except ApiError as e:
            event(e.body())   # headers are gone: the error travels as an event, as OpenAI does
        if include_usage:
            event({"id": rid, "object": obj, "created": created, "model": a.model_name, "choices": [],
                   "usage": {"prompt_tokens": n_prompt, "completion_tokens": state["n"],
                             "total_tokens": n_prompt + state["n"]}})
        event(b"[DONE]")
        try:
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError, OSError):
            raise _ClientGone() from None
