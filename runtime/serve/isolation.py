"""Clients kept apart in the prefix cache, and the API keys that tell them apart.

The prefix cache shares the KV blocks of a prompt's prefix between requests, so a prefix someone sent before is
served faster (and reported in ``usage.prompt_tokens_details.cached_tokens``): one client can learn what another
sent by timing its own requests. A salt (vLLM's ``cache_salt`` request field) keys a prompt's blocks apart
(runtime/engine/kv_manager.py): requests share blocks only when their salts are equal. ``CacheIsolation`` turns
a request's ``cache_salt`` and, with ``--prefix-cache-isolation api-key`` (tiered-moe's option: vLLM has none),
the API key it was sent with into the engine's salt: a keyed digest (HMAC with a secret drawn at start-up), so
neither the key nor the client's salt ever leaves the front-end."""
from __future__ import annotations

import hashlib
import hmac
import json
import secrets

from .params import ApiError

ISOLATIONS = ("none", "api-key")


def api_keys(keys) -> tuple:
    """The server's API keys (None, one, or several) as a tuple, each checked non-empty."""
    out = () if keys is None else (keys,) if isinstance(keys, str) else tuple(keys)
    if not all(isinstance(k, str) and k for k in out):
        raise ValueError("an API key is empty")
    return out


def matching_key(keys: tuple, authorization: str) -> "str | None":
    """The key of ``keys`` an ``Authorization: Bearer KEY`` header carries, else None. Every key is compared, in
    constant time, so the time taken says nothing about which key (or how much of one) matched."""
    given = authorization[7:].encode() if authorization.startswith("Bearer ") else b""
    found = None
    for k in keys:
        if hmac.compare_digest(given, k.encode()) and found is None:
            found = k
    return found


class CacheIsolation:
    """A request's prefix-cache salt: from its ``cache_salt`` and, under ``mode`` "api-key", its API key."""

    def __init__(self, mode: str = "none", keys: tuple = ()) -> None:
        if mode not in ISOLATIONS:
            raise ValueError(f"prefix cache isolation {mode!r}: choose one of {', '.join(ISOLATIONS)}")
        if mode == "api-key" and not keys:
            raise ValueError("prefix cache isolation by API key needs API keys (--api-key or --api-key-file)")
        self.mode = mode
        self._secret = secrets.token_bytes(32)     # the digests mean nothing outside this server's life

    def salt(self, body: dict, key: "str | None") -> "str | None":
        """The engine's salt for a request ``body`` sent with API ``key``: None when it shares the unsalted
        cache (no ``cache_salt``, no isolation). A ``cache_salt`` that is not a non-empty string is a 400 (vLLM
        refuses it the same way)."""
        s = body.get("cache_salt")
        if s is not None and not (isinstance(s, str) and s):
            raise ApiError(400, "'cache_salt' must be a non-empty string", param="cache_salt")
        tenant = key if self.mode == "api-key" else None
        if s is None and tenant is None:
            return None
        # json: the pair unambiguous (no separator a salt could forge); ASCII (lone surrogates escaped)
        return hmac.new(self._secret, json.dumps([tenant, s]).encode(), hashlib.sha256).hexdigest()
