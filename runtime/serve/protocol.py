"""Typed messages between the HTTP front-end and the engine process, as msgpack (never pickle).

Each message is a msgpack map with a ``type`` field; ``decode`` checks the type and the fields
it needs, so a malformed frame is an error naming the field, not a crash later.

front-end -> engine (PUSH -> PULL):
  add      {rid: str, prompt: [int], params: {max_tokens, temperature, top_p, top_k, seed, logprobs,
            presence_penalty, frequency_penalty, repetition_penalty, logit_bias: [[id, bias]], ignore_eos,
            stop_token_ids, grammar: [format, text], trigger, min_tokens, min_p, allowed_token_ids: [id],
            prompt_logprobs} (runtime/engine/request.py SamplingParams, whose fields they are),
            cache_salt: str or None (absent: None; the prefix-cache salt, a digest - never a client's key)}
  abort    {rid: str}
  shutdown {}
engine -> front-end (PUSH -> PULL):
  ready    {model: str, vocab_size: int, max_context: int, num_layers: int, num_experts: int, pid: int, stats: {...}}
  step     {outputs: [[rid, token, finish_reason or None, logprobs or None, cached tokens or None, prompt logprobs
            or None]] (logprobs: [the token's, [[id, logprob] of the most likely]]; cached tokens: with a request's
            first token, the prompt tokens the prefix cache held; prompt logprobs: with the first token of a request
            that asked for them, per prompt position None (the first) or [logprob, rank, [[id, logprob], ...]]),
            rejected: [[rid, message]],
            failed: [[rid, message]] (requests the engine failed while serving them; it goes on),
            record: {...one step's record...}, stats: {...cumulative store counters and gauges...}}
            Sent after every step and at least once a second when idle: the front-end's heartbeat.
  error    {message: str}   (start-up failed; the engine exits)
"""
from __future__ import annotations

import msgpack

PROTOCOL_VERSION = 4

_FIELDS = {
    "add": {"rid": str, "prompt": list, "params": dict, "cache_salt": (str, type(None))},
    "abort": {"rid": str},
    "shutdown": {},
    "ready": {"model": str, "vocab_size": int, "max_context": int, "num_layers": int, "num_experts": int, "pid": int,
              "stats": dict},
    "step": {"outputs": list, "rejected": list, "failed": list, "record": dict, "stats": dict},
    "error": {"message": str},
}


class ProtocolError(ValueError):
    pass


def encode(kind: str, **fields) -> bytes:
    if kind not in _FIELDS:
        raise ProtocolError(f"unknown message type {kind!r}")
    return msgpack.packb({"type": kind, "v": PROTOCOL_VERSION, **fields}, use_bin_type=True)


def decode(frame: bytes) -> dict:
    try:
        msg = msgpack.unpackb(frame, raw=False, strict_map_key=False)
    except Exception as e:  # noqa: BLE001 - msgpack raises several types
        raise ProtocolError(f"undecodable frame ({len(frame)} bytes): {e}") from None
    if not isinstance(msg, dict) or msg.get("type") not in _FIELDS:
        raise ProtocolError(f"frame is not a known message: type {msg.get('type') if isinstance(msg, dict) else None!r}")
    if msg.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(f"message of protocol version {msg.get('v')!r}, expected {PROTOCOL_VERSION}")
    for name, typ in _FIELDS[msg["type"]].items():
        if not isinstance(msg.get(name), typ):
            raise ProtocolError(f"{msg['type']} message: field {name!r} missing or not "
                                f"{' or '.join(t.__name__ for t in typ) if isinstance(typ, tuple) else typ.__name__}")
    return msg
