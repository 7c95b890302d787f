"""The defects an operator's probe found (issue 21), each pinned by a test that failed before its fix."""
import json
import os

import pytest

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
