"""The engine process: the decoding loop behind the HTTP front-end, fed over ZeroMQ.

Sockets: PULL (requests from the front-end) and PUSH (tokens and records back), both connected
to ``ipc://`` endpoints the front-end bound in its private temp directory. ZeroMQ's own I/O thread
moves the bytes, so the loop only polls between steps: with work it never blocks (timeout 0),
idle it waits up to 100 ms. One ``step`` message per engine step carries that step's tokens,
its record and the store's cumulative counters.
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import asdict

from ..config import RuntimeConfig
from ..engine import FinishReason, SamplingParams
from ..parallel.group import Group
from ..proc import watch_parent
from .protocol import decode, encode


# The engine process runs the one runtime configuration the command line built (runtime/config.py).
EngineConfig = RuntimeConfig


def engine_main(cfg: dict, to_engine: str, from_engine: str, parent_pid: int) -> int:
    """Entry point of the spawned engine process. Returns the exit code: 0 after a shutdown, 1
    when it failed (the supervisor in the front-end restarts it)."""
    import zmq
    watch_parent(parent_pid)      # the front-end gone, also while the model loads: do not linger
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    push = ctx.socket(zmq.PUSH)
    pull.connect(to_engine)
    push.connect(from_engine)
    push.setsockopt(zmq.LINGER, 2000)
    code = 0
    try:
        _serve(EngineConfig(**cfg), pull, push, parent_pid)
    except Exception as e:  # noqa: BLE001 - reported to the front-end, which owns the user's terminal
        code = 1
        try:
            push.send(encode("error", message=f"{type(e).__name__}: {e}"))
        except Exception:  # noqa: BLE001
            pass
        print(f"tiered-moe engine: {type(e).__name__}: {e}", file=sys.stderr)
    finally:
        pull.close(0)
        push.close()
        ctx.term()
    return code


def _engine_stats(eng) -> dict:
    kv = eng.kv                      # the engine's KVManager
    return {"running": len(eng.running), "waiting": len(eng.waiting), "preemptions": eng.preemptions,
            "kv_blocks": {"used": kv.num_blocks - kv.free_blocks, "free": kv.free_blocks, "bytes": eng.model.kv.nbytes},
            "prefix_cache": {"queries": kv.queries, "hits": kv.hits}}


def _rank_stats(eng, stats: dict) -> dict:
    """Under tensor parallelism: the store figures that are per rank, from every rank (``ranks``); the
    others (hits, evictions, ...) are the same on every rank, and ``stats``' own are rank 0's."""
    snaps = eng.gather("snapshot")
    return {**stats, "ranks": [{"bytes": s["bytes"], "resident_bytes": s["resident_bytes"],
                                "capacity_bytes": s["capacity_bytes"], "stall_seconds": s["stall_seconds"]}
                               for s in snaps]}


def _take_messages(pull, eng, iid_of: dict, rid_of: dict) -> "list | None":
    """Every message waiting on ``pull`` (waits up to 100 ms when the engine is idle): requests added or
    aborted. Returns the rejected adds [[rid, why]], or None on shutdown."""
    import zmq
    rejected = []
    if not pull.poll(0 if eng.has_work() else 100):
        return rejected
    while True:
        try:
            msg = decode(pull.recv(flags=zmq.NOBLOCK))
        except zmq.Again:
            return rejected
        kind = msg["type"]
        if kind == "shutdown":
            return None
        if kind == "add":
            try:
                params = SamplingParams(**msg["params"])
                iid = eng.add_request(msg["prompt"], params, msg.get("cache_salt"))
            except (ValueError, TypeError) as e:
                rejected.append([msg["rid"], str(e)])
                continue
            iid_of[msg["rid"]] = iid
            rid_of[iid] = msg["rid"]
        elif kind == "abort":
            iid = iid_of.pop(msg["rid"], None)
            if iid is not None:
                eng.abort(iid)
                eng.forget(iid)
                rid_of.pop(iid, None)


def _prompt_logprobs(entries: "list | None") -> "list | None":
    """A request's prompt logprobs on the wire: [None, [logprob, rank, [[id, logprob], ...]], ...]."""
    if entries is None:
        return None
    return [None if e is None else [e.logprob, e.rank, [list(t) for t in e.top]] for e in entries]


