"""serve / generate --model on a Hugging Face checkpoint folder (runtime/model/store_cache.py): converted on
first use, reused after, converted again when the checkpoint's files change."""
import json
import os
import subprocess
import sys
import time

import pytest

from helpers import ROOT
from runtime.model.convert import convert
from runtime.model.store_cache import CACHE_ENV, resolve_model
from runtime.model.synthetic import build_checkpoint
from servehelp import SPEC


@pytest.fixture
def ckpt(tmp_path, monkeypatch):
    build_checkpoint(str(tmp_path / "hf"), SPEC)
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    return str(tmp_path / "hf")


def test_converted_once_reused_then_converted_again_when_it_changes(ckpt, tmp_path):
    said = []
    store = resolve_model(ckpt, log=said.append)
    assert os.path.isfile(os.path.join(store, "manifest.json")) and "converting" in said[-1]
    ref = str(tmp_path / "ref")
    convert(ckpt, ref)                                        # what 'tiered-moe convert' writes
    for f in ("manifest.json", "layer-000.bin", "dense.safetensors", "tokenizer.json"):
        assert open(os.path.join(store, f), "rb").read() == open(os.path.join(ref, f), "rb").read(), f
    stamp = os.stat(os.path.join(store, "manifest.json")).st_mtime_ns
    assert resolve_model(ckpt, log=said.append) == store and "using its converted store" in said[-1]
    assert os.stat(os.path.join(store, "manifest.json")).st_mtime_ns == stamp        # not converted again
    # the checkpoint changes (a new download): another store, the old one removed
    cfg = os.path.join(ckpt, "config.json")
    d = json.load(open(cfg))
    json.dump(d, open(cfg, "w"), indent=1)
    os.utime(cfg, ns=(time.time_ns(), time.time_ns() + 10 ** 9))
    new = resolve_model(ckpt, log=said.append)
    assert new != store and os.path.isfile(os.path.join(new, "manifest.json")) and not os.path.exists(store)
    # a store stays itself; a folder that is neither is named
    assert resolve_model(ref) == ref
    with pytest.raises(ValueError, match="neither a tiered-moe store"):
        resolve_model(str(tmp_path))
    with pytest.raises(ValueError, match="--quantize applies to a Hugging Face checkpoint"):
        resolve_model(ref, quantize="mxfp4")
    mx = resolve_model(ckpt, quantize="mxfp4", log=said.append)
    assert mx != new and json.load(open(os.path.join(mx, "manifest.json")))["weights"][0]["format"] == "mxfp4"


def test_an_interrupted_conversion_is_not_taken_for_a_store(ckpt, tmp_path, monkeypatch):
    import runtime.model.convert as cv
    real = cv.convert

    def dies(src, out, **kw):
        real(src, out, **kw)
        raise KeyboardInterrupt
    monkeypatch.setattr(cv, "convert", dies)
    with pytest.raises(KeyboardInterrupt):
        resolve_model(ckpt, log=lambda m: None)
    assert os.listdir(tmp_path / "cache") == [next(n for n in os.listdir(tmp_path / "cache") if n.startswith("."))]
    monkeypatch.setattr(cv, "convert", real)
    said = []
    store = resolve_model(ckpt, log=said.append)
    assert "converting" in said[-1] and os.path.isfile(os.path.join(store, "manifest.json"))


@pytest.mark.slow
def test_generate_on_the_checkpoint_folder_equals_the_store(ckpt, tmp_path):
    ref = str(tmp_path / "ref")
    convert(ckpt, ref)
    env = dict(os.environ)

    def gen(model):
        r = subprocess.run([sys.executable, "-m", "runtime.cli", "generate", "--model", model, "--prompt-ids", "1,2,3",
                            "--max-tokens", "8", "--json", "--threads", "1"], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        lines = [json.loads(x) for x in r.stdout.splitlines() if x.strip()]
        return [x["tokens"] for x in lines if "tokens" in x], r.stderr
    want, _ = gen(ref)
    got, err = gen(ckpt)
    assert "converting the checkpoint" in err
    assert got == want and len(want) == 1 and len(want[0]) == 8
    got, err = gen(ckpt)
    assert "using its converted store" in err


@pytest.mark.slow
def test_serve_on_the_checkpoint_folder(ckpt, tmp_path):
    """serve --model <checkpoint folder>: converted first, then served like a store."""
    import re
    import signal
    import urllib.request
    p = subprocess.Popen([sys.executable, "-m", "runtime.cli", "serve", "--model", ckpt, "--port", "0", "--threads",
                          "1"], cwd=ROOT, env=dict(os.environ), stderr=subprocess.PIPE, text=True)
    try:
        seen = []
        while not any("serving" in x for x in seen):
            line = p.stderr.readline()
            assert line, "".join(seen)
            seen.append(line)
        assert any("converting the checkpoint" in x for x in seen)
        url = re.search(r"(http://127\.0\.0\.1:\d+)/v1", seen[-1]).group(1)
        models = json.loads(urllib.request.urlopen(url + "/v1/models").read())
        assert models["data"][0]["id"] == "hf"          # the folder's name, not the cache's
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) == 0
    finally:
        if p.poll() is None:
            p.kill()
