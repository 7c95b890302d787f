"""Fault injection: nothing a client sends, and no single failure in the engine, takes the server
down. Each case asserts the server survives and the next normal request succeeds. Loopback only,
bounded in count and time."""
import json
import os
import shutil
import signal
import socket
import time

import pytest
from servehelp import KEY

from test_server import client, metric, raw  # noqa: E402  (same folder)


def metric0(srv, name, labels=None):
    """A counter's value, 0 before its first increment (a labelled counter has no sample yet)."""
    try:
        return metric(srv, name, labels)
    except AssertionError:
        return 0.0


def ok(srv, key=KEY, n=3):
    """A normal request succeeds."""
    r = client(srv, key=key).completions.create(model=srv.model_name, prompt="still there?", max_tokens=n, temperature=0)
    assert r.usage.completion_tokens == n and r.choices[0].finish_reason == "length"


def wait_health(srv, status, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if raw(srv, "GET", "/health", key=None)[0] == status:
            return
        time.sleep(0.1)
    raise AssertionError(f"/health never answered {status}")


@pytest.mark.parametrize("body, param", [
    ({"temperature": 1e-300}, None), ({"top_p": 1e-300, "temperature": 1.0}, None), ({"temperature": 1e-46}, None),
    ({"top_p": 1e-46, "temperature": 0.7, "top_k": 3}, None),
])
def test_extreme_sampling_values_are_served(server, body, param):
    """vLLM's rule: temperatures below 1e-5 are greedy; a tiny top_p keeps the most likely token."""
    before = metric(server, "tiered_moe_engine_restarts_total")
    st, data = raw(server, "POST", "/v1/completions", {"model": server.model_name, "prompt": "abc", "max_tokens": 4, **body})
    assert st == 200, data
    assert json.loads(data)["usage"]["completion_tokens"] == 4
    assert metric(server, "tiered_moe_engine_restarts_total") == before
    ok(server)


@pytest.mark.parametrize("body, status, match", [
    ({"prompt": "abc", "top_k": 2 ** 64}, 400, "top_k' must fit in a signed 64-bit"),
    ({"prompt": "abc", "seed": 2 ** 64}, 400, "seed' must fit in a signed 64-bit"),
    ({"prompt": "abc", "seed": -2 ** 70}, 400, "seed' must fit"),
    ({"prompt": "abc \ud800 def"}, 400, "not valid Unicode"),
    ({"prompt": "abc", "temperature": float("nan")}, 400, "temperature"),
    ({"prompt": "x" * 2_000_000}, 400, "more than this model's context"),
])
def test_hostile_values_get_400_and_the_server_goes_on(server, body, status, match):
    raw_body = json.dumps({"model": server.model_name, "max_tokens": 2, **body}, allow_nan=True)
    st, data = raw(server, "POST", "/v1/completions", raw_body)
    assert st == status and match in json.loads(data)["error"]["message"], data
    ok(server)


def test_malformed_http_gets_json_errors(server):
    deep = "[" * 100_000 + "]" * 100_000
    st, data = raw(server, "POST", "/v1/completions", deep)
    assert st == 400 and "nests too deeply" in json.loads(data)["error"]["message"]
    for method in ("PUT", "DELETE", "PATCH"):
        st, data = raw(server, method, "/v1/completions", b"{}")
        assert st == 405 and json.loads(data)["error"]["message"].startswith(method)
    s = socket.create_connection((server.host, server.port), timeout=10)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
              b"\r\nContent-Length: -1\r\n\r\n")
    resp = b""
    while b"}}" not in resp:
        chunk = s.recv(65536)
        if not chunk:
            break
        resp += chunk
    resp = resp.decode()
    s.close()
    assert resp.startswith("HTTP/1.1 400") and "application/json" in resp
    assert json.loads(resp.split("\r\n\r\n", 1)[1])["error"]["message"].startswith("malformed HTTP request")
    st, data = raw(server, "GET", "/nope")
    assert st == 404 and json.loads(data)["error"]["type"] == "invalid_request_error"
    st, data = raw(server, "BREW", "/health")
    assert st in (404, 405, 501) and "error" in json.loads(data)
    c = __import__("http.client").client.HTTPConnection(server.host, server.port, timeout=10)
    c.request("GET", "/health")
    r = c.getresponse()
    r.read()
    assert r.getheader("Server") in (None, "tiered-moe")   # no Python or server version
    ok(server)


