"""Issue 32's flood: what expensive or refused grammars sent by other clients cost a normal request.

A served store (the demo's synthetic checkpoint, built and converted here; ``tiered-moe serve`` in its own process, as
a user runs it). One client sends normal chat requests back to back: first alone for ``--seconds`` (the baseline),
then while ``--flooders`` clients send grammars for ``--seconds``: half of them a response_format json_schema with a
100,000-value enum, half 500 tools with tool_choice "required" - each request's values or tool names new (no
verdict or compiled grammar is reused: the worst case for admission and the engine). Reports the normal request's
latency (median, p90, max) in both phases, their ratio, what the flood got back, and the load average.

    .venv/bin/python bench/grammar_flood.py --out bench/results/grammar_flood.md
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build_store(d: str) -> str:
    """The demo's synthetic checkpoint (runtime/model/synthetic.py defaults), converted to a store."""
    sys.path.insert(0, ROOT)
    from runtime.model.convert import convert
    from runtime.model.synthetic import SyntheticModelSpec, build_checkpoint
    build_checkpoint(os.path.join(d, "hf"), SyntheticModelSpec())
    convert(os.path.join(d, "hf"), os.path.join(d, "store"))
    return os.path.join(d, "store")


def free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as s:
        return s.getsockname()[1]


def post(port: int, body: dict, timeout: float = 120.0) -> "tuple[int, dict]":
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request("POST", "/v1/chat/completions", body if isinstance(body, str) else json.dumps(body),
                  {"Content-Type": "application/json"})
        r = c.getresponse()
        return r.status, json.loads(r.read() or b"{}")
    finally:
        c.close()


def normal(model: str) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "Tell me about the weather."}],
            "max_tokens": 16, "temperature": 0}


def enum_request(model: str, k: int) -> dict:
    schema = {"type": "object", "properties": {"v": {"enum": [f"v{k}-{i}" for i in range(100000)]}}}
    return {"model": model, "messages": [{"role": "user", "content": "pick"}], "max_tokens": 16,
            "response_format": {"type": "json_schema", "json_schema": {"name": "pick", "schema": schema}}}


def tools_request(model: str, k: int) -> dict:
    tools = [{"type": "function", "function": {"name": f"t{k}_{i}", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 8}},
        "required": ["a"]}}} for i in range(500)]
    return {"model": model, "messages": [{"role": "user", "content": "call one"}], "max_tokens": 32,
            "tools": tools, "tool_choice": "required"}


def timed_loop(port: int, model: str, stop: threading.Event, out: list) -> None:
    while not stop.is_set():
        t = time.perf_counter()
        status, _ = post(port, normal(model))
        out.append((time.perf_counter() - t, status))


def flooder(port: int, model: str, kind: str, seed: int, stop: threading.Event, got: Counter) -> None:
    # the load generator shares this machine's cores with the server it measures (its clients would be elsewhere):
    # its threads run at the lowest priority, the timed client at the normal one
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    k = seed * 1_000_000
    # the enum bodies (1.5 MB of JSON each) written beforehand, 8 per client taken in turn: the client's own JSON
    # work would take the CPU of this 2-core machine from the server it measures
    enums = [json.dumps(enum_request(model, k + i)) for i in range(8)] if kind == "enum" else []
    while not stop.is_set():
        k += 1
        body = enums[k % len(enums)] if kind == "enum" else tools_request(model, k)
        if kind == "plain":             # the control: the tools request without its tools (no grammar)
            body = {**body, "tools": None, "tool_choice": None}
        try:
            status, data = post(port, body)
            got[(kind, status, (data.get("error") or {}).get("code"))] += 1
        except OSError as e:
            got[(kind, type(e).__name__, None)] += 1


def single(port: int, model: str) -> dict:
    """The issue's expensive requests, each alone: seconds, status and tokens of 200 and 500 tools with tool_choice
    required (41 tokens) and of one tool with 1,000 parameters (400 tokens)."""
    def one_tool(n: int) -> dict:
        return {"type": "function", "function": {"name": "wide", "parameters": {
            "type": "object", "properties": {f"p{j}": {"type": "integer"} for j in range(n)}}}}
    cases = {"200 tools": {**tools_request(model, 1), "tools": tools_request(model, 1)["tools"][:200],
                           "max_tokens": 41},
             "500 tools": {**tools_request(model, 2), "max_tokens": 41},
             "1 tool, 1,000 parameters": {**tools_request(model, 3), "tools": [one_tool(1000)], "max_tokens": 400}}
    out = {}
    for name, body in cases.items():
        body = {**body, "temperature": 1.0, "seed": 1}
        t = time.perf_counter()
        status, data = post(port, body)
        out[name] = {"seconds": round(time.perf_counter() - t, 3), "status": status,
                     "tokens": (data.get("usage") or {}).get("completion_tokens"),
                     "error": ((data.get("error") or {}).get("message") or "")[:160]}
    return out


