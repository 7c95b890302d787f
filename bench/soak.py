"""Soak: minutes of mixed traffic against `tiered-moe serve` with faults injected (issue 10).

The server runs on the demo's synthetic checkpoint (loopback only) with a KV cache budget and
device/host budgets; client threads send, until the deadline, a mix of short and long
completions, streaming chats, hostile requests (extreme sampling values, invalid Unicode,
out-of-range integers, malformed JSON) and clients that disconnect mid-request. A fault thread
kills the engine with SIGKILL and, alternately, freezes it with SIGSTOP (caught by the
heartbeat). A sampler records the resident memory of both processes every second.

Reported: requests by outcome, errors by cause, engine restarts, latency p50 / p99 of
successful non-streaming requests, and two goals (issue 21): the peak RSS of each process within
its budget plus a stated margin - the engine: the runtime's floor (a Python process that imported
torch and the runtime) + dense weights + host tier + device slots + KV cache + ENGINE_MARGIN; the
front-end: its RSS once serving + one body limit per client + FRONT_MARGIN - and no Prometheus
counter going backwards (scraped every second, across the engine restarts). Traffic mixes short,
long (300-900 prompt tokens) and very long (3,000-token completions) requests. Not in CI (it runs
for minutes).

Usage: python bench/soak.py [--minutes 10] [--out bench/results/soak.md]
"""
import argparse
import http.client
import json
import os
import platform
import random
import signal
import socket
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from runtime.model.convert import convert  # noqa: E402
from runtime.model.synthetic import SyntheticModelSpec, build_checkpoint  # noqa: E402
from runtime.serve.api import Server  # noqa: E402
from runtime.serve.engine_proc import EngineConfig  # noqa: E402
from runtime.store import Manifest  # noqa: E402

MiB = 1 << 20
ENGINE_MARGIN = 256 * MiB     # allocator slack, per-step temporaries, the tokenizer, ZeroMQ buffers
FRONT_MARGIN = 64 * MiB


def runtime_floor() -> int:
    """RSS of a fresh Python that imported torch and the engine's modules: what every engine costs before
    its model."""
    import subprocess
    code = ("import torch, runtime.engine, runtime.model, runtime.serve.engine_proc; "
            "print(next(int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith('VmRSS')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=os.path.dirname(HERE),
                         env=dict(os.environ, PYTHONPATH=os.path.dirname(HERE)), timeout=120)
    return int(out.stdout.strip())


def counters(srv) -> dict:
    """Every counter sample of /metrics: series -> value."""
    import urllib.request
    out = {}
    for line in urllib.request.urlopen(srv.url + "/metrics", timeout=10).read().decode().splitlines():
        if line and not line.startswith("#"):
            series, v = line.rsplit(" ", 1)
            if series.split("{")[0].endswith(("_total", "_count", "_sum")):
                out[series] = float(v)
    return out


def rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class Stats:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.outcomes: dict = {}
        self.latency: list = []

    def add(self, kind: str, outcome: str, seconds: "float | None" = None) -> None:
        with self.lock:
            self.outcomes[(kind, outcome)] = self.outcomes.get((kind, outcome), 0) + 1
            if seconds is not None:
                self.latency.append(seconds)


def request(srv, body, timeout=120.0):
    c = http.client.HTTPConnection(srv.host, srv.port, timeout=timeout)
    try:
        raw = body if isinstance(body, (bytes, str)) else json.dumps(body)
        c.request("POST", "/v1/completions" if "prompt" in str(raw)[:400] else "/v1/chat/completions", body=raw,
                  headers={"Content-Type": "application/json"})
        r = c.getresponse()
        data = r.read()
        code = None
        if r.status != 200:
            try:
                code = json.loads(data)["error"].get("code")
            except (ValueError, KeyError, TypeError):
                code = "?"
        return r.status, code
    finally:
        c.close()


