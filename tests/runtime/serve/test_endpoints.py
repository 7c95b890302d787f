"""vLLM's /tokenize, /detokenize and /version, and system_fingerprint on every completion object and chunk, on the
tiny store's server (tests/conftest.py), against the tokenizer file read directly and the installed package's
metadata."""
import json

import pytest

from helpers import require
from test_server import client, raw

openai = require("openai", "the official client the server is tested with")


def _post(srv, path, body, **kw):
    status, data = raw(srv, "POST", path, body, **kw)
    return status, json.loads(data)


def test_tokenize_and_detokenize(server, tiny_store):
    from tokenizers import Tokenizer
    hf = Tokenizer.from_file(tiny_store[1] + "/tokenizer.json")
    text = "The tiers hold experts. Ünïcode too."
    status, r = _post(server, "/tokenize", {"model": server.model_name, "prompt": text})
    assert status == 200
    assert r["tokens"] == hf.encode(text).ids and r["count"] == len(r["tokens"])
    models = client(server).models.list()
    assert r["max_model_len"] == models.data[0].model_extra["max_model_len"]
    status, d = _post(server, "/detokenize", {"model": server.model_name, "tokens": r["tokens"]})
    assert status == 200 and d == {"prompt": text}
    # messages: the chat template's prompt, as many tokens as a chat request's usage counts
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    status, r = _post(server, "/tokenize", {"messages": msgs})
    chat = client(server).chat.completions.create(model=server.model_name, messages=msgs, max_tokens=1)
    assert status == 200 and r["count"] == chat.usage.prompt_tokens
    for path, body, param in (("/tokenize", {"prompt": 5}, "prompt"), ("/tokenize", {}, "prompt"),
                              ("/tokenize", {"prompt": "x", "add_special_tokens": "no"}, "add_special_tokens"),
                              ("/detokenize", {"tokens": [1, -1]}, "tokens"),
                              ("/detokenize", {"tokens": [10 ** 9]}, "tokens"),
                              ("/detokenize", {"tokens": "12"}, "tokens"),
                              ("/tokenize", {"model": "other", "prompt": "x"}, "model")):
        status, err = _post(server, path, body)
        assert status in (400, 404) and err["error"]["param"] == param, (path, body, err)
    assert _post(server, "/tokenize", {"prompt": "x"}, key="wrong")[0] == 401
    assert _post(server, "/detokenize", {"tokens": [1]}, key=None)[0] == 401


def test_version_is_the_package_version(server):
    from importlib.metadata import version
    status, data = raw(server, "GET", "/version", key=None)
    assert status == 200 and json.loads(data) == {"version": version("tiered-moe")}


def test_system_fingerprint_on_every_object(server, tiny_store, tmp_path):
    """The same string on chat and completion objects and chunks, from the version and the store's manifest: a
    store with another manifest has another."""
    import shutil

    from runtime.serve.identity import system_fingerprint
    c = client(server)
    fp = server.fingerprint
    assert fp.startswith("fp_") and fp == system_fingerprint(tiny_store[1])
    msgs = [{"role": "user", "content": "hi"}]
    assert c.chat.completions.create(model=server.model_name, messages=msgs, max_tokens=2).system_fingerprint == fp
    assert c.completions.create(model=server.model_name, prompt="hi", max_tokens=2).system_fingerprint == fp
    chunks = list(c.chat.completions.create(model=server.model_name, messages=msgs, max_tokens=2, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks and all(x.system_fingerprint == fp for x in chunks)
    assert all(x.system_fingerprint == fp for x in c.completions.create(model=server.model_name, prompt="hi",
                                                                         max_tokens=2, stream=True))
    moved = tmp_path / "moved"
    shutil.copytree(tiny_store[1], moved)
    assert system_fingerprint(str(moved)) == fp                  # where the store is does not matter
    m = json.loads((moved / "manifest.json").read_text())
    m["changed"] = 1
    (moved / "manifest.json").write_text(json.dumps(m))
    assert system_fingerprint(str(moved)) != fp


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
def test_tokenize_needs_a_json_object(server, path):
    status, err = _post(server, path, [1, 2])
    assert status == 400 and "JSON object" in err["error"]["message"]