def stats(xs: list) -> dict:
    xs = sorted(xs)
    return {"n": len(xs), "median": statistics.median(xs), "p90": xs[min(len(xs) - 1, int(0.9 * len(xs)))],
            "max": xs[-1]}


def phase(port: int, model: str, seconds: float, flooders: int, kinds: list) -> "tuple[dict, Counter]":
    stop, lat, got = threading.Event(), [], Counter()
    threads = [threading.Thread(target=flooder, args=(port, model, kinds[i % len(kinds)], i, stop, got))
               for i in range(flooders)]
    for t in threads:
        t.start()
    if flooders:
        time.sleep(2.0)                     # the flood under way before the first timed request
    timer = threading.Thread(target=timed_loop, args=(port, model, stop, lat))
    timer.start()
    time.sleep(seconds)
    stop.set()
    for t in [timer, *threads]:
        t.join()
    bad = [s for _, s in lat if s != 200]
    if bad:
        raise SystemExit(f"normal requests failed: {Counter(bad)}")
    return stats([x for x, _ in lat]), got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--flooders", type=int, default=8)
    ap.add_argument("--kinds", default="enum,tools",
                    help="what the flooders send, taken in turn: enum, tools, plain (the tools request without tools)")
    ap.add_argument("--single", action="store_true", help="instead: each expensive request alone (the issue's cases)")
    ap.add_argument("--out", default=None, help="write the result as markdown here")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        store = build_store(d)
        port = free_port()
        # this tree's runtime (the script's), as `tiered-moe serve`
        srv = subprocess.Popen([sys.executable, "-m", "runtime.cli", "serve", "--model", store, "--port", str(port),
                                "--max-batch", "16"], cwd=ROOT)
        try:
            model = wait_ready(port, srv)
            post(port, normal(model))                           # warm: the first request's one-time costs
            if a.single:
                return print(json.dumps(single(port, model), indent=1))
            load0 = os.getloadavg()
            base, _ = phase(port, model, a.seconds, 0, [])
            flood, got = phase(port, model, a.seconds, a.flooders, a.kinds.split(","))
            load1 = os.getloadavg()
        finally:
            srv.terminate()
            srv.wait(30)
    report(a, base, flood, got, load0, load1)


def wait_ready(port: int, srv) -> str:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if srv.poll() is not None:
            raise SystemExit("the server exited")
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            c.request("GET", "/v1/models")
            return json.loads(c.getresponse().read())["data"][0]["id"]
        except (OSError, ValueError, KeyError):
            time.sleep(0.5)
    raise SystemExit("the server did not start")


def report(a, base: dict, flood: dict, got: Counter, load0, load1) -> None:
    ratio = {k: flood[k] / base[k] for k in ("median", "p90", "max")}
    lines = ["# Grammar flood (issue 32)", "",
             f"Command: `.venv/bin/python bench/grammar_flood.py --seconds {a.seconds:g} --flooders {a.flooders} "
             f"--kinds {a.kinds}"
             + (f" --out {a.out}`" if a.out else "`"), "",
             "A normal request (chat, 16 tokens, greedy) sent back to back, alone and while "
             f"{a.flooders} clients send grammars (half a 100,000-value enum response_format, half 500 tools with "
             "tool_choice required; each request new). Demo store (synthetic, 512-token vocabulary), "
             "`tiered-moe serve --max-batch 16` in its own process; the flooding clients run on the same 2 cores "
             "at nice 19.", "",
             "| phase | requests | median s | p90 s | max s |", "|---|---|---|---|---|",
             f"| alone | {base['n']} | {base['median']:.3f} | {base['p90']:.3f} | {base['max']:.3f} |",
             f"| under the flood | {flood['n']} | {flood['median']:.3f} | {flood['p90']:.3f} | {flood['max']:.3f} |",
             f"| ratio | | {ratio['median']:.2f}x | {ratio['p90']:.2f}x | {ratio['max']:.2f}x |", "",
             "What the flood got back (kind, status, error code): "
             + ", ".join(f"{k[0]} {k[1]} {k[2] or ''}: {n}".replace("  ", " ")
                         for k, n in sorted(got.items(), key=str)),
             "", f"Load average (1, 5, 15 min) before: {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}; after: "
             f"{load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f} ({os.cpu_count()} CPUs).", ""]
    text = "\n".join(lines)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