def client_loop(srv, stats: Stats, deadline: float, seed: int) -> None:
    rng = random.Random(seed)
    m = srv.model_name
    while time.time() < deadline:
        kind = rng.choices(["short", "long", "longest", "stream", "hostile", "disconnect"], [5, 1, 0.3, 2, 2, 1])[0]
        t0 = time.time()
        try:
            if kind == "short":
                st, code = request(srv, {"model": m, "prompt": [rng.randrange(500) for _ in range(rng.randint(4, 64))],
                                         "max_tokens": 16, "temperature": 0.8, "seed": rng.randrange(1 << 30)})
            elif kind == "longest":    # a 3,000-token completion: memory must not grow with it
                st, code = request(srv, {"model": m, "prompt": [rng.randrange(500) for _ in range(rng.randint(4, 64))],
                                         "max_tokens": 3000, "temperature": 0.8, "ignore_eos": True}, timeout=600)
            elif kind == "long":
                st, code = request(srv, {"model": m, "prompt": [rng.randrange(500) for _ in range(rng.randint(300, 900))],
                                         "max_tokens": 128})
            elif kind == "stream":
                c = http.client.HTTPConnection(srv.host, srv.port, timeout=120)
                c.request("POST", "/v1/chat/completions", headers={"Content-Type": "application/json"},
                          body=json.dumps({"model": m, "messages": [{"role": "user", "content": "stream " * 20}],
                                           "max_tokens": 48, "stream": True}))
                r = c.getresponse()
                body = r.read().decode(errors="replace")
                c.close()
                st = r.status
                code = "stream_error_event" if '"error"' in body else None
            elif kind == "hostile":
                body = rng.choice([
                    {"model": m, "prompt": "x", "max_tokens": 4, "temperature": 1e-300},
                    {"model": m, "prompt": "x", "max_tokens": 4, "top_p": 1e-46, "temperature": 1.0},
                    {"model": m, "prompt": "x", "max_tokens": 4, "seed": 2 ** 64},
                    {"model": m, "prompt": "x", "max_tokens": 4, "top_k": 2 ** 70},
                    json.dumps({"model": m, "prompt": "bad \ud800 text", "max_tokens": 4}),
                    "[" * 50_000 + "]" * 50_000,
                    {"model": m, "prompt": "x", "max_tokens": 10 ** 9},
                ])
                st, code = request(srv, body)
            else:   # a client that sends a long request and goes away
                s = socket.create_connection((srv.host, srv.port), timeout=10)
                b = json.dumps({"model": m, "prompt": "bye", "max_tokens": 2000}).encode()
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                          b"Content-Length: " + str(len(b)).encode() + b"\r\n\r\n" + b)
                time.sleep(rng.uniform(0.1, 1.0))
                s.close()
                st, code = 0, "client_left"
            outcome = "ok" if st == 200 and code is None else f"{st} {code}"
            stats.add(kind, outcome, time.time() - t0 if (st == 200 and kind in ("short", "long") and code is None)
                      else None)
        except (OSError, http.client.HTTPException) as e:
            stats.add(kind, f"client error {type(e).__name__}")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--fault-every", type=float, default=90.0, help="seconds between injected engine faults")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "soak.md"))
    ap.add_argument("--workdir", default=None)
    return ap.parse_args()


def prepare_store(work: str) -> str:
    """The demo's synthetic checkpoint, converted under ``work`` (kept if it is current)."""
    hf, store = os.path.join(work, "hf"), os.path.join(work, "store")
    if not Manifest.current(store):
        build_checkpoint(hf, SyntheticModelSpec())
        convert(hf, store)
    return store


def sampler(srv, stop: threading.Event, peaks: dict, drops: list) -> None:
    """Every second: the peak RSS of both processes, and every counter of /metrics that went backwards."""
    high: dict = {}
    while not stop.is_set():
        peaks["front_end"] = max(peaks["front_end"], rss(os.getpid()))
        p = srv.engine.proc
        if p is not None:
            peaks["engine"] = max(peaks["engine"], rss(p.pid))
        try:
            now = counters(srv)
        except OSError:
            now = {}
        for k, v in now.items():
            if v < high.get(k, 0.0):
                drops.append({"series": k, "from": high[k], "to": v})
            high[k] = max(high.get(k, 0.0), v)
        stop.wait(1.0)