def _step(eng, iid_of: dict, rid_of: dict, rejected: list) -> tuple:
    """One engine step -> (outputs [[rid, token, finish, logprobs, cached tokens, prompt logprobs]], failed [[rid, why]], the step's
    record); requests ended for their content (a grammar that failed while generating) join ``rejected``."""
    outputs, failed, record = [], [], {}
    res = eng.step_result()
    for o in res.outputs:
        if o.finish_reason == FinishReason.REJECTED:      # the client's error: a 400, not the engine failing
            rejected.append([rid_of[o.request_id], o.error or "rejected"])
        elif o.finish_reason == FinishReason.ERROR:
            failed.append([rid_of[o.request_id], o.error or "error"])
        elif o.token is not None:
            lp = None if o.logprobs is None else [o.logprobs.logprob, [list(t) for t in o.logprobs.top]]
            outputs.append([rid_of[o.request_id], int(o.token), o.finish_reason, lp, o.cached_tokens,
                            _prompt_logprobs(o.prompt_logprobs)])
        if o.finished:
            eng.forget(o.request_id)
            iid_of.pop(rid_of.pop(o.request_id), None)
    rec = res.record            # None: a step that ran nothing records nothing
    if rec is not None:
        record = asdict(rec)
        record["mean_unique_experts"] = sum(rec.unique_experts) / max(1, len(rec.unique_experts))
        del record["unique_experts"]
    if failed and rec is not None:
        print(f"tiered-moe engine: step {rec.step} failed {len(failed)} request(s): {failed[0][1]}",
              file=sys.stderr)
    return outputs, failed, record


def _serve(cfg: EngineConfig, pull, push, parent_pid: int) -> None:
    group = None
    if cfg.tensor_parallel * cfg.pipeline_parallel > 1:        # this process is rank 0; the others start here and follow its commands
        group = Group(cfg)
        try:
            model, store = group.load()
        except BaseException:
            group.close()
            raise
    else:
        model, store = cfg.load()      # sets the configured torch threads
    try:
        eng = group.make_engine(model, store, keep_records=False) if group is not None else \
            cfg.engine(model, store, keep_records=False)
        per_rank = (lambda st: _rank_stats(eng, st)) if group is not None else (lambda st: st)
        mc = model.cfg
        push.send(encode("ready", model=os.path.basename(os.path.abspath(cfg.model)), vocab_size=mc.vocab_size,
                         max_context=eng.max_context, longest_sequence=eng.longest_sequence, num_layers=mc.num_moe_layers, num_experts=mc.num_experts,
                         pid=os.getpid(), stats=per_rank({**store.snapshot(), **_engine_stats(eng)})))
        iid_of: dict = {}   # front-end request id -> engine id
        rid_of: dict = {}
        last_stats = 0.0
        while True:
            if os.getppid() != parent_pid:   # the front-end died without a shutdown: do not linger
                return
            rejected = _take_messages(pull, eng, iid_of, rid_of)
            if rejected is None:           # shutdown
                return
            outputs, failed, record = _step(eng, iid_of, rid_of, rejected) if eng.has_work() else ([], [], {})
            now = time.monotonic()
            if outputs or rejected or failed or record or now - last_stats > 1.0:
                stats = {**store.snapshot(), **_engine_stats(eng)}
                if now - last_stats > 1.0:       # the other ranks' figures: at most once a second (a collective)
                    stats = per_rank(stats)
                last_stats = now
                push.send(encode("step", outputs=outputs, rejected=rejected, failed=failed, record=record, stats=stats))
            elif group is not None:
                eng.idle()                       # the other ranks wait for the next command: keep them posted
    finally:
        store.close()
        if group is not None:
            group.close()


if __name__ == "__main__":
    import json
    code = engine_main(json.loads(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4]))
    # Everything is closed (the store, the ranks, the sockets): the interpreter's teardown (a second with torch
    # loaded, which a server's shutdown waits for) is skipped, as multiprocessing's children skip it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
