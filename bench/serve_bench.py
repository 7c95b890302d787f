"""Serving benchmark on loopback: throughput, time to first token and inter-token latency at
several concurrencies, with the expert-cache hit rate of each read from the server's /metrics -
the regime comparison seen from the server (issue 4).

A real `tiered-moe serve` process (engine process + HTTP front-end) on the demo's synthetic
checkpoint, device tier = --device-fraction of the experts, LRU + lookahead prefetch. Clients:
the official openai package, streaming, greedy, one thread per concurrent client, each sending
requests back to back.

Usage: python bench/serve_bench.py [--concurrency 1,4,16,32] [--requests-per-client 3] [--max-tokens 32] [--quick]
"""
import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)


def counters(url):
    text = urllib.request.urlopen(url + "/metrics").read().decode()
    out = {"hits": 0.0, "misses": 0.0, "h2d": 0.0, "gen": 0.0}
    for line in text.splitlines():
        if line.startswith("tiered_moe_expert_hits_total{") and 'tier="device"' in line:
            out["hits"] += float(line.rsplit(" ", 1)[1])
        elif line.startswith("tiered_moe_expert_misses_total{") and 'tier="device"' in line:
            out["misses"] += float(line.rsplit(" ", 1)[1])
        elif line.startswith('tiered_moe_transfer_bytes_total{link="host_to_device"}'):
            out["h2d"] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("tiered_moe_generation_tokens_total "):
            out["gen"] = float(line.rsplit(" ", 1)[1])
    return out


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))] if xs else float("nan")