def faulter(srv, stop: threading.Event, every: float, started: float, faults: list) -> None:
    """Every ``every`` seconds, a live engine gets SIGKILL or (alternately) SIGSTOP."""
    n = 0
    while not stop.wait(every):
        p = srv.engine.proc
        if p is None or p.poll() is not None or not srv.engine.alive:
            continue
        sig = signal.SIGKILL if n % 2 == 0 else signal.SIGSTOP
        os.kill(p.pid, sig)
        faults.append({"t": round(time.time() - started, 1), "signal": sig.name})
        n += 1


def run_traffic(srv, a, stats: Stats, deadline: float, peaks: dict, drops: list, faults: list) -> None:
    """The sampler, the faulter and the clients until the deadline (the clients' requests then finish)."""
    stop = threading.Event()
    threads = [threading.Thread(target=sampler, args=(srv, stop, peaks, drops), daemon=True),
               threading.Thread(target=faulter, args=(srv, stop, a.fault_every, deadline - 60 * a.minutes, faults),
                                daemon=True)]
    threads += [threading.Thread(target=client_loop, args=(srv, stats, deadline, i), daemon=True) for i in range(a.clients)]
    from tqdm import tqdm
    for t in threads:
        t.start()
    with tqdm(total=int(60 * a.minutes), desc="soak", unit="s") as bar:
        while time.time() < deadline:
            time.sleep(1)
            bar.update(1)
    for t in threads[2:]:
        t.join(180)
    stop.set()


def main() -> None:
    a = parse_args()
    work = a.workdir or tempfile.mkdtemp(prefix="tiered-moe-soak-")
    store = prepare_store(work)
    m = Manifest.read(store)
    budgets = {"expert_budget": 64 * m.blob_stride, "host_budget": None, "kv_cache_budget": 64 * MiB}
    cfg = EngineConfig(model=store, expert_budget=budgets["expert_budget"], kv_cache_budget=budgets["kv_cache_budget"],
                       max_batch=8, prefill_chunk=64, policy="lru", threads=1)
    floor = runtime_floor()
    srv = Server(cfg, port=0, timeout=15.0, heartbeat_timeout=5.0).start()
    front_start = rss(os.getpid())
    from runtime.plan import dense_bytes, dense_shapes
    import torch
    dense = dense_bytes(list(dense_shapes(store).values()), torch.float32)
    stats = Stats()
    drops: list = []
    deadline = time.time() + 60 * a.minutes
    peaks = {"front_end": 0, "engine": 0}
    faults: list = []
    run_traffic(srv, a, stats, deadline, peaks, drops, faults)
    restarts = srv.engine.restarts
    health = srv.engine.alive
    kv_bytes = 64 * MiB
    srv.close()
    lat = sorted(stats.latency)

    def pct(p):
        return lat[min(len(lat) - 1, int(p * len(lat)))] if lat else float("nan")

    total = sum(stats.outcomes.values())
    served = sum(v for (k, o), v in stats.outcomes.items() if o == "ok")
    from runtime.serve.api import MAX_BODY
    host_all = m.num_layers * m.num_experts * m.blob_stride
    allowed = {"engine": floor + dense + host_all + budgets["expert_budget"] + kv_bytes + ENGINE_MARGIN,
               "front_end": front_start + a.clients * MAX_BODY + FRONT_MARGIN}
    goals = {k: peaks[k] <= allowed[k] for k in allowed}
    R = {"minutes": a.minutes, "clients": a.clients, "requests": total, "served_ok": served,
         "allowed_rss_bytes": allowed, "rss_goals_met": goals, "runtime_floor_bytes": floor, "dense_bytes": dense,
         "front_end_start_bytes": front_start, "counter_drops": drops,
         "outcomes": {f"{k}: {o}": v for (k, o), v in sorted(stats.outcomes.items())},
         "faults_injected": faults, "engine_restarts": restarts, "engine_alive_at_end": health,
         "latency_s": {"p50": pct(0.5), "p99": pct(0.99), "n": len(lat)},
         "peak_rss_bytes": peaks, "budgets": {**budgets, "expert_bytes_all_in_host": m.num_layers * m.num_experts * m.blob_stride}}
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(os.path.splitext(a.out)[0] + ".json", "w") as f:
        json.dump(R, f, indent=1)
    L = report_lines(R, a, m, kv_bytes)
    with open(a.out, "w") as f:
        f.write("\n".join(L) + "\n")
    print("\n".join(L))


