"""The OpenAI-compatible server against the official openai client and raw HTTP, on loopback."""
import http.client
import json
import threading
import time
import urllib.request

import pytest
from helpers import require
from servehelp import KEY

openai = require("openai", "the official client the server is tested with")


def reference(store, prompt_ids, max_tokens):
    """The same greedy request run alone, in-process, without the server (all experts resident)."""
    from runtime.engine import Engine, SamplingParams
    from runtime.model import load_model
    from runtime.tokenizer import Tokenizer
    model, st = load_model(store)
    try:
        eng = Engine(model, st)
        i = eng.add_request(prompt_ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        eng.run()
        return Tokenizer(store).decode(eng.done[i].output), eng.done[i].output
    finally:
        st.close()


def client(srv, key=KEY):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0, timeout=60)


def raw(srv, method, path, body=None, key=KEY, headers=None):
    c = http.client.HTTPConnection(srv.host, srv.port, timeout=60)
    h = {"Content-Type": "application/json", **(headers or {})}
    if key:
        h["Authorization"] = f"Bearer {key}"
    c.request(method, path, body=body if isinstance(body, (bytes, str)) or body is None else json.dumps(body), headers=h)
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status, data


def metric(srv, name, labels=None):
    text = urllib.request.urlopen(srv.url + "/metrics").read().decode()
    total, found = 0.0, False
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if labels and not all(f'{k}="{v}"' in line for k, v in labels.items()):
                continue
            total += float(line.rsplit(" ", 1)[1])
            found = True
    assert found, f"{name} {labels} not in /metrics"
    return total


def test_models_lists_the_store(server):
    models = client(server).models.list()
    assert [m.id for m in models.data] == [server.model_name]


def test_completion_equals_the_request_run_alone(server, tiny_store):
    r = client(server).completions.create(model=server.model_name, prompt="The tiers", max_tokens=12, temperature=0)
    text, ids = reference(tiny_store[1], server.tok.encode("The tiers"), 12)
    assert r.choices[0].text == text
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len("The tiers"), 12)


def test_completion_accepts_token_ids(server, tiny_store):
    r = client(server).completions.create(model=server.model_name, prompt=[5, 6, 7], max_tokens=4, temperature=0)
    assert r.choices[0].text == reference(tiny_store[1], [5, 6, 7], 4)[0]


def test_chat_uses_the_checkpoints_template(server, tiny_store):
    from transformers import AutoTokenizer
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    r = client(server).chat.completions.create(model=server.model_name, messages=msgs, max_tokens=10, temperature=0)
    # transformers renders the template: an independent implementation of HF chat templates.
    prompt = AutoTokenizer.from_pretrained(tiny_store[0]).apply_chat_template(msgs, add_generation_prompt=True,
                                                                              tokenize=False)
    assert prompt == "<|system|>\nBe brief.\n<|user|>\nHi there\n<|assistant|>\n"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == reference(tiny_store[1], server.tok.encode(prompt), 10)[0]
    assert r.usage.prompt_tokens == len(prompt.encode())