def test_max_tokens_with_null_max_completion_tokens(server):
    r = client(server).chat.completions.create(model=server.model_name, messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=5, extra_body={"max_completion_tokens": None},
                                               temperature=0)
    assert r.usage.completion_tokens <= 5


def test_keep_alive_requests_are_not_delayed(server):
    """Nagle + delayed ACK cost ~40 ms per keep-alive request when headers and body went out in
    two small writes; with TCP_NODELAY a cheap request takes a few ms."""
    import http.client
    c = http.client.HTTPConnection(server.host, server.port, timeout=10)
    times = []
    for _ in range(15):
        t0 = time.perf_counter()
        c.request("POST", "/v1/completions", body=json.dumps({"model": server.model_name, "prompt": [1], "max_tokens": 1}),
                  headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
        r = c.getresponse()
        r.read()
        assert r.status == 200
        times.append(time.perf_counter() - t0)
    c.close()
    times.sort()
    assert times[len(times) // 2] < 0.035, times


@pytest.mark.slow
def test_non_streaming_client_that_disconnects_is_aborted(server):
    before = metric0(server, "tiered_moe_requests_total", {"finish_reason": "abort"})
    s = socket.create_connection((server.host, server.port), timeout=10)
    body = json.dumps({"model": server.model_name, "prompt": "long", "max_tokens": 3000, "temperature": 0}).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
              b"\r\nContent-Type: application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    time.sleep(0.5)
    s.close()
    deadline = time.time() + 20
    while time.time() < deadline and metric(server, "tiered_moe_requests_running") > 0:
        time.sleep(0.2)
    assert metric(server, "tiered_moe_requests_running") == 0
    assert metric(server, "tiered_moe_requests_total", {"finish_reason": "abort"}) >= before + 1
    ok(server)


def start(tiny_store, **kw):
    from runtime.serve.api import Server
    from runtime.serve.engine_proc import EngineConfig
    cfg = kw.pop("cfg", {})
    return Server(EngineConfig(model=kw.pop("model", tiny_store[1]), **cfg), port=0, **kw).start()


@pytest.mark.slow
def test_slow_header_client_does_not_block_others_and_times_out(tiny_store):
    srv = start(tiny_store, timeout=2.0)
    try:
        slow = socket.create_connection((srv.host, srv.port), timeout=10)
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")   # ... and nothing more
        ok(srv, key="no-key-needed")
        t0 = time.time()
        slow.settimeout(10)
        rest = slow.recv(65536)
        while rest:
            rest = slow.recv(65536)
        assert time.time() - t0 < 8                   # the server closed it after its 2 s timeout
        slow.close()
        ok(srv, key="no-key-needed")
    finally:
        srv.close()


@pytest.mark.slow
def _counters(srv) -> dict:
    """Every counter sample of /metrics (``_total``, and histograms' ``_count`` / ``_sum``): series -> value."""
    import urllib.request
    out = {}
    for line in urllib.request.urlopen(srv.url + "/metrics").read().decode().splitlines():
        if line.startswith("#") or not line.strip():
            continue
        series, v = line.rsplit(" ", 1)
        if series.split("{")[0].endswith(("_total", "_count", "_sum")):
            out[series] = float(v)
    return out


def test_killed_engine_is_restarted_and_serves_again(tiny_store):
    """kill -9 mid-stream: that stream ends with an error event, the supervisor restarts the
    engine, requests sent meanwhile wait for it, later requests succeed. No counter goes backwards
    across the restart (the new engine's start at 0; the server keeps what the old one counted), and the
    request the engine took down counts as an error, not as aborted by its client."""
    srv = start(tiny_store)
    tmp = srv.engine.tmp
    try:
        ok(srv, key="no-key-needed")
        stream = client(srv, key="no-key-needed").completions.create(model=srv.model_name, prompt="go", max_tokens=3000,
                                                           temperature=0, stream=True)
        got = []
        err = None
        try:
            for i, ch in enumerate(stream):
                got.append(ch)
                if i == 3:
                    before = _counters(srv)
                    os.kill(srv.engine.proc.pid, signal.SIGKILL)
        except Exception as e:  # noqa: BLE001 - the client raises the error event
            err = e
        assert err is not None and "engine" in str(err)
        ok(srv, key="no-key-needed")                               # waits for the restart, then succeeds
        wait_health(srv, 200)
        after = _counters(srv)
        assert any("expert_hits_total" in k and v > 0 for k, v in before.items())
        back = {k: (v, after.get(k)) for k, v in before.items() if after.get(k, -1) < v}
        assert not back, f"counters went backwards across the restart: {back}"
        assert metric(srv, "tiered_moe_requests_total", {"finish_reason": "error"}) == 1
        assert after.get('tiered_moe_requests_total{finish_reason="abort"}', 0) == 0
        assert metric(srv, "tiered_moe_engine_restarts_total") == 1
        assert metric(srv, "tiered_moe_engine_up") == 1
        assert json.loads(raw(srv, "GET", "/health", key=None)[1])["restarts"] == 1
    finally:
        srv.close()
    assert srv.engine.proc.poll() is not None and not os.path.exists(tmp)


@pytest.mark.slow
def test_hung_engine_is_killed_and_restarted(tiny_store):
    srv = start(tiny_store, heartbeat_timeout=2.0)
    try:
        pid = srv.engine.proc.pid
        os.kill(pid, signal.SIGSTOP)                    # alive but silent
        wait_health(srv, 503, timeout=20)
        assert "stopped answering" in json.loads(raw(srv, "GET", "/health", key=None)[1])["last_exit"]
        ok(srv, key="no-key-needed")
        assert srv.engine.proc.pid != pid and metric(srv, "tiered_moe_engine_restarts_total") == 1
    finally:
        srv.close()


@pytest.mark.slow
def test_corrupt_blob_at_run_time_fails_one_request_then_is_read_again(tiny_store, tmp_path):
    """A host tier that does not hold every expert: blobs are read from disk while serving. A
    corrupt one fails the requests of that step (500 naming layer and expert), is read again once
    first, and is dropped from the tiers - once the file is repaired the next request reads it
    afresh and succeeds."""
    from runtime.store import Manifest
    store = str(tmp_path / "store")
    shutil.copytree(tiny_store[1], store)
    m = Manifest.read(store)
    path = os.path.join(store, m.layer_file(0))
    good = open(path, "rb").read()
    bad = bytearray(good)
    for e in range(m.num_experts):                      # every expert of layer 0: any prompt needs one
        bad[e * m.blob_stride + 100] ^= 0xFF
    srv = start(tiny_store, model=store, cfg=dict(expert_budget=4 * m.blob_stride, host_budget=6 * m.blob_stride,
                                                  max_batch=2, prefill_chunk=2))
    try:
        with open(path, "wb") as f:
            f.write(bad)
        st, data = raw(srv, "POST", "/v1/completions", {"model": srv.model_name, "prompt": "zz qq", "max_tokens": 4,
                                                        "temperature": 0}, key=None)
        err = json.loads(data)["error"]
        assert st == 500 and err["code"] == "engine_error" and "checksum mismatch for layer 0 expert" in err["message"]
        assert raw(srv, "GET", "/health", key=None)[0] == 200
        assert metric(srv, "tiered_moe_engine_restarts_total") == 0
        with open(path, "wb") as f:
            f.write(good)
        ok(srv, key="no-key-needed")
    finally:
        srv.close()


@pytest.mark.slow
def test_budget_that_cannot_run_one_step_is_refused_at_start(tiny_store):
    from runtime.serve.client import EngineError
    from runtime.store import Manifest
    m = Manifest.read(tiny_store[1])
    with pytest.raises(EngineError, match="lower --max-batch to 1"):
        start(tiny_store, cfg=dict(expert_budget=3 * m.blob_stride, host_budget=4 * m.blob_stride, max_batch=8))


def test_huge_bodies_are_refused_without_freezing_the_server(server):
    """A 15 MB prompt once froze the front-end while it was tokenized; now a body over 8 MiB is a
    413 before it is read, and a prompt that cannot fit the context is a 400 before tokenizing."""
    t0 = time.time()
    s = socket.create_connection((server.host, server.port), timeout=10)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
              b"\r\nContent-Type: application/json\r\nContent-Length: 15000000\r\n\r\n" + b"{" * 65536)
    resp = s.recv(65536).decode()
    s.close()
    assert resp.startswith("HTTP/1.1 413") and time.time() - t0 < 2.0     # answered before the body is read
    t0 = time.time()
    assert raw(server, "GET", "/health", key=None)[0] == 200 and time.time() - t0 < 2.0
    mid = json.dumps({"model": server.model_name, "prompt": "word " * 1_000_000})     # 5 MB: under the body limit
    t0 = time.time()
    st, data = raw(server, "POST", "/v1/completions", mid)
    assert st == 400 and "context" in json.loads(data)["error"]["message"] and time.time() - t0 < 5
    ok(server)


def _children(pid: int) -> list:
    """Processes whose parent is ``pid``, with their command lines."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid:
            out.append((int(d), cmd))
    return out


@pytest.mark.slow
def test_tensor_parallel_server_serves_and_restarts_its_group_when_a_rank_dies(tiny_store, capfd):
    """serve --tensor-parallel 2: the same text as one process; per-rank metrics; a rank killed mid-stream
    breaks the group - that stream ends with an error, the supervisor restarts the whole group, the next
    request succeeds and no rank process of the old group is left. A rank that stalls (stopped) holds rank 0
    in its collective: the heartbeat runs out, the group is killed - the stopped rank too - and restarted."""
    def text(srv):
        r = client(srv, key="no-key-needed").completions.create(model=srv.model_name, prompt="tensor parallel",
                                                                max_tokens=8, temperature=0)
        return r.choices[0].text
    one = start(tiny_store)
    try:
        want = text(one)
    finally:
        one.close()
    srv = start(tiny_store, cfg={"tensor_parallel": 2}, heartbeat_timeout=10.0)
    try:
        assert text(srv) == want
        deadline = time.time() + 10
        while metric0(srv, "tiered_moe_rank_transfer_bytes_total", {"rank": "1", "link": "host_to_device"}) == 0:
            assert time.time() < deadline, "no per-rank figures from rank 1"
            time.sleep(0.2)
        ranks = [p for p, cmd in _children(srv.engine.proc.pid) if "spawn_main" in cmd]
        assert len(ranks) == 1, _children(srv.engine.proc.pid)
        stream = client(srv, key="no-key-needed").completions.create(model=srv.model_name, prompt="go", max_tokens=3000,
                                                                     temperature=0, stream=True)
        err = None
        try:
            for i, _ in enumerate(stream):
                if i == 3:
                    os.kill(ranks[0], signal.SIGKILL)
        except Exception as e:  # noqa: BLE001 - the client raises the error event
            err = e
        assert err is not None and "engine" in str(err)
        assert text(srv) == want                                    # waits for the restarted group
        assert metric(srv, "tiered_moe_engine_restarts_total") == 1
        assert "the tensor-parallel group broke (rank 1 exited with code -9)" in capfd.readouterr().err
        new = [p for p, cmd in _children(srv.engine.proc.pid) if "spawn_main" in cmd]
        assert len(new) == 1 and new != ranks
        os.kill(new[0], signal.SIGSTOP)                             # stalls: alive, answers nothing
        with pytest.raises(Exception, match="engine"):
            text(srv)
        assert text(srv) == want
        assert metric(srv, "tiered_moe_engine_restarts_total") == 2
        assert "the engine stopped answering" in capfd.readouterr().err
        time.sleep(1.0)
        assert not os.path.exists(f"/proc/{new[0]}"), "the stopped rank outlived its group"
    finally:
        srv.close()
    time.sleep(1.0)
    assert not os.path.exists(f"/proc/{ranks[0]}") or open(f"/proc/{ranks[0]}/stat").read().split()[2] == "Z"
