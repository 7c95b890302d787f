"""OpenAI-compatible HTTP front-end (the subset vLLM and llama.cpp serve): a Starlette app on
uvicorn (h11), as vLLM and SGLang serve. Requests wait on an asyncio queue that the engine
client's receiver thread feeds; tokenization, JSON parsing of large bodies and waiting for an
engine restart run in the thread pool, never on the event loop.

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (server-sent events
with ``"stream": true``, usage with ``stream_options.include_usage``), POST /v1/responses and GET
/v1/responses/{id} (OpenAI's Responses API), vLLM's POST /tokenize and /detokenize, GET /version,
GET /health, GET /metrics.
Errors use OpenAI's object ``{"error": {"message", "type", "param", "code"}}`` - for every status,
malformed requests and unknown methods included.

Hostile input fails alone: sampling values are checked against what the engine and the wire
format take (integers within int64; temperatures below 1e-5 are greedy, as in vLLM), a body that
is not JSON, nests too deep or carries lone surrogates is a 400, an error in the engine fails that
request with a 500 naming the cause, and any other exception is a 500 for that request. Every
connection has deadlines (``timeout``): for a request's headers (slowloris), its body, idle
keep-alive, and each write of a stream (a client that stops reading); a non-streaming client that
disconnects has its request aborted.

Modules: this one (``Server``: the engine client and the HTTP server's life, and turning a request body into the
engine's prompt and sampling parameters), transport.py (uvicorn's protocol with deadlines, the Host check),
routes.py (the endpoints), responses.py (a request's choices as OpenAI's objects), streams.py (server-sent
events), tool_parsers/ (tool calls, one module per family's format), reasoning.py (thinking split into
reasoning_content), responses_api.py (the Responses API on the chat path), identity.py (version, fingerprint).
"""
from __future__ import annotations

import contextlib
import functools
import json
import socket
import threading
import time

from ..engine.request import MAX_LOGPROBS
from ..tokenizer import Tokenizer
from .chat import ChatFormatter, reply_tail, template_options
from .admission import Admission
from .client import EngineClient
from .isolation import CacheIsolation, api_keys
from .metrics import ServerMetrics
from .params import ApiError, constraint, number, vllm_sampling
from .identity import system_fingerprint
from .reasoning import reasoning_format
from .routes import build_app
from .tool_parsers import ToolFormat, tool_format
from .transport import loopback, uvicorn_server

MAX_BODY = 8 << 20
PREFIX_MARGIN = 64           # tokens a prefix's cut may add (Server.encode)
MAX_N = 16                   # choices per request
MAX_LOGIT_BIAS = 300         # logit_bias entries (OpenAI's limit)
TOKENIZE_AT_ONCE = 4         # requests with long prompts tokenizing at the same time (Server.lane, Server.encode)
LONG_PROMPT = 16384          # characters of a prompt (or of a chat's messages) that make it long (Server.lane)
SHUTDOWN_GRACE = 10.0        # seconds open requests may run on once the server is told to stop (Server.close)