def test_streaming_chat_and_completion_with_usage(server, tiny_store):
    c = client(server)
    full = c.chat.completions.create(model=server.model_name, messages=[{"role": "user", "content": "stream me"}],
                                     max_tokens=16, temperature=0).choices[0].message.content
    chunks = list(c.chat.completions.create(model=server.model_name, messages=[{"role": "user", "content": "stream me"}],
                                            max_tokens=16, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == full
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    parts = list(c.completions.create(model=server.model_name, prompt="abc", max_tokens=8, temperature=0, stream=True))
    assert "".join(p.choices[0].text for p in parts) == reference(tiny_store[1], server.tok.encode("abc"), 8)[0]
    assert all(p.usage is None for p in parts)


def test_sse_wire_format(server):
    st, data = raw(server, "POST", "/v1/completions", {"model": server.model_name, "prompt": "x", "max_tokens": 3,
                                                       "stream": True})
    assert st == 200
    events = [e for e in data.decode().split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[0][6:])["object"] == "text_completion"


def test_stop_string_cuts_the_text(server, tiny_store):
    text = reference(tiny_store[1], server.tok.encode("stop test"), 20)[0]
    stop = text[5:7]
    r = client(server).completions.create(model=server.model_name, prompt="stop test", max_tokens=20, temperature=0,
                                          stop=[stop])
    assert r.choices[0].text == text[:text.find(stop)]
    assert r.choices[0].finish_reason == "stop"


@pytest.mark.slow
def test_32_concurrent_streams_are_not_mixed_up(server, tiny_store):
    prompts = [f"request number {i} says" + "!" * (i % 5) for i in range(32)]
    c = client(server)
    alone = [c.completions.create(model=server.model_name, prompt=p, max_tokens=12, temperature=0).choices[0].text
             for p in prompts]
    assert len(set(alone)) > 1   # the prompts really differ in output
    got = [None] * 32
    errors = []

    def run(i):
        try:
            cc = client(server)
            s = cc.completions.create(model=server.model_name, prompt=prompts[i], max_tokens=12, temperature=0,
                                      stream=True, stream_options={"include_usage": True})
            parts, usage = [], None
            for ch in s:
                if ch.choices:
                    parts.append(ch.choices[0].text)
                if ch.usage:
                    usage = ch.usage
            got[i] = ("".join(parts), usage.completion_tokens)
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    ts = [threading.Thread(target=run, args=(i,)) for i in range(32)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert not errors
    assert got == [(a, 12) for a in alone]
    assert metric(server, "tiered_moe_step_batch_size_bucket", {"le": "4.0"}) < \
        metric(server, "tiered_moe_step_batch_size_count")   # steps really batched several requests


@pytest.mark.parametrize("body, status, param", [
    (b"{not json", 400, None),
    ({"model": "no-such-model", "prompt": "x"}, 404, "model"),
    ({"prompt": "x"}, 400, "model"),
    ({"MODEL": "x"}, 400, "model"),
    ({"model": "@", "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ({"model": "@", "prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    ({"model": "@", "prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ({"model": "@", "prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"model": "@", "prompt": "x", "stream": "yes"}, 400, "stream"),
    ({"model": "@", "prompt": "x", "n": 17}, 400, "n"),
    ({"model": "@", "prompt": "x", "ignore_eos": "yes"}, 400, "ignore_eos"),
    ({"model": "@", "prompt": "x", "stop_token_ids": [99999]}, 400, "stop_token_ids"),
    ({"model": "@", "prompt": "x", "n": 1.0}, 400, "n"),
    ({"model": "@", "prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ({"model": "@", "prompt": "x", "logprobs": True}, 400, "logprobs"),
    ({"model": "@", "prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ({"model": "@", "prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ({"model": "@", "prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ({"model": "@", "prompt": "x", "logit_bias": {"99999": 1}}, 400, "logit_bias"),
    ({"model": "@", "prompt": ""}, 400, "prompt"),
    ({"model": "@", "prompt": [1, 99999]}, 400, "prompt"),
    ({"model": "@", "prompt": "x" * 5000, "max_tokens": 1}, 400, "prompt"),
    ({"model": "@", "prompt": "x", "max_tokens": 5000}, 400, "prompt"),
])
def test_bad_completion_requests(server, body, status, param):
    if isinstance(body, dict) and body.get("model") == "@":
        body = {**body, "model": server.model_name}
    st, data = raw(server, "POST", "/v1/completions", body)
    assert st == status, data
    err = json.loads(data)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param
    if isinstance(body, dict) and (body.get("max_tokens") == 5000 or len(body.get("prompt", "")) == 5000):
        assert err["code"] == "context_length_exceeded"


@pytest.mark.parametrize("body, param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": 3}, "logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}}, "response_format"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}}, "response_format"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f f"}}]},
     "tools[0]"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
])
def test_bad_chat_requests(server, body, param):
    st, data = raw(server, "POST", "/v1/chat/completions", {"model": server.model_name, **body})
    assert st == 400
    assert json.loads(data)["error"]["param"] == param


def test_bad_requests_through_the_official_client(server):
    c = client(server)
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model=server.model_name, prompt="x", max_tokens=-3)
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="gpt-4", prompt="x")
    with pytest.raises(openai.AuthenticationError):
        client(server, key="wrong").models.list()


def test_api_key(server):
    assert raw(server, "GET", "/v1/models", key=None)[0] == 401
    st, data = raw(server, "GET", "/v1/models", key="nope")
    assert st == 401 and json.loads(data)["error"]["code"] == "invalid_api_key"
    # Health and metrics stay open for probes and scrapers.
    assert raw(server, "GET", "/health", key=None)[0] == 200
    assert raw(server, "GET", "/metrics", key=None)[0] == 200


@pytest.mark.slow
def test_disconnect_mid_stream_frees_the_request(server):
    before = metric(server, "tiered_moe_generation_tokens_total")
    c = http.client.HTTPConnection(server.host, server.port, timeout=30)
    c.request("POST", "/v1/completions", json.dumps({"model": server.model_name, "prompt": "long", "max_tokens": 3000,
                                                     "stream": True}),
              {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    r = c.getresponse()
    assert r.status == 200
    r.fp.readline()   # the first chunk arrived: the request is running
    c.sock.close()
    c.close()
    deadline = time.time() + 30
    while time.time() < deadline:
        if metric(server, "tiered_moe_requests_running") == 0 and metric(server, "tiered_moe_requests_waiting") == 0:
            break
        time.sleep(0.2)
    generated = metric(server, "tiered_moe_generation_tokens_total") - before
    assert metric(server, "tiered_moe_requests_running") == 0
    assert metric(server, "tiered_moe_requests_total", {"finish_reason": "abort"}) >= 1
    assert generated < 3000   # aborted long before max_tokens
    # The freed slot serves the next request normally.
    assert client(server).completions.create(model=server.model_name, prompt="after", max_tokens=3).usage.completion_tokens == 3


@pytest.mark.slow
def test_two_servers_side_by_side(tiny_store):
    """Two servers in one process; the second with a small device tier, hybrid execution and the
    cost-ruled prefetcher: the same text, and its metrics count the experts computed on the host."""
    import urllib.request
    from runtime.serve.api import Server
    from runtime.serve.engine_proc import EngineConfig
    from runtime.store import Manifest
    stride = Manifest.read(tiny_store[1]).blob_stride
    a = Server(EngineConfig(model=tiny_store[1]), port=0).start()
    b = Server(EngineConfig(model=tiny_store[1], expert_budget=4 * stride, cpu_experts="auto", prefetch="transition"),
               port=0).start()
    try:
        assert a.engine.tmp != b.engine.tmp and a.port != b.port
        ra = client(a, key="x").completions.create(model=a.model_name, prompt="same", max_tokens=5, temperature=0)
        rb = client(b, key="x").completions.create(model=b.model_name, prompt="same", max_tokens=5, temperature=0)
        assert ra.choices[0].text == rb.choices[0].text
        text = urllib.request.urlopen(b.url + "/metrics").read().decode()
        host = [ln for ln in text.splitlines() if ln.startswith('tiered_moe_expert_compute_total{where="host"}')]
        assert host and float(host[0].split()[-1]) > 0
    finally:
        a.close()
        b.close()
    with pytest.raises(ValueError, match="neither 'auto' nor a number"):
        EngineConfig(model=tiny_store[1], cpu_experts="some")
    with pytest.raises(ValueError, match="--prefetch-rule 'never'"):
        EngineConfig(model=tiny_store[1], prefetch_rule="never")
    with pytest.raises(ValueError, match="unknown hardware profile 'tpu'"):
        EngineConfig(model=tiny_store[1], profile="tpu")


@pytest.mark.slow
def test_engine_start_failure_is_a_clear_error(tmp_path, tiny_store):
    import shutil
    from runtime.serve.client import EngineClient, EngineError
    from runtime.serve.engine_proc import EngineConfig
    bad = tmp_path / "store"
    shutil.copytree(tiny_store[1], bad)
    (bad / "dense.safetensors").write_bytes(b"garbage")
    with pytest.raises(EngineError, match="dense.safetensors"):
        EngineClient(EngineConfig(model=str(bad)), startup_timeout=60)
    with pytest.raises(ValueError, match="manifest.json"):
        EngineConfig(model=str(tmp_path))


@pytest.mark.slow
def test_serve_command_starts_and_stops_cleanly(tiny_store, tmp_path):
    """`tiered-moe serve` as users run it: a URL on stderr, SIGTERM stops it, nothing left behind."""
    import os
    import re
    import signal
    import subprocess
    import sys
    from helpers import ROOT
    env = dict(os.environ, TMPDIR=str(tmp_path))
    p = subprocess.Popen([sys.executable, "-m", "runtime.cli", "serve", "--model", tiny_store[1], "--port", "0",
                          "--threads", "1"], cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    try:
        line = p.stderr.readline()
        url = re.search(r"(http://127\.0\.0\.1:\d+)/v1", line).group(1)
        assert json.loads(urllib.request.urlopen(url + "/health").read()) == {"status": "ok", "restarts": 0}
        engines = [pid for pid in os.listdir("/proc") if pid.isdigit() and str(tmp_path).encode() in
                   open(f"/proc/{pid}/cmdline", "rb").read()]
        assert len(engines) == 1   # the engine process, its sockets in our private temp dir
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) == 0
        assert "stopped" in p.stderr.read()
    finally:
        if p.poll() is None:
            p.kill()
    assert not os.path.exists(f"/proc/{engines[0]}") or b"zombie" in open(f"/proc/{engines[0]}/status", "rb").read().lower()
    assert os.listdir(tmp_path) == []   # sockets and temp dir removed


@pytest.mark.slow
def test_serve_command_bad_flags(tiny_store, tmp_path):
    import subprocess
    import sys
    from helpers import ROOT
    r = subprocess.run([sys.executable, "-m", "runtime.cli", "serve", "--model", str(tmp_path), "--port", "0"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "manifest.json" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "runtime.cli", "serve", "--model", tiny_store[1], "--policy", "mru"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--policy 'mru'" in r.stderr
