"""OpenAI-compatible HTTP front-end (the subset vLLM and llama.cpp serve), on the standard
library's threaded HTTP server: one thread per connection, each waiting on its request's queue
while the engine process decodes.

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (server-sent events
with ``"stream": true``, usage with ``stream_options.include_usage``), GET /health, GET /metrics.
Errors use OpenAI's object ``{"error": {"message", "type", "param", "code"}}``.
"""
from __future__ import annotations

import hmac
import json
import queue
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from .chat import ChatFormatter
from .client import EngineClient, EngineError
from .metrics import ServerMetrics

MAX_BODY = 16 << 20


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
        raise ApiError(400, f"'{name}' must be {'an integer' if integer else 'a number'}, got {json.dumps(v)}", param=name)
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
    """Token ids -> text deltas. Holds back a trailing incomplete UTF-8 sequence (decoded as
    U+FFFD) and, with stop strings, the last few characters that could start one."""

    def __init__(self, tok, stops: list) -> None:
        self.tok, self.stops = tok, stops
        self.ids: list = []
        self.sent = 0
        self.text = ""
        self.hold = max((len(s) for s in stops), default=1) - 1

    def push(self, tid: int) -> "tuple[str, bool]":
        """Returns (delta, hit a stop string)."""
        self.ids.append(tid)
        self.text = self.tok.decode(self.ids)
        for s in self.stops:
            i = self.text.find(s)
            if i >= 0:
                self.text = self.text[:i]
                return self._flush(), True
        end = len(self.text) - self.hold
        if self.text.endswith("\ufffd"):
            end = min(end, len(self.text) - 1)
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
        return self._flush()


class Server:
    """Engine client + HTTP server. ``start()`` returns once both listen; ``close()`` stops both."""

    def __init__(self, cfg, *, host: str = "127.0.0.1", port: int = 8000, api_key: "str | None" = None,
                 served_model_name: "str | None" = None, startup_timeout: float = 300.0) -> None:
        from ..tokenizer import Tokenizer
        self.cfg, self.api_key = cfg, api_key
        self.tok = Tokenizer(cfg.model)
        if not self.tok.available:
            raise ValueError(f"{cfg.model}: no tokenizer.json; serving needs the checkpoint's tokenizer")
        self.chat = ChatFormatter(cfg.model)
        self.metrics = ServerMetrics()
        self.engine = EngineClient(cfg, metrics=self.metrics, startup_timeout=startup_timeout)
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
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
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
            return self.tok.encode(p)
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

    def log_message(self, fmt, *args):   # quiet by default; access logs are not our job
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
        self.end_headers()
        self.wfile.write(data)

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
        try:
            n = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            raise ApiError(400, "bad Content-Length header") from None
        if n > MAX_BODY:
            raise ApiError(413, f"request body of {n} bytes exceeds {MAX_BODY}")
        raw = self.rfile.read(n)
        try:
            body = json.loads(raw)
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
        except (BrokenPipeError, ConnectionResetError, _ClientGone):
            self.close_connection = True

    def do_GET(self):
        self._route("GET")

    def do_POST(self):
        self._route("POST")

    # -- endpoints -----------------------------------------------------------------------------
    def _health(self) -> None:
        if self.app.engine.alive:
            self._send(200, {"status": "ok"})
        else:
            self._send(503, {"status": "engine not running", "exitcode": self.app.engine.proc.returncode})

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
        if not a.engine.alive:
            raise ApiError(503, "the engine is not running", type="server_error", code="engine_unavailable")
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
            try:
                kind, payload, when = q.get(timeout=1.0)
            except queue.Empty:
                if not a.engine.alive and q.empty():
                    kind, payload, when = "dead", "the engine process exited", time.monotonic()
                else:
                    continue
            if kind == "rejected":
                raise ApiError(400, payload)
            if kind == "dead":
                raise ApiError(503, payload, type="server_error", code="engine_unavailable")
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