def run_level(url, model, conc, per_client, max_tokens):
    import openai
    ttft, itl, toks, errors = [], [], [], []
    lock = threading.Lock()

    def client(ci):
        c = openai.OpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=300)
        for j in range(per_client):
            t0 = time.perf_counter()
            last, first, n = None, None, 0
            try:
                s = c.completions.create(model=model, prompt=f"client {ci} request {j}: ", max_tokens=max_tokens,
                                         temperature=0, stream=True, stream_options={"include_usage": True})
                for ch in s:
                    now = time.perf_counter()
                    if ch.choices and ch.choices[0].text:
                        if first is None:
                            first = now
                        elif last is not None:
                            with lock:
                                itl.append(now - last)
                        last = now
                    if ch.usage:
                        n = ch.usage.completion_tokens
            except Exception as e:  # noqa: BLE001
                with lock:
                    errors.append(repr(e))
                continue
            with lock:
                ttft.append(first - t0)
                toks.append(n)

    before = counters(url)
    t0 = time.perf_counter()
    ts = [threading.Thread(target=client, args=(i,)) for i in range(conc)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    wall = time.perf_counter() - t0
    after = counters(url)
    acc = (after["hits"] - before["hits"]) + (after["misses"] - before["misses"])
    return {"concurrency": conc, "requests": len(toks), "errors": len(errors), "generated_tokens": sum(toks),
            "seconds": wall, "tokens_per_s": sum(toks) / wall,
            "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99), "itl_p50_s": pct(itl, 50), "itl_p99_s": pct(itl, 99),
            "device_hit_rate": (after["hits"] - before["hits"]) / acc if acc else None,
            "host_to_device_bytes_per_token": (after["h2d"] - before["h2d"]) / max(1, sum(toks)),
            "server_generated_tokens": after["gen"] - before["gen"]}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", default="1,4,16,32")
    ap.add_argument("--requests-per-client", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--device-fraction", type=float, default=0.25)
    ap.add_argument("--threads", type=int, default=None, help="engine CPU threads (passed to serve --threads)")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "tiered-moe-bench-serve"))
    ap.add_argument("--out", default=os.path.join(HERE, "results", "serve_bench"))
    ap.add_argument("--quick", action="store_true", help="concurrency 1,4, one request each, 8 tokens")
    a = ap.parse_args(argv)
    if a.quick:
        a.concurrency, a.requests_per_client, a.max_tokens = "1,4", 1, 8
    levels = [int(x) for x in a.concurrency.split(",")]
    from runtime.model.convert import convert
    from runtime.model.synthetic import SyntheticModelSpec, build_checkpoint
    from runtime.store import Manifest
    spec = SyntheticModelSpec()
    hf, store = os.path.join(a.workdir, "hf"), os.path.join(a.workdir, "store")
    if not Manifest.current(store):
        build_checkpoint(hf, spec)
        convert(hf, store)
    m = Manifest.read(store)
    slots = max(spec.top_k, int(a.device_fraction * m.num_layers * m.num_experts))
    dense = os.path.getsize(os.path.join(store, "dense.safetensors"))
    budget = dense + slots * m.blob_stride
    cmd = [sys.executable, "-m", "runtime.cli", "serve", "--model", store, "--port", "0", "--device-budget", f"{budget}B",
           "--policy", "lru", "--prefetch", "lookahead", "--max-batch", str(max(levels))]
    if a.threads:
        cmd += ["--threads", str(a.threads)]
    p = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    rows = []
    try:
        line = p.stderr.readline()
        found = re.search(r"(http://[\d.]+:\d+)/v1", line)
        if not found:
            raise SystemExit(f"server did not start: {line}{p.stderr.read() if p.poll() is not None else ''}")
        url = found.group(1)
        model = json.loads(urllib.request.urlopen(url + "/v1/models").read())["data"][0]["id"]
        run_level(url, model, 1, 1, 4)   # warm-up: first loads from disk are not serving
        for c in levels:
            r = run_level(url, model, c, a.requests_per_client, a.max_tokens)
            rows.append(r)
            print(f"concurrency {c:>3}: {r['tokens_per_s']:7.1f} tok/s  TTFT p50 {r['ttft_p50_s'] * 1e3:7.1f} ms "
                  f"p99 {r['ttft_p99_s'] * 1e3:7.1f} ms  ITL p50 {r['itl_p50_s'] * 1e3:6.1f} ms p99 "
                  f"{r['itl_p99_s'] * 1e3:6.1f} ms  device hit rate {r['device_hit_rate']:.3f}  errors {r['errors']}",
                  flush=True)
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(30)
    base = rows[0]["tokens_per_s"]
    cmdline = "python bench/serve_bench.py" + (" --quick" if a.quick else "") + \
        (f" --threads {a.threads}" if a.threads else "")
    with open(a.out + ".json", "w") as f:
        json.dump({"command": cmdline, "device_fraction": a.device_fraction, "slots": slots, "rows": rows}, f, indent=1)
    import torch
    dev = "CUDA" if torch.cuda.is_available() else "CPU memory standing in for HBM"
    with open(a.out + ".md", "w") as f:
        f.write("# Serving benchmark (loopback)\n\n")
        f.write(f"Command: `{cmdline}`\n\n")
        f.write(f"Server: `tiered-moe serve` on the demo's synthetic checkpoint ({spec.num_layers} layers x "
                f"{spec.num_experts} experts, top-{spec.top_k}), device tier {slots} of {m.num_layers * m.num_experts} "
                f"experts ({dev}), LRU + lookahead prefetch, max batch {max(levels)}. Clients: the official openai "
                f"package, streaming, greedy, {a.requests_per_client} request(s) of {a.max_tokens} tokens per client, "
                f"back to back. Hit rate: device hits / (hits + misses) from /metrics over each level. "
                f"{os.cpu_count()} CPU cores shared by clients, front-end and engine.\n\n")
        f.write("| concurrency | requests | tokens/s | vs concurrency 1 | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms "
                "| device hit rate | host->device bytes per token | errors |\n|---|---|---|---|---|---|---|---|---|---|---|\n")
        for r in rows:
            f.write(f"| {r['concurrency']} | {r['requests']} | {r['tokens_per_s']:.1f} | {r['tokens_per_s'] / base:.2f}x | "
                    f"{r['ttft_p50_s'] * 1e3:.1f} | {r['ttft_p99_s'] * 1e3:.1f} | {r['itl_p50_s'] * 1e3:.1f} | "
                    f"{r['itl_p99_s'] * 1e3:.1f} | {r['device_hit_rate']:.3f} | {r['host_to_device_bytes_per_token']:,.0f} "
                    f"| {r['errors']} |\n")
    print(f"wrote {a.out}.md and .json")
    return rows


if __name__ == "__main__":
    main()