def report_lines(R: dict, a, m, kv_bytes: int) -> "list[str]":
    """The Markdown report of the soak's results ``R``."""
    from runtime.serve.api import MAX_BODY
    allowed, goals, peaks, lat = R["allowed_rss_bytes"], R["rss_goals_met"], R["peak_rss_bytes"], R["latency_s"]
    floor, dense, front_start = R["runtime_floor_bytes"], R["dense_bytes"], R["front_end_start_bytes"]
    restarts, budgets, host_all = R["engine_restarts"], R["budgets"], R["budgets"]["expert_bytes_all_in_host"]
    L = ["# Soak: mixed traffic with injected engine faults\n",
         f"Command: `python bench/soak.py --minutes {a.minutes:g}`\n",
         f"Machine: {platform.machine()}, {os.cpu_count()} cores. Server: the demo's synthetic checkpoint "
         f"({m.num_layers} layers x {m.num_experts} experts of {m.blob_bytes:,} bytes), device tier 64 experts, every "
         f"expert in host memory ({host_all / MiB:.0f} MiB), KV cache budget "
         f"{kv_bytes / MiB:.0f} MiB, max batch 8, socket timeout 15 s, heartbeat timeout 5 s; {a.clients} client "
         f"threads on loopback; an engine fault every {a.fault_every:g} s (SIGKILL and SIGSTOP alternately).\n",
         f"- requests: {R['requests']:,}, served OK: {R['served_ok']:,}",
         f"- engine faults injected: {len(R['faults_injected'])}; restarts: {restarts}; engine up at the end: "
         f"{R['engine_alive_at_end']}",
         f"- latency of successful short/long completions: p50 {lat['p50']:.2f} s, p99 {lat['p99']:.2f} s "
         f"({lat['n']} requests)",
         f"- **engine peak RSS {peaks['engine'] / MiB:.0f} MiB, allowed {allowed['engine'] / MiB:.0f} MiB: "
         f"{'met' if goals['engine'] else 'NOT met'}** (runtime floor {floor / MiB:.0f} + dense {dense / MiB:.0f} + host "
         f"tier {host_all / MiB:.0f} + device slots {budgets['expert_budget'] / MiB:.0f} + KV {kv_bytes / MiB:.0f} + "
         f"margin {ENGINE_MARGIN / MiB:.0f} MiB)",
         f"- **front-end peak RSS {peaks['front_end'] / MiB:.0f} MiB, allowed {allowed['front_end'] / MiB:.0f} MiB: "
         f"{'met' if goals['front_end'] else 'NOT met'}** (its RSS once serving {front_start / MiB:.0f} + {a.clients} "
         f"bodies of {MAX_BODY / MiB:.0f} MiB + margin {FRONT_MARGIN / MiB:.0f} MiB; this process also runs the client "
         f"threads)",
         f"- **counters that went backwards: {len(R['counter_drops'])}** (every `_total` / `_count` / `_sum` series of "
         f"/metrics, scraped each second across {restarts} engine restarts)\n",
         "| request kind: outcome | count |", "|---|---|"]
    L += [f"| {k} | {v} |" for k, v in R["outcomes"].items()]
    L.append("\nOutcomes: `ok`; `400 None`: refused hostile input (the OpenAI error object); `503 engine_unavailable`: "
             "in flight while the engine was killed or frozen (the supervisor restarted it); `500 engine_error`: "
             "failed in the engine; `stream_error_event`: a stream cut by an engine fault ends with an error event; "
             "`client_left`: the client disconnected on purpose (the server aborts its request).")
    return L


if __name__ == "__main__":
    main()
