"""SIGTERM (issue 32, finding 7): `tiered-moe serve` took 5-6 s to exit when idle and 7 s with a stream open, and
cut open streams at once. Now it exits within a second when idle; open requests get ``--shutdown-grace`` seconds to
finish (no new connection is taken meanwhile), then what is left ends with an error event and [DONE]."""
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest


def _serve(tiny_store, tmp_path, *args):
    """`tiered-moe serve` as users run it: (the process, its URL)."""
    from helpers import ROOT
    env = dict(os.environ, TMPDIR=str(tmp_path))
    p = subprocess.Popen([sys.executable, "-m", "runtime.cli", "serve", "--model", tiny_store[1], "--port", "0",
                          "--threads", "1", *args], cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    line = p.stderr.readline()
    m = re.search(r"(http://127\.0\.0\.1:(\d+))/v1", line)
    if m is None:
        p.kill()
        pytest.fail(f"serve did not start: {line}{p.stderr.read()}")
    assert json.loads(urllib.request.urlopen(m.group(1) + "/health").read())["status"] == "ok"
    return p, m.group(1), int(m.group(2))


def _model(url: str) -> str:
    return json.loads(urllib.request.urlopen(url + "/v1/models").read())["data"][0]["id"]


def _stop(p) -> "tuple[int, float]":
    """SIGTERM: (exit code, seconds it took to exit)."""
    t0 = time.monotonic()
    p.send_signal(signal.SIGTERM)
    code = p.wait(60)
    return code, time.monotonic() - t0


def test_sigterm_when_idle_exits_within_a_second(tiny_store, tmp_path):
    p, url, _ = _serve(tiny_store, tmp_path)
    try:
        body = json.dumps({"model": _model(url), "prompt": "warm", "max_tokens": 2}).encode()
        r = urllib.request.urlopen(urllib.request.Request(url + "/v1/completions", data=body,
                                                          headers={"Content-Type": "application/json"}))
        assert json.loads(r.read())["usage"]["completion_tokens"] == 2       # it has served: then idle
        code, took = _stop(p)
    finally:
        if p.poll() is None:
            p.kill()
    assert code == 0 and took < 1.0, f"exit code {code} after {took:.2f} s"
    assert "stopped" in p.stderr.read()
    assert os.listdir(tmp_path) == []                # sockets and temp dir removed


class _Stream(threading.Thread):
    """A streamed completion read on its own thread: its events, with the time each arrived."""

    def __init__(self, port: int, model: str, max_tokens: int, n: int = 1) -> None:
        super().__init__(daemon=True)
        self.port, self.model, self.max_tokens, self.n, self.events = port, model, max_tokens, n, []
        self.started = threading.Event()

    def run(self) -> None:
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        c.request("POST", "/v1/completions", body=json.dumps({"model": self.model, "prompt": "go", "temperature": 0,
                                                              "max_tokens": self.max_tokens, "ignore_eos": True,
                                                              "n": self.n, "stream": True}),
                  headers={"Content-Type": "application/json"})
        r = c.getresponse()
        while True:
            line = r.readline()
            if not line:
                break
            if line.startswith(b"data: "):
                self.events.append((time.monotonic(), line[6:].strip()))
                self.started.set()
        self.started.set()


def test_sigterm_drains_open_streams_within_the_grace(tiny_store, tmp_path):
    grace = 1.5
    p, url, port = _serve(tiny_store, tmp_path, "--shutdown-grace", str(grace))
    try:
        model = _model(url)
        # 16 choices of the context's 4000 tokens: slower steps (8 choices ran 1,200 tokens/s on a quiet machine with
        # the weights in huge pages - done in 3.3 s, within grace + 1.5)
        long = _Stream(port, model, 4000, n=16)
        long.start()
        assert long.started.wait(30)
        time.sleep(0.5)
        rate = (len(long.events) - 1) / 16 / (long.events[-1][0] - long.events[0][0])   # tokens per second
        assert 4000 / rate > grace + 1.5, f"{rate:.0f} tokens/s: the long stream would end within the grace"
        short = _Stream(port, model, int(rate * grace / 2))          # ends about halfway through the grace
        short.start()
        assert short.started.wait(30)
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        with pytest.raises(ConnectionRefusedError):            # no new connection while it drains
            http.client.HTTPConnection("127.0.0.1", port, timeout=5).connect()
        code = p.wait(grace + 10)
        exited = time.monotonic() - t0
    finally:
        if p.poll() is None:
            p.kill()
    short.join(10)
    long.join(10)
    # the short stream was open at SIGTERM and ran to its end: no error, finish_reason length, [DONE]
    last = [json.loads(e) for _, e in short.events[:-1]]
    assert not any("error" in e for e in last), last[-1]
    assert short.events[-1][1] == b"[DONE]" and last[-1]["choices"][0]["finish_reason"] == "length"
    assert short.events[-1][0] > t0 + 0.2, "the short stream ended before SIGTERM: make it longer"
    # the long one was cut when the grace ran out: an error event, then [DONE]
    assert long.events[-1][1] == b"[DONE]"
    err = json.loads(long.events[-2][1])["error"]
    assert err["code"] == "server_shutting_down"
    cut = long.events[-2][0] - t0
    assert grace - 0.1 <= cut <= grace + 1.0, f"cut {cut:.2f} s after SIGTERM (grace {grace} s)"
    assert code == 0 and exited <= grace + 1.5, f"exited {exited:.2f} s after SIGTERM (grace {grace} s)"
    assert os.listdir(tmp_path) == []


def test_a_second_sigterm_ends_the_grace(tiny_store, tmp_path):
    p, url, port = _serve(tiny_store, tmp_path, "--shutdown-grace", "60")
    try:
        long = _Stream(port, _model(url), 4000, n=8)
        long.start()
        assert long.started.wait(30)
        p.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert p.poll() is None                                   # draining: the stream runs on
        t0 = time.monotonic()
        code, took = _stop(p)
    finally:
        if p.poll() is None:
            p.kill()
    long.join(10)
    assert code == 0 and took < 1.5, f"exit code {code} {took:.2f} s after the second signal"
    assert json.loads(long.events[-2][1])["error"]["code"] == "server_shutting_down" and long.events[-1][1] == b"[DONE]"
    assert long.events[-2][0] - t0 < 1.0
