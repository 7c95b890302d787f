"""Admission of expensive requests: every grammar a request brings (``response_format``'s schema, the tools' call
grammar, a guided regex or Lark grammar) is compiled here, in the front-end's worker processes, before the engine
sees it - under a size budget (``MAX_GRAMMAR_CHARS`` of grammar text) and a CPU-time budget (``CPU_BUDGET_S`` for
compiling it and computing its first mask; a worker over it is killed). A grammar that fails either, or does not
compile, is a 400 naming the request's field and the limit; a verdict is kept by the grammar's canonical text
(``VERDICTS`` of them, least recently used dropped), so a client repeating a refused grammar costs a hash.

Why processes: llguidance compiles in Rust without a way to stop it; a process can be killed when its CPU time
runs over, and runs at a lower priority than the engine (admission_worker.py), so a flood of grammars takes the
admission workers' CPU (``workers`` of them), not the engine's. The engine compiles only what was admitted, under
the same llguidance limits (runtime/engine/grammar.py), on a thread beside its loop, once per distinct grammar (it
keeps the last ones it compiled): about what the worker measured, at most ``CPU_BUDGET_S``."""
from __future__ import annotations

import hashlib
import json
import os
import queue
import select
import subprocess
import sys
import threading
import time
from collections import OrderedDict

from .params import GUIDED, ApiError

MAX_GRAMMAR_CHARS = 256 << 10   # grammar text a request may send (a 100,000-value enum is ~1 MB)
CPU_BUDGET_S = 1.0              # CPU seconds one grammar may take to compile and give its first mask
WALL_LIMIT_S = 30.0             # a worker starved of CPU that long: the server is too busy (a 503, not a verdict)
WORKERS = 1                     # admission worker processes (the CPU a flood of grammars can take)
VERDICTS = 1024                 # verdicts kept, by canonical text
# A refused grammar is answered no sooner than this after its admission began: a client looping on refusals (each
# costs the front-end its body's JSON - ~15 ms for a 1 MB schema - on the one interpreter every request shares)
# sends at most 1 / REFUSAL_DELAY_S of them a second per connection
REFUSAL_DELAY_S = 0.5
_POLL_S = 0.01


# the request fields that may carry a grammar other than the tools' (params.constraint's: vLLM's beside OpenAI's)
GRAMMAR_FIELDS = ("response_format", "structured_outputs", *GUIDED)


def grammar_source(body: dict, tools) -> str:
    """The field a request's grammar came from: the tools (required / named calls, or auto calls' grammar), else
    the field that asks for structured output."""
    if tools is not None and tools.choice != "auto":
        return "tools"              # (response_format does not combine with them)
    for f in GRAMMAR_FIELDS:
        v = body.get(f)
        if v is not None and not (f == "response_format" and isinstance(v, dict) and v.get("type") == "text"):
            return f
    return "tools" if tools is not None else "response_format"


def canonical(fmt: str, text: str) -> str:
    """The key of a grammar's verdict: its format and text, a JSON schema with its keys sorted (the same schema
    sent with another key order is the same grammar to the verdict)."""
    if fmt in ("json_schema", "json_object"):
        try:
            text = json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"))
        except ValueError:
            pass
    return hashlib.sha256(f"{fmt}\0{text}".encode("utf-8", "surrogatepass")).hexdigest()


