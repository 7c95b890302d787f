"""The front-end's side of the engine: spawns the engine process, binds the ZeroMQ sockets in a
private temp directory, does the start-up handshake, and routes each engine message to the
request it belongs to."""
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

from .engine_proc import EngineConfig
from .protocol import ProtocolError, decode, encode


class EngineError(RuntimeError):
    """The engine could not start, or is gone."""


class EngineClient:
    def __init__(self, cfg: EngineConfig, *, metrics=None, startup_timeout: float = 300.0) -> None:
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
        self.alive = False
        self.proc = None
        try:
            # A fresh interpreter (not fork: torch and ZeroMQ threads do not survive a fork; not
            # multiprocessing's spawn: it re-imports the caller's __main__).
            root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([root] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "runtime.serve.engine_proc", json.dumps(asdict(cfg)), self.to_engine,
                 self.from_engine, str(os.getpid())], env=env, stdin=subprocess.DEVNULL)
            self.info = self._handshake(startup_timeout)
        except BaseException:
            self.close()
            raise
        self.alive = True
        if metrics:
            metrics.engine_up.set(1)
            metrics.on_step({}, self.info["stats"])
        self._thread = threading.Thread(target=self._receive, name="tiered-moe-engine-receiver", daemon=True)
        self._thread.start()

    def _handshake(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            if self.pull.poll(200):
                msg = decode(self.pull.recv())
                if msg["type"] == "ready":
                    return msg
                if msg["type"] == "error":
                    raise EngineError(f"the engine failed to start: {msg['message']}")
            if self.proc.poll() is not None:
                raise EngineError(f"the engine process exited (code {self.proc.returncode}) before it was ready")
            if time.monotonic() > deadline:
                raise EngineError(f"the engine did not report ready within {timeout:.0f} s")

    # -- requests ------------------------------------------------------------------------------
    def submit(self, rid: str, prompt: list, params: dict) -> "queue.Queue":
        q: queue.Queue = queue.Queue()
        with self._qlock:
            self._queues[rid] = q
        try:
            self._send(encode("add", rid=rid, prompt=prompt, params=params))
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

    # -- the receiver thread -------------------------------------------------------------------
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
                if msg["type"] == "step":
                    self._dispatch(msg)
            elif self.proc.poll() is not None:
                self._engine_died()
                return

    def _dispatch(self, msg: dict) -> None:
        now = time.monotonic()
        if self.metrics:
            self.metrics.on_step(msg["record"], msg["stats"])
        with self._qlock:
            for rid, text in msg["rejected"]:
                q = self._queues.get(rid)
                if q:
                    q.put(("rejected", text, now))
            for rid, tok, reason in msg["outputs"]:
                q = self._queues.get(rid)
                if q:
                    q.put(("token", (tok, reason), now))

    def _engine_died(self) -> None:
        self.alive = False
        if self.metrics:
            self.metrics.engine_up.set(0)
        with self._qlock:
            for q in self._queues.values():
                q.put(("dead", f"the engine process exited (code {self.proc.returncode})", time.monotonic()))

    # -- shutdown ------------------------------------------------------------------------------
    def close(self, timeout: float = 10.0) -> None:
        """Stop the engine (a shutdown message, then terminate, then kill), close the sockets,
        remove the temp directory."""
        import zmq
        if getattr(self, "_closed", False):
            return
        self._closed = True
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
        self._stop.set()
        t = getattr(self, "_thread", None)
        if t is not None:
            t.join(2)
        self.alive = False
        self.push.close(0)
        self.pull.close(0)
        self.ctx.term()
        shutil.rmtree(self.tmp, ignore_errors=True)