class Server:
    """Engine client + HTTP server. ``start()`` returns once both listen; ``close()`` stops both."""

    def __init__(self, cfg, *, host: str = "127.0.0.1", port: int = 8000, api_key: "str | list | None" = None,
                 served_model_name: "str | None" = None, startup_timeout: float = 300.0, timeout: float = 60.0,
                 heartbeat_timeout: float = 60.0, restart_wait: float = 60.0, max_body: int = MAX_BODY,
                 allowed_hosts: "list | None" = None, reasoning_parser: str = "auto",
                 prefix_cache_isolation: str = "none", shutdown_grace: float = SHUTDOWN_GRACE) -> None:
        """``allowed_hosts``: the names the ``Host`` header may carry (a web page's DNS-rebinding attack sends its
        own); None: a keyless server on a loopback address takes only loopback names, any other takes any.
        ``api_key``: one key or several (any of them is accepted). ``prefix_cache_isolation``: "none", or "api-key"
        (each key's requests share prefix-cache blocks only with that key's: isolation.py). ``shutdown_grace``:
        seconds ``close`` lets open requests finish."""
        self.cfg, self.api_keys = cfg, api_keys(api_key)
        self.api_key = self.api_keys[0] if self.api_keys else None
        self.isolation = CacheIsolation(prefix_cache_isolation, self.api_keys)
        if not (isinstance(shutdown_grace, (int, float)) and 0 <= shutdown_grace < float("inf")):
            raise ValueError(f"shutdown grace must be a finite number of seconds >= 0, got {shutdown_grace!r}")
        self.shutdown_grace = float(shutdown_grace)
        self._hurry = threading.Event()
        if allowed_hosts is None and not self.api_keys and loopback(host):
            allowed_hosts = ["localhost", "127.0.0.1", "::1", host]
        self.allowed_hosts = None if allowed_hosts is None else {h.strip("[]").lower() for h in allowed_hosts}
        self.tok = Tokenizer(cfg.model)
        if not self.tok.available:
            raise ValueError(f"{cfg.model}: no tokenizer.json; serving needs the checkpoint's tokenizer")
        self.chat = ChatFormatter(cfg.model)
        # the family's thinking format (reasoning.FORMATS: by the template's markers, or named by the option)
        self.reasoning = reasoning_format(self.chat.template_text, reasoning_parser)
        self._tokenizing = threading.BoundedSemaphore(TOKENIZE_AT_ONCE)
        self._long_lane = None        # anyio's CapacityLimiter of TOKENIZE_AT_ONCE (made on the event loop: lane)
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
        # grammars are compiled in its worker processes before the engine sees them (admission.py)
        self.admission = Admission.for_model(cfg.model, self.vocab_size, self.tok, self.chat)
        self.created = int(time.time())
        try:
            fam = socket.AF_INET6 if ":" in host else socket.AF_INET
            self.sock = socket.socket(fam, socket.SOCK_STREAM)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.sock.bind((host, port))
            self.sock.listen(512)
        except OSError as e:
            self.admission.close()
            self.engine.close()
            raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}") from None
        self.host, self.port = self.sock.getsockname()[:2]
        self.uv = uvicorn_server(build_app(self), timeout)
        self._thread = None
        self.open_requests = 0        # requests between submit and their end (the event loop's count)
        self.failing = 0              # requests failed by the engine in a row (/health reports a failing engine)

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

    def hurry(self) -> None:
        """End the grace a ``close`` under way gives open requests (a second Ctrl-C)."""
        self._hurry.set()

    def close(self, grace: "float | None" = None) -> None:
        """Stop: no new connection is taken (uvicorn closes the listening socket and idle connections at once),
        open requests run on for up to ``grace`` seconds (``shutdown_grace`` unless given), then what is left ends
        with an error (a stream: an error event and [DONE]); then the engine stops."""
        if self._thread is not None:
            grace = self.shutdown_grace if grace is None else grace
            # uvicorn's own wait for open connections outlasts ours: those left get their error events sent
            self.uv.config.timeout_graceful_shutdown = grace + 2
            self.uv.should_exit = True
            deadline = time.monotonic() + grace
            while self.open_requests and time.monotonic() < deadline and not self._hurry.is_set():
                time.sleep(0.02)
            self.engine.fail_all("the server is shutting down")
            self._thread.join(grace + 10)
        try:
            self.sock.close()
        except OSError:
            pass
        self.admission.close()
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
        c = constraint(body)            # response_format, guided_* or structured_outputs: (field, grammar)
        if c is not None:
            out["grammar"] = c[1]
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
        out.update(vllm_sampling(body, out["max_tokens"], self.vocab_size))
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

    def chat_text(self, body: dict, tools=None) -> str:
        """The body's messages rendered by the chat template, with its template fields (chat.template_options)."""
        return self.chat_render(body, tools)[0]

    def chat_render(self, body: dict, tools=None) -> "tuple[str, str]":
        """``chat_text`` and the part of it the reply follows on from (chat.reply_tail)."""
        opts = template_options(body)
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
            text = self.chat.render(clean, tools.template_tools() if tools is not None else None, **opts)
        except ValueError as e:
            raise ApiError(400, str(e), param="messages") from None
        return text, reply_tail(text, clean, opts["continue_final_message"])

    @functools.cached_property
    def fingerprint(self) -> str:
        """``system_fingerprint``: the same while this package's version and the store's contents are (its
        manifest, not its path), so a client can tell when what answers it changed."""
        return system_fingerprint(self.cfg.model)

    @functools.cached_property
    def tool_format(self) -> ToolFormat:
        """The family's tool-call format, by the markers its chat template writes (tool_parsers.FORMATS); read on
        every streamed token of a tools choice, found once."""
        return tool_format(self.chat.template_text)

    def lane(self, body: dict):
        """How a request's prompt is rendered and tokenized off the event loop: ``await lane(fn, *args)``. In
        the worker threads; a long prompt (over ``LONG_PROMPT`` characters) waits for one of
        ``TOKENIZE_AT_ONCE`` turns on the event loop, holding no thread: 48 clients sending 260,000-character
        prompts once held every worker thread (each waiting for its turn to tokenize) and a normal request
        waited seconds for one."""
        import anyio
        if self._long_lane is None:
            self._long_lane = anyio.CapacityLimiter(TOKENIZE_AT_ONCE)
        limiter = self._long_lane if prompt_chars(body) > LONG_PROMPT else None
        return lambda fn, *args: anyio.to_thread.run_sync(fn, *args, limiter=limiter)

    def encode(self, text: str, param: str, special: bool = True) -> list:
        """Text -> ids; refuses text that cannot be valid UTF-8 (lone surrogates) and text too long for the
        context without tokenizing all of it: past 64 characters per token nothing fits (beyond any
        vocabulary's tokens); below that, a text longer than the context in characters is counted in pieces of
        that length first, and once their counts (less a margin per cut) pass the context the whole cannot fit.
        So a refused prompt costs the tokenizer about the context in tokens, not the prompt's (growing prefixes,
        counted before, cost up to 4x as much), and a long text tokenizes at most ``TOKENIZE_AT_ONCE`` at a time
        (CPU-bound: more at once only holds more memory): 48 prompts of 64x the context once took the front-end
        from 58 to 709 MB, holding every one's full encoding."""
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
        with self._tokenizing if len(text) > LONG_PROMPT else contextlib.nullcontext():
            step, total = limit + 1, 0    # a text no longer than the context in characters: tokenized whole
            for i in range(0, len(text) if len(text) > step else 0, step):
                # each cut splits at most one pre-token of the whole text: a piece's count exceeds the whole's
                # share of it by at most that pre-token's pieces (a margin per cut, two cuts per piece)
                total += len(self.tok.encode(text[i:i + step], False)) - 2 * PREFIX_MARGIN
                if total > limit:
                    raise too_long
            return self.tok.encode(text, special)


def prompt_chars(body: dict) -> int:
    """Characters of a body's prompt, or of its messages' text (what rendering and tokenizing it costs)."""
    p, n = body.get("prompt"), 0
    for x in (p if isinstance(p, list) else [p]):
        n += len(x) if isinstance(x, str) else 0
    msgs = body.get("messages")
    for m in (msgs if isinstance(msgs, list) else []):
        c = m.get("content") if isinstance(m, dict) else None
        for x in (c if isinstance(c, list) else [c]):
            t = x.get("text") if isinstance(x, dict) else x
            n += len(t) if isinstance(t, str) else 0
    return n


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