class _Worker:
    """One admission worker process."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos: list) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "runtime.serve.admission_worker", tokenizer_json,
                                      str(vocab_size), json.dumps(eos), str(os.getpid())],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=_ROOT)
        self.buf = b""
        self.ready = False

    def cpu_seconds(self) -> "float | None":
        """The worker's CPU time so far (user + system), from /proc; None where there is no /proc."""
        try:
            with open(f"/proc/{self.proc.pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            return None

    def line(self, budget: "float | None") -> "dict | None":
        """The worker's next reply; None when it used more than ``budget`` CPU seconds (None: no budget) first.
        Raises TimeoutError past WALL_LIMIT_S, OSError when the worker died."""
        fd = self.proc.stdout.fileno()
        t0, c0 = time.monotonic(), self.cpu_seconds()
        while b"\n" not in self.buf:
            if select.select([fd], [], [], _POLL_S)[0]:
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise OSError("the admission worker exited")
                self.buf += chunk
                continue
            waited = time.monotonic() - t0
            used = waited if c0 is None else (self.cpu_seconds() or c0) - c0
            if budget is not None and used > budget:
                return None
            if waited > WALL_LIMIT_S:
                raise TimeoutError
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def run(self, fmt: str, text: str, budget: float) -> "dict | None":
        """The verdict on one grammar: {"ok", "error"}, or None when the CPU budget ran out."""
        if not self.ready:
            self.line(None)                          # its tokenizer indexed: not the grammar's time
            self.ready = True
        self.proc.stdin.write(json.dumps({"fmt": fmt, "text": text}).encode() + b"\n")
        self.proc.stdin.flush()
        return self.line(budget)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass


class Admission:
    """The admission of a server's grammars: ``check`` (blocking: call it off the event loop) returns when the
    grammar may go to the engine, else raises the ApiError that refuses the request."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos: "list | tuple" = (), *, workers: int = WORKERS,
                 cpu_budget: float = CPU_BUDGET_S, max_chars: int = MAX_GRAMMAR_CHARS,
                 verdicts: int = VERDICTS) -> None:
        self.args = (tokenizer_json, vocab_size, list(eos))
        self.cpu_budget, self.max_chars, self.size = cpu_budget, max_chars, verdicts
        self.refusal_delay = REFUSAL_DELAY_S
        self.verdicts: OrderedDict = OrderedDict()     # canonical key -> None (admitted) or the refusal's ApiError args
        self.lock = threading.Lock()
        self.idle: queue.Queue = queue.Queue()
        self.workers: list = []
        self.n = workers
        self.closed = False
        self.stats = {"compiled": 0, "cached": 0, "refused": 0, "killed": 0}

    @classmethod
    def for_model(cls, model_dir: str, vocab_size: int, tok, chat, **kw) -> "Admission":
        """The admission of a served model: its tokenizer.json, its EOS token (the chat template's)."""
        eos = tok.token_id(chat.eos) if chat.eos else None
        adm = cls(os.path.join(model_dir, "tokenizer.json"), vocab_size, [] if eos is None else [eos], **kw)
        adm._give_back(None)          # a worker started now: the first grammar does not wait for it
        return adm

    async def admit_async(self, params: dict, body: dict, tools) -> None:
        """``admit`` off the event loop; a refusal (a 400) answered no sooner than REFUSAL_DELAY_S after it began."""
        import asyncio

        from starlette.concurrency import run_in_threadpool
        t0 = time.monotonic()
        try:
            await run_in_threadpool(self.admit, params, body, tools)
        except ApiError as e:
            if e.status == 400:
                await asyncio.sleep(max(0.0, self.refusal_delay - (time.monotonic() - t0)))
            raise

    def admit(self, params: dict, body: dict, tools) -> None:
        """Admit the grammars of a request's engine parameters (its ``grammar``, its ``trigger``'s)."""
        field = grammar_source(body, tools)
        if params.get("grammar") is not None:
            self.check(params["grammar"][0], params["grammar"][1], field)
        if params.get("trigger") is not None:
            self.check(params["trigger"][1], params["trigger"][2], field)

    def check(self, fmt: str, text: str, field: str) -> None:
        """Admit ``text`` (format ``fmt``), the grammar of the request's ``field``, or raise a 400 naming the field
        and the limit it exceeds (a 503 when no worker could look at it within WALL_LIMIT_S)."""
        if len(text) > self.max_chars:
            self.stats["refused"] += 1
            raise ApiError(400, f"'{field}': its grammar is {len(text):,} characters; this server compiles at most "
                                f"{self.max_chars:,} (the grammar size limit)", param=field, code="grammar_too_large")
        key = canonical(fmt, text)
        with self.lock:
            if key in self.verdicts:
                self.verdicts.move_to_end(key)
                self.stats["cached"] += 1
                self._raise(self.verdicts[key], field)
                return
        verdict = self._judge(fmt, text)
        with self.lock:
            self.verdicts[key] = verdict
            if len(self.verdicts) > self.size:
                self.verdicts.popitem(last=False)
        self._raise(verdict, field)

    def _raise(self, verdict: "tuple | None", field: str) -> None:
        if verdict is not None:
            self.stats["refused"] += 1
            message, code = verdict
            raise ApiError(400, f"'{field}': {message}", param=field, code=code)

    def _judge(self, fmt: str, text: str) -> "tuple | None":
        """(message, code) of a refusal, or None: admitted. Runs on an idle worker (waits for one)."""
        w = self._worker()
        try:
            reply = w.run(fmt, text, self.cpu_budget)
        except (OSError, TimeoutError, ValueError):
            w.kill()
            self._give_back(None)
            raise ApiError(503, "the server's grammar workers are too busy to admit this request; retry",
                           type="server_error", code="grammar_admission_busy") from None
        self.stats["compiled"] += 1
        if reply is None:              # over its CPU budget and still compiling: stopped the only way there is
            w.kill()
            self.stats["killed"] += 1
            self._give_back(None)
            return (f"its grammar took more than the {self.cpu_budget:g} s of CPU time a request's grammar may "
                    f"take to compile (the grammar CPU-time limit)", "grammar_too_expensive")
        self._give_back(w)
        if not reply["ok"]:
            return f"its grammar cannot be used: {reply['error']}", "invalid_grammar"
        return None

    def _worker(self) -> _Worker:
        if self.closed:
            raise ApiError(503, "the server is shutting down", type="server_error", code="server_shutting_down")
        with self.lock:
            if len(self.workers) < self.n:
                w = _Worker(*self.args)
                self.workers.append(w)
                return w
        try:
            return self.idle.get(timeout=WALL_LIMIT_S)
        except queue.Empty:
            raise ApiError(503, "the server's grammar workers are too busy to admit this request; retry",
                           type="server_error", code="grammar_admission_busy") from None

    def _give_back(self, w: "_Worker | None") -> None:
        """A worker back to the idle ones; a killed one (None) replaced by a new one."""
        with self.lock:
            self.workers = [x for x in self.workers if x.proc.poll() is None]
            if w is None and not self.closed and len(self.workers) < self.n:
                w = _Worker(*self.args)
                self.workers.append(w)
        if w is not None and not self.closed:
            self.idle.put(w)

    def close(self) -> None:
        self.closed = True
        with self.lock:
            for w in self.workers:
                w.kill()
            self.workers = []


_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
