"""A Hugging Face checkpoint folder where a store is expected (``serve`` / ``generate --model``): converted on
first use into a cache folder (with a progress bar), reused after, and converted again when the checkpoint
changes - what users of vLLM or llama.cpp expect from pointing a server at the folder they downloaded.

The cache key is the checkpoint's files (name, size, modification time), the store format's version and
the expert format asked for; a conversion runs into a ``.partial`` folder renamed into place when done (an
interrupted one is never taken for a store), under a lock (two servers started at once convert once), and
an older conversion of the same checkpoint folder is removed once a new one is in place.
"""
from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import shutil
import sys

from ..store.layout import VERSION
from . import convert as conversion   # the module: its convert is looked up at each use (tests replace it)

CACHE_ENV = "TIERED_MOE_CACHE"
SOURCE = "source.json"          # in a cached store: which checkpoint it came from, and its fingerprint


def cache_root() -> str:
    return os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "tiered-moe", "stores")


def is_store(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "manifest.json"))


def is_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "config.json")) and bool(glob.glob(os.path.join(path, "*.safetensors")))


def fingerprint(path: str, quantize: "str | None") -> str:
    """The checkpoint's files (a Hugging Face folder is flat: its top level), the store version and the
    expert format: any change to them means another store."""
    h = hashlib.sha256(json.dumps({"version": VERSION, "quantize": quantize}).encode())
    for name in sorted(os.listdir(path)):
        f = os.path.join(path, name)
        if os.path.isfile(f):
            st = os.stat(f)
            h.update(f"{name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


@contextlib.contextmanager
def _lock(path: str):
    import fcntl
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def resolve_model(path: str, *, quantize: "str | None" = None, progress: bool = False, log=None) -> str:
    """The store directory for ``path``: ``path`` itself when it is a store; the cached conversion of a
    checkpoint folder, made now if there is none for its current files. ValueError naming what ``path`` is
    not."""
    log = log or (lambda msg: print(f"tiered-moe: {msg}", file=sys.stderr, flush=True))
    if is_store(path):
        if quantize is not None:
            raise ValueError(f"{path} is a converted store: --quantize applies to a Hugging Face checkpoint folder "
                             f"(convert it again with 'tiered-moe convert --quantize {quantize}')")
        return path
    if not os.path.isdir(path):
        raise ValueError(f"--model {path!r} does not exist")
    if not is_checkpoint(path):
        raise ValueError(f"--model {path!r} is neither a tiered-moe store (no manifest.json) nor a Hugging Face "
                         f"checkpoint folder (config.json and *.safetensors)")
    src = os.path.abspath(path)
    fp = fingerprint(src, quantize)
    root = cache_root()
    os.makedirs(root, exist_ok=True)
    name = os.path.basename(src.rstrip(os.sep)) or "model"
    dest = os.path.join(root, f"{name}-{fp[:16]}")
    with _lock(os.path.join(root, f".{hashlib.sha256(src.encode()).hexdigest()[:16]}.lock")):
        if is_store(dest) and _source(dest).get("fingerprint") == fp:
            log(f"{path}: using its converted store {dest}")
            return dest
        tmp = f"{dest}.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(dest, ignore_errors=True)
        log(f"{path}: converting the checkpoint into {dest} (first use{', experts as ' + quantize if quantize else ''}; "
            f"reused until its files change)")
        try:
            conversion.convert(src, tmp, progress=progress, quantize=quantize)
            with open(os.path.join(tmp, SOURCE), "w") as f:
                json.dump({"source": src, "fingerprint": fp, "quantize": quantize}, f)
            os.rename(tmp, dest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        for old in glob.glob(os.path.join(root, "*")):      # older conversions of this checkpoint folder
            if old != dest and os.path.isdir(old) and _source(old).get("source") == src:
                shutil.rmtree(old, ignore_errors=True)
                log(f"removed the conversion of an older version of {path}: {old}")
    return dest


def _source(store: str) -> dict:
    try:
        with open(os.path.join(store, SOURCE)) as f:
            d = json.load(f)
        return d if isinstance(d, dict) else {}
    except (OSError, ValueError):
        return {}
