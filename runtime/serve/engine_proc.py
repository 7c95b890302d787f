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
from dataclasses import asdict, dataclass

from .protocol import decode, encode


@dataclass
class EngineConfig:
    model: str
    device_budget: "int | None" = None
    kv_cache_budget: int = 0
    host_budget: "int | None" = None
    policy: str = "reuse"
    scope: str = "global"
    prefetch: str = "none"
    max_batch: int = 16
    prefill_chunk: int = 64
    threads: "int | None" = None
    expert_budget: "int | None" = None   # bytes of device expert slots directly (instead of device_budget)
    cache_bonus: float = 0.0
    schedule: str = "fcfs"
    max_active: "int | None" = None
    cpu_experts: str = "0"               # 0 | N | auto: hybrid execution (ExpertStore)
    prefetch_rule: str = "cost"          # cost | always (cache_policy.prefetch.PrefetchGate)
    profile: "str | None" = None         # hardware profile of the cost decisions (default: cpu / h200)

    def __post_init__(self) -> None:
        if not os.path.isfile(os.path.join(self.model, "manifest.json")):
            raise ValueError(f"--model {self.model!r}: not a store directory (no manifest.json); "
                             f"run 'tiered-moe convert' first")
        from cache_policy.policies import LIVE_POLICIES
        from cache_policy.prefetch import LIVE_PREFETCHERS
        if self.policy not in LIVE_POLICIES:
            raise ValueError(f"--policy {self.policy!r}: use {', '.join(LIVE_POLICIES)}")
        if self.scope not in ("layer", "global"):
            raise ValueError(f"--scope {self.scope!r}: use layer or global")
        if self.prefetch not in LIVE_PREFETCHERS:
            raise ValueError(f"--prefetch {self.prefetch!r}: use {', '.join(LIVE_PREFETCHERS)}")
        if self.max_batch < 1 or self.prefill_chunk < 1:
            raise ValueError("--max-batch and --prefill-chunk must be at least 1")
        if not self.cache_bonus >= 0:
            raise ValueError(f"--cache-bonus must be >= 0, got {self.cache_bonus}")
        if self.schedule not in ("fcfs", "expert-aware"):
            raise ValueError(f"--schedule {self.schedule!r}: use fcfs or expert-aware")
        if self.max_active is not None and self.max_active < self.max_batch:
            raise ValueError(f"--max-active ({self.max_active}) must be at least --max-batch ({self.max_batch})")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"--threads must be at least 1, got {self.threads}")
        from cache_policy.cost_model import load_profile
        from cache_policy.keys import CpuExperts
        from cache_policy.replay import PREFETCH_RULES
        self.cpu_experts = str(CpuExperts.parse(self.cpu_experts))
        if self.prefetch_rule not in PREFETCH_RULES:
            raise ValueError(f"--prefetch-rule {self.prefetch_rule!r}: use {', '.join(PREFETCH_RULES)}")
        if self.profile is not None:
            load_profile(self.profile)


def engine_main(cfg: dict, to_engine: str, from_engine: str, parent_pid: int) -> int:
    """Entry point of the spawned engine process. Returns the exit code: 0 after a shutdown, 1
    when it failed (the supervisor in the front-end restarts it)."""
    import zmq
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
    kv = eng.model.kv
    return {"running": len(eng.running), "waiting": len(eng.waiting), "preemptions": eng.preemptions,
            "kv_blocks": {"used": kv.num_blocks - kv.free_blocks, "free": kv.free_blocks, "bytes": kv.nbytes}}


def _serve(cfg: EngineConfig, pull, push, parent_pid: int) -> None:
    import torch
    import zmq
    from ..engine import Engine, FinishReason, SamplingParams
    from ..model import load_model
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    model, store = load_model(cfg.model, device_budget=cfg.device_budget, expert_budget=cfg.expert_budget, kv_cache_bytes=cfg.kv_cache_budget,
                              host_budget=cfg.host_budget, policy=cfg.policy, scope=cfg.scope,
                              cpu_experts=cfg.cpu_experts, profile=cfg.profile, max_batch=cfg.max_batch)
    try:
        eng = Engine(model, store, max_batch=cfg.max_batch, prefill_chunk=cfg.prefill_chunk, prefetch=cfg.prefetch,
                     cache_bonus=cfg.cache_bonus, schedule=cfg.schedule, max_active=cfg.max_active,
                     prefetch_rule=cfg.prefetch_rule, keep_records=False)
        mc = model.cfg
        push.send(encode("ready", model=os.path.basename(os.path.abspath(cfg.model)), vocab_size=mc.vocab_size,
                         max_context=eng.max_context, num_layers=mc.num_moe_layers, num_experts=mc.num_experts,
                         pid=os.getpid(), stats={**store.snapshot(), **_engine_stats(eng)}))
        iid_of: dict = {}   # front-end request id -> engine id
        rid_of: dict = {}
        last_stats = 0.0
        while True:
            if os.getppid() != parent_pid:   # the front-end died without a shutdown: do not linger
                return
            rejected = []
            if pull.poll(0 if eng.has_work() else 100):
                while True:
                    try:
                        msg = decode(pull.recv(flags=zmq.NOBLOCK))
                    except zmq.Again:
                        break
                    kind = msg["type"]
                    if kind == "shutdown":
                        return
                    if kind == "add":
                        try:
                            params = SamplingParams(**msg["params"])
                            iid = eng.add_request(msg["prompt"], params)
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
            outputs, failed, record = [], [], {}
            if eng.has_work():
                res = eng.step_result()
                for o in res.outputs:
                    if o.finish_reason == FinishReason.ERROR:
                        failed.append([rid_of[o.request_id], o.error or "error"])
                    elif o.token is not None:
                        outputs.append([rid_of[o.request_id], int(o.token), o.finish_reason])
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
            now = time.monotonic()
            if outputs or rejected or failed or record or now - last_stats > 1.0:
                last_stats = now
                stats = {**store.snapshot(), **_engine_stats(eng)}
                push.send(encode("step", outputs=outputs, rejected=rejected, failed=failed, record=record, stats=stats))
    finally:
        store.close()


if __name__ == "__main__":
    import json
    sys.exit(engine_main(json.loads(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])))
