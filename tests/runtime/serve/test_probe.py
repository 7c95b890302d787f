"""The defects an operator's probe found (issue 21), each pinned by a test that failed before its fix."""
import json
import os

import pytest

from servehelp import KEY
from test_server import client, metric, raw  # noqa: E402  (same folder)


def start(tiny_store, cfg=None, **kw):
    from runtime.serve.api import Server
    from runtime.serve.engine_proc import EngineConfig
    return Server(EngineConfig(model=kw.pop("model", tiny_store[1]), **(cfg or {})), port=0, **kw).start()


@pytest.fixture(scope="module")
def small_kv(tiny_store):
    """A server whose KV cache holds fewer tokens than the model's context."""
    from runtime.model import load_model
    from runtime.model.config import MoEConfig
    mc = MoEConfig.from_hf(tiny_store[1])
    model, store = load_model(tiny_store[1], device="cpu")
    per_token = model.kv_bytes_per_token()
    store.close()
    srv = start(tiny_store, {"kv_cache_budget": 96 * per_token, "max_batch": 2})
    assert srv.max_context < mc.max_position_embeddings, (srv.max_context, mc.max_position_embeddings)
    yield srv
    srv.close()


def test_a_request_without_max_tokens_fits_the_kv_cache(small_kv):
    """Finding 3: without max_tokens a request got the whole context as its budget and failed whenever the
    KV cache was smaller ("needs 256 KV blocks; holds 128"); /v1/models advertised the full context."""
    srv = small_kv
    models = client(srv, key="no-key-needed").models.list()
    assert models.data[0].max_model_len == srv.max_context
    r = client(srv, key="no-key-needed").chat.completions.create(
        model=srv.model_name, messages=[{"role": "user", "content": "hello"}], temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens + r.usage.completion_tokens <= srv.max_context
    r = client(srv, key="no-key-needed").completions.create(model=srv.model_name, prompt=[1] * 10, max_tokens=None,
                                                            temperature=0)
    assert r.usage.completion_tokens >= 1


def test_a_prompt_that_fills_the_context_names_the_problem(small_kv):
    """Finding 8: a prompt that leaves no room and no max_tokens got "max_tokens must be a positive integer,
    got 0" with param null; a request past what the KV cache holds got code null."""
    srv = small_kv
    st, body = raw(srv, "POST", "/v1/completions", {"model": srv.model_name, "prompt": [1] * srv.max_context,
                                                     "max_tokens": None}, key=None)
    err = json.loads(body)["error"]
    assert st == 400 and err["code"] == "context_length_exceeded" and err["param"] == "prompt", err
    assert "leaving no room" in err["message"] and "KV cache holds" in err["message"]
    st, body = raw(srv, "POST", "/v1/completions", {"model": srv.model_name, "prompt": [1] * 8,
                                                     "max_tokens": srv.max_context}, key=None)
    err = json.loads(body)["error"]
    assert st == 400 and err["code"] == "context_length_exceeded", err


# -- finding 6: a keyless server driven from a web page ---------------------------------------------------
@pytest.fixture(scope="module")
def keyless(tiny_store):
    srv = start(tiny_store)
    yield srv
    srv.close()


def _post(srv, body: bytes, headers: dict):
    import http.client
    c = http.client.HTTPConnection(srv.host, srv.port, timeout=60)
    c.request("POST", "/v1/completions", body=body, headers=headers)
    r = c.getresponse()
    out = r.status, json.loads(r.read() or b"null"), dict(r.getheaders())
    c.close()
    return out


def test_a_web_page_cannot_drive_a_keyless_server(keyless, server):
    """Finding 6: text/plain bodies (a cross-site POST needs no CORS preflight) were accepted and the Host header
    was not checked (DNS rebinding). Now: JSON only (415), and a keyless loopback server answers only to
    loopback names (403 naming the header); a server with a key, or told its names, answers to them."""
    body = json.dumps({"model": keyless.model_name, "prompt": "hi", "max_tokens": 2}).encode()
    for ct in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        st, err, _ = _post(keyless, body, {"Content-Type": ct})
        assert st == 415 and "application/json" in err["error"]["message"], (ct, err)
    st, err, _ = _post(keyless, body, {"Content-Type": "application/json", "Host": f"evil.example:{keyless.port}"})
    assert st == 403 and err["error"]["code"] == "host_not_allowed" and "evil.example" in err["error"]["message"]
    for host in (f"localhost:{keyless.port}", f"127.0.0.1:{keyless.port}", "localhost"):
        st, _, _ = _post(keyless, body, {"Content-Type": "application/json; charset=utf-8", "Host": host})
        assert st == 200, host
    st, _, _ = _post(server, body.replace(keyless.model_name.encode(), server.model_name.encode()),
                     {"Content-Type": "application/json", "Host": "any.example", "Authorization": f"Bearer {KEY}"})
    assert st == 200


# -- finding 8: the smaller ones ----------------------------------------------------------------------------
def test_the_smaller_findings(keyless):
    srv = keyless

    def post(body):
        st, data = raw(srv, "POST", "/v1/completions", {"model": srv.model_name, "prompt": "hi", **body}, key=None)
        return st, json.loads(data)
    st, e = post({"n": 1.0})
    assert st == 400 and e["error"]["param"] == "n"
    st, e = post({"stream": True, "stream_options": []})
    assert st == 400 and e["error"]["param"] == "stream_options"
    st, e = post({"stream_options": {"include_usage": True}})
    assert st == 400 and "stream" in e["error"]["message"]
    st, e = post({"stop": "x" * 100_000, "stream": True})
    assert st == 400 and e["error"]["param"] == "stop" and "256" in e["error"]["message"]
    # the trailing-slash redirect echoed the Host header; now a wrong path is a plain 404
    st, data = raw(srv, "GET", "/v1/models/", key=None, headers={"Host": "localhost"})
    assert st == 404 and b"localhost" not in data
    # GET /v1/models/{id}: the official client's models.retrieve
    m = client(srv, key="no-key-needed").models.retrieve(srv.model_name)
    assert m.id == srv.model_name and m.max_model_len == srv.max_context
    st, data = raw(srv, "GET", "/v1/models/nope", key=None)
    assert st == 404 and json.loads(data)["error"]["code"] == "model_not_found"
    from runtime.serve.api import Server
    s = object.__new__(Server)
    s.host, s.port = "::", 8000
    assert s.url == "http://[::]:8000"


def test_health_tells_a_stopped_or_failing_engine(tiny_store, tmp_path):
    """Finding 8: /health said ok while the engine was stopped or failing every request."""
    import shutil
    import signal
    import time
    from runtime.store import Manifest
    store = str(tmp_path / "store")
    shutil.copytree(tiny_store[1], store)
    m = Manifest.read(store)
    srv = start(tiny_store, model=store, cfg=dict(expert_budget=4 * m.blob_stride, host_budget=6 * m.blob_stride,
                                                  max_batch=2, prefill_chunk=2))
    try:
        assert raw(srv, "GET", "/health", key=None)[0] == 200
        os.kill(srv.engine.proc.pid, signal.SIGSTOP)
        try:
            deadline = time.time() + 15
            while raw(srv, "GET", "/health", key=None)[0] == 200:
                assert time.time() < deadline, "/health still ok with the engine stopped"
                time.sleep(0.5)
            assert json.loads(raw(srv, "GET", "/health", key=None)[1])["status"] == "engine not answering"
        finally:
            os.kill(srv.engine.proc.pid, signal.SIGCONT)
        deadline = time.time() + 15
        while raw(srv, "GET", "/health", key=None)[0] != 200:
            assert time.time() < deadline
            time.sleep(0.2)
        path = os.path.join(store, m.layer_file(0))
        good = open(path, "rb").read()
        bad = bytearray(good)
        for e in range(m.num_experts):
            bad[e * m.blob_stride + 100] ^= 0xFF
        with open(path, "wb") as f:
            f.write(bad)
        for _ in range(3):
            st, _ = raw(srv, "POST", "/v1/completions", {"model": srv.model_name, "prompt": "zz", "max_tokens": 2},
                        key=None)
            assert st == 500
        st, data = raw(srv, "GET", "/health", key=None)
        assert st == 503 and json.loads(data)["status"] == "engine failing requests"
        with open(path, "wb") as f:
            f.write(good)
        st, _ = raw(srv, "POST", "/v1/completions", {"model": srv.model_name, "prompt": "zz", "max_tokens": 2},
                    key=None)
        assert st == 200 and raw(srv, "GET", "/health", key=None)[0] == 200
    finally:
        srv.close()


def test_shutdown_ends_open_streams_with_an_error_and_done(tiny_store, capfd):
    """Finding 8: shutting down (SIGTERM) ended live streams with neither an error event nor [DONE], and logged
    a 45-line traceback. (No grace: streams still open are cut at once - test_shutdown.py drains them.)"""
    import http.client
    import threading
    srv = start(tiny_store, shutdown_grace=0)
    c = http.client.HTTPConnection(srv.host, srv.port, timeout=60)
    c.request("POST", "/v1/completions", body=json.dumps({"model": srv.model_name, "prompt": "go", "max_tokens": 3000,
                                                           "temperature": 0, "stream": True}),
              headers={"Content-Type": "application/json"})
    r = c.getresponse()
    events = []
    closer = None
    while True:
        line = r.readline()
        if not line:
            break
        if line.startswith(b"data: "):
            events.append(line[6:].strip())
            if len(events) == 3:
                closer = threading.Thread(target=srv.close)
                closer.start()
    closer.join(30)
    assert events[-1] == b"[DONE]", events[-3:]
    err = json.loads(events[-2])["error"]
    assert err["code"] == "server_shutting_down"
    assert "Traceback" not in capfd.readouterr().err


def test_an_empty_api_key_variable_is_refused(tiny_store):
    """Finding 8: TIERED_MOE_API_KEY set but empty silently meant no key."""
    import subprocess
    import sys
    from helpers import ROOT
    r = subprocess.run([sys.executable, "-m", "runtime.cli", "serve", "--model", tiny_store[1], "--port", "0"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, TIERED_MOE_API_KEY=""))
    assert r.returncode == 2 and "TIERED_MOE_API_KEY is set but empty" in r.stderr


def test_sigterm_while_the_engine_starts_cleans_up(tiny_store, tmp_path):
    """Finding 4: SIGTERM during start-up skipped all cleanup (exit 143, a temp folder left, the engine orphaned)."""
    import signal
    import subprocess
    import sys
    import time
    from helpers import ROOT
    env = dict(os.environ, TMPDIR=str(tmp_path))
    p = subprocess.Popen([sys.executable, "-m", "runtime.cli", "serve", "--model", tiny_store[1], "--port", "0",
                          "--threads", "1"], cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    engine = None
    try:
        deadline = time.time() + 60
        while engine is None:
            assert time.time() < deadline and p.poll() is None
            for d in os.listdir("/proc"):
                try:
                    cmd = open(f"/proc/{d}/cmdline", "rb").read()
                except OSError:
                    continue
                if d.isdigit() and b"runtime.serve.engine_proc" in cmd and str(tmp_path).encode() in cmd:
                    engine = int(d)
            time.sleep(0.05)
        p.send_signal(signal.SIGTERM)                 # the engine is importing / loading: not ready yet
        assert p.wait(30) == 0
        err = p.stderr.read()
        assert "stopped while the engine was starting" in err and "Traceback" not in err, err
    finally:
        if p.poll() is None:
            p.kill()
    time.sleep(0.5)
    assert not os.path.exists(f"/proc/{engine}") or b"zombie" in open(f"/proc/{engine}/status", "rb").read().lower()
    assert os.listdir(tmp_path) == []


# -- finding 7: a manifest whose offsets point outside or across tensors -----------------------------------
def test_a_manifest_with_bad_offsets_is_refused(tiny_store, tmp_path):
    import shutil
    from runtime.store import Manifest
    for how in ("negative", "overlap"):
        d = str(tmp_path / how)
        shutil.copytree(tiny_store[1], d)
        mp = os.path.join(d, "manifest.json")
        m = json.load(open(mp))
        if how == "negative":
            m["tensors"][0]["offset"] = -64
        else:
            m["tensors"][1]["offset"] = m["tensors"][0]["offset"]
        json.dump(m, open(mp, "w"))
        with pytest.raises(ValueError, match="offset"):
            Manifest.read(d)


# -- finding 1: refused prompts bloated the front-end and stalled everyone ------------------------------------
def _rss() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def test_refused_long_prompts_neither_bloat_nor_stall(keyless):
    """48 concurrent prompts just under 64 characters per token of the context - all too long - once took the
    front-end from 58 to 709 MB and a normal completion from 60 ms to 3.8 s: each was tokenized whole. Now a
    prefix proves them too long; the front-end (this process: the engine is another) grows by little and a
    normal request is served meanwhile."""
    import concurrent.futures as cf
    import time
    srv = keyless
    text = ("lorem ipsum dolor sit amet " * 20_000)[:64 * srv.max_context - 100]
    body = json.dumps({"model": srv.model_name, "prompt": text, "max_tokens": 1})
    raw(srv, "POST", "/v1/completions", body, key=None)            # warm: first-use allocations
    before = _rss()
    with cf.ThreadPoolExecutor(49) as pool:
        burst = [pool.submit(raw, srv, "POST", "/v1/completions", body, None) for _ in range(48)]
        time.sleep(0.2)
        t0 = time.time()
        st, _ = raw(srv, "POST", "/v1/completions", {"model": srv.model_name, "prompt": "hi", "max_tokens": 2},
                    key=None)
        normal = time.time() - t0
        results = [f.result() for f in burst]
    grew = _rss() - before
    assert st == 200
    assert all(r[0] == 400 and json.loads(r[1])["error"]["code"] == "context_length_exceeded" for r in results)
    assert grew < 100 * 2 ** 20, f"the front-end grew by {grew / 2 ** 20:.0f} MB"
    assert normal < 3.0, f"a normal request took {normal:.2f} s during the burst"
