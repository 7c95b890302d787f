"""The front-end's side of the engine: spawns the engine process, binds the ZeroMQ sockets in a
private temp directory, does the start-up handshake, and routes each engine message to the
request it belongs to.

It also supervises the engine: an engine that exits, or sends nothing for ``heartbeat_timeout``
seconds (it reports at least once a second when idle, and after every step), is killed and
started again with exponential backoff (0.5 s doubling to 30 s). Requests in flight at that
moment get an error naming the cause; new requests wait for the restart (up to
``restart_wait`` seconds) instead of failing at once. ``restarts`` counts the restarts."""
from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict

# the configuration the engine process (engine_proc.py's EngineConfig) is spawned with: the front-end does not
# import the engine process's module, which loads the engine and torch.distributed
from ..config import RuntimeConfig
from .protocol import ProtocolError, decode, encode


class EngineError(RuntimeError):
    """The engine could not start, or is gone."""


class EngineClient:
    def __init__(self, cfg: RuntimeConfig, *, metrics=None, startup_timeout: float = 300.0,
                 heartbeat_timeout: float = 60.0, restart_wait: float = 60.0) -> None:
        import zmq
        self.cfg, self.metrics = cfg, metrics
        self.tmp = tempfile.mkdtemp(prefix="tiered-moe-")
        self.to_engine = f"ipc://{os.path.join(self.tmp, 'to-engine')}"
        self.from_engine = f"ipc://{os.path.join(self.tmp, 'from-engine')}"
        self.ctx = zmq.Context()
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 0)
        self.push.setsockopt(zmq.SNDTIMEO, 2000)   # a dead engine never blocks an HTTP thread for long
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        self.push.bind(self.to_engine)
        self.pull.bind(self.from_engine)
        self._send_lock = threading.Lock()
        self._queues: dict = {}
        self._qlock = threading.Lock()
        self._stop = threading.Event()
        self._up = threading.Event()          # set while an engine is running and ready
        self._closing: "str | None" = None    # why requests are refused from now on (fail_all)
        self.alive = False
        self.proc = None
        self.restarts = 0
        self.last_exit: "str | None" = None   # why the last engine went away
        self.heartbeat_timeout, self.restart_wait = heartbeat_timeout, restart_wait
        self.startup_timeout = startup_timeout
        self.slowest_step = 0.0               # seconds of the longest engine step seen (/health's patience)
        try:
            self.info = self._start()
        except BaseException:
            self.close()
            raise
        if metrics:
            metrics.on_step({}, self.info["stats"])
        self._thread = threading.Thread(target=self._receive, name="tiered-moe-engine-receiver", daemon=True)
        self._thread.start()

    def _start(self) -> dict:
        """Spawn an engine and wait for its ready message."""
        # A fresh interpreter (not fork: torch and ZeroMQ threads do not survive a fork; not
        # multiprocessing's spawn: it re-imports the caller's __main__).
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([root] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "runtime.serve.engine_proc", json.dumps(asdict(self.cfg)), self.to_engine,
             self.from_engine, str(os.getpid())], env=env, stdin=subprocess.DEVNULL,
            # its own process group: a kill ends the engine and the ranks it spawned at once, a stuck or
            # stopped rank included (the ranks' parent watch cannot run in a stopped process)
            start_new_session=True)
        info = self._handshake(self.startup_timeout)
        self._last_heard = time.monotonic()
        self.alive = True
        self._up.set()
        if self.metrics:
            self.metrics.engine_up.set(1)
        return info

    def _handshake(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            if self.pull.poll(200):
                msg = decode(self.pull.recv())
                if msg["type"] == "ready":
                    return msg
                if msg["type"] == "error":
                    self.proc.wait(10)
                    raise EngineError(f"the engine failed to start: {msg['message']}")
                continue      # a step message of an engine that died before this one started
            if self.proc.poll() is not None:
                raise EngineError(f"the engine process exited (code {self.proc.returncode}) before it was ready")
            if time.monotonic() > deadline:
                self._kill()
                raise EngineError(f"the engine did not report ready within {timeout:.0f} s")
            if self._stop.is_set():
                self._kill()
                raise EngineError("the server is shutting down")

    # -- requests ------------------------------------------------------------------------------
    def submit(self, rid: str, prompt: list, params: dict, q=None, cache_salt: "str | None" = None):
        """Send a request; its results go to ``q`` (anything with ``put``; a new queue.Queue by
        default) as (kind, payload, time) items: token ((id, finish reason, logprobs, cached tokens, prompt logprobs)),
        rejected, failed, dead. ``cache_salt``: its prefix-cache salt (protocol.py)."""
        if self._closing is not None:
            raise EngineError(self._closing)   # fail_all ended the others: a late one is not started
        if not self.alive and not self._stop.is_set():
            self._up.wait(self.restart_wait)   # an engine being restarted: wait for it (bounded)
        q = queue.Queue() if q is None else q
        with self._qlock:
            self._queues[rid] = q
        try:
            self._send(encode("add", rid=rid, prompt=prompt, params=params, cache_salt=cache_salt))
        except EngineError:
            self.release(rid)
            raise
        return q

    def abort(self, rid: str) -> None:
        self.release(rid)
        if self.alive:
            try:
                self._send(encode("abort", rid=rid))
            except EngineError:
                pass

    def fail_all(self, why: str) -> None:
        """End every open request with ``why`` (the server is shutting down), and refuse new ones."""
        self._closing = why
        with self._qlock:
            for q in self._queues.values():
                q.put(("shutdown", why, time.monotonic()))
            self._queues.clear()

    @property
    def last_heard(self) -> float:
        return self._last_heard

    def release(self, rid: str) -> None:
        with self._qlock:
            self._queues.pop(rid, None)

    def _send(self, frame: bytes) -> None:
        import zmq
        if not self.alive:
            raise EngineError("the engine is not running")
        with self._send_lock:
            try:
                self.push.send(frame)
            except zmq.Again:
                raise EngineError("the engine does not take requests (send timed out)") from None

    # -- the receiver thread: routing and supervision ------------------------------------------
    def _receive(self) -> None:
        while not self._stop.is_set():
            try:
                ready = self.pull.poll(100)
            except Exception:  # noqa: BLE001 - socket closed during shutdown
                return
            if ready:
                try:
                    msg = decode(self.pull.recv())
                except ProtocolError:
                    continue
                except Exception:  # noqa: BLE001 - socket closed during shutdown
                    return
                self._last_heard = time.monotonic()
                if msg["type"] == "step":
                    try:
                        self._dispatch(msg)
                    except Exception as e:  # noqa: BLE001 - the receiver is also the supervisor: it must live
                        print(f"tiered-moe: dropped an engine message: {type(e).__name__}: {e}", file=sys.stderr)
                continue
            if self.proc.poll() is not None:
                self._engine_died(f"the engine process exited (code {self.proc.returncode})")
            elif time.monotonic() - self._last_heard > self.heartbeat_timeout:
                self._kill()
                self._engine_died(f"the engine stopped answering (no message for {self.heartbeat_timeout:.0f} s) "
                                  f"and was killed")
            else:
                continue
            self._restart()

    def _kill(self) -> None:
        p = self.proc
        if p is not None:
            _kill_group(p)
        if p is not None and p.poll() is None:
            p.kill()
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                pass

    def _restart(self) -> None:
        """Start a new engine, with exponential backoff between failed attempts."""
        delay = 0.5
        while not self._stop.is_set():
            try:
                self.info = self._start()
                self.restarts += 1
                if self.metrics:
                    self.metrics.engine_restarts.inc()
                print(f"tiered-moe: engine restarted ({self.last_exit})", file=sys.stderr)
                return
            except EngineError as e:
                print(f"tiered-moe: engine restart failed: {e}; next try in {delay:.1f} s", file=sys.stderr)
            self._stop.wait(delay)
            delay = min(30.0, 2 * delay)

    def _dispatch(self, msg: dict) -> None:
        now = time.monotonic()
        if msg["record"]:
            self.slowest_step = max(self.slowest_step, float(msg["record"]["seconds"]))
        if self.metrics:
            self.metrics.on_step(msg["record"], msg["stats"])
        with self._qlock:
            for rid, text in msg["rejected"]:
                q = self._queues.get(rid)
                if q:
                    q.put(("rejected", text, now))
            for rid, text in msg["failed"]:
                q = self._queues.get(rid)
                if q:
                    q.put(("failed", text, now))
            for rid, tok, reason, lp, cached, plp in msg["outputs"]:
                q = self._queues.get(rid)
                if q:
                    q.put(("token", (tok, reason, lp, cached, plp), now))

    def _engine_died(self, why: str) -> None:
        self.alive = False
        self._up.clear()
        self.last_exit = why
        if self.metrics:
            self.metrics.engine_up.set(0)
            self.metrics.store.engine_gone()
        with self._qlock:
            for q in self._queues.values():
                q.put(("dead", why, time.monotonic()))
            self._queues.clear()

    # -- shutdown ------------------------------------------------------------------------------
    def close(self, timeout: float = 10.0) -> None:
        """Stop the engine (a shutdown message, then terminate, then kill), close the sockets,
        remove the temp directory."""
        import zmq
        if getattr(self, "_closed", False):
            return
        self._closed = True
        self._stop.set()      # no restart from here on
        self._up.set()
        t = getattr(self, "_thread", None)
        if t is not None:
            t.join(5)
        p = self.proc
        if p is not None and p.poll() is None:
            try:
                with self._send_lock:
                    self.push.send(encode("shutdown"), flags=zmq.NOBLOCK)
            except Exception:  # noqa: BLE001
                pass
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        for stop in ((p.terminate, p.kill) if p is not None else ()):
            if p.poll() is None:
                stop()
                try:
                    p.wait(5)
                except subprocess.TimeoutExpired:
                    pass
        if p is not None:
            _kill_group(p)        # ranks the engine left behind
        self.alive = False
        self.push.close(0)
        self.pull.close(0)
        self.ctx.term()
        shutil.rmtree(self.tmp, ignore_errors=True)


def _kill_group(p: subprocess.Popen) -> None:
    """SIGKILL what is left of the engine's process group (the engine leads it: start_new_session)."""
    import signal
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError, OSError):
        pass
