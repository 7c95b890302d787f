"""Prometheus metrics: promtool's linter, naming rules, and a real Prometheus server scraping a
live server and answering a hit-rate query through its HTTP API."""
import json
import os
import re
import socket
import subprocess
import time
import urllib.parse
import urllib.request

from servehelp import KEY, promtool, require_tool

HIT_RATE = ('sum(tiered_moe_expert_hits_total{tier="device"}) / (sum(tiered_moe_expert_hits_total{tier="device"}) '
            '+ sum(tiered_moe_expert_misses_total{tier="device"}))')
HIT_RATE_PANEL = ('sum(rate(tiered_moe_expert_hits_total{tier="device"}[1m])) / '
                  '(sum(rate(tiered_moe_expert_hits_total{tier="device"}[1m])) + '
                  'sum(rate(tiered_moe_expert_misses_total{tier="device"}[1m])))')
ALLOWED_LABELS = {"where", "tier", "layer", "link", "finish_reason", "le", "state", "cause"}
CLOSED = {"where": {"device", "host"}, "state": {"used", "free"}, "cause": {"engine", "engine_exit"}, "tier": {"device", "host"},
          "link": {"disk_to_host", "host_to_device"}, "finish_reason": {"stop", "length", "abort", "error"}}


def scrape(srv) -> str:
    return urllib.request.urlopen(srv.url + "/metrics").read().decode()


def traffic(srv, n=6):
    import openai
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0)
    for i in range(n):
        c.completions.create(model=srv.model_name, prompt=f"metrics {i} " * (i + 1), max_tokens=10)


def samples(text):
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            m = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)", line)
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            out[(m.group(1), tuple(sorted(labels.items())))] = float(m.group(3))
    return out


def test_promtool_accepts_the_metrics(server):
    traffic(server, 2)
    r = subprocess.run([require_tool("promtool"), "check", "metrics"], input=scrape(server), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip() == "" and r.stderr.strip() == "", r.stdout + r.stderr   # no lint warnings either


def test_names_prefix_units_and_bounded_labels(server):
    traffic(server, 2)
    s = samples(scrape(server))
    names = {n for n, _ in s}
    assert all(n.startswith("tiered_moe_") for n in names if not n.startswith(("python_", "process_")))
    for _, labels in s:
        assert {k for k, _ in labels} <= ALLOWED_LABELS
        assert all(v in CLOSED[k] for k, v in labels if k in CLOSED), labels
    layers = {v for _, labels in s for k, v in labels if k == "layer"}
    assert layers == {"0", "1"}   # one per MoE layer, never per expert or request
    need = ["tiered_moe_expert_hits_total", "tiered_moe_expert_misses_total", "tiered_moe_transfer_bytes_total",
            "tiered_moe_expert_evictions_total", "tiered_moe_prefetch_issued_total", "tiered_moe_prefetch_used_total",
            "tiered_moe_prefetch_wasted_total", "tiered_moe_resident_experts", "tiered_moe_resident_bytes",
            "tiered_moe_kv_cache_blocks", "tiered_moe_kv_cache_bytes", "tiered_moe_preemptions_total",
            "tiered_moe_engine_restarts_total", "tiered_moe_expert_load_errors_total",
            "tiered_moe_capacity_bytes", "tiered_moe_expert_stall_seconds_bucket", "tiered_moe_step_duration_seconds_bucket",
            "tiered_moe_step_batch_size_bucket", "tiered_moe_step_unique_experts_bucket", "tiered_moe_requests_running",
            "tiered_moe_requests_waiting", "tiered_moe_time_to_first_token_seconds_bucket",
            "tiered_moe_inter_token_latency_seconds_bucket", "tiered_moe_prompt_tokens_total",
            "tiered_moe_generation_tokens_total", "tiered_moe_expert_compute_total",
            "tiered_moe_host_expert_compute_seconds_total", "tiered_moe_prefetch_cancelled_total"]
    assert [n for n in need if n not in names] == []
    # The counters agree with each other: every device access is a hit or a miss, and the cache did both.
    hits = sum(v for (n, lb), v in s.items() if n == "tiered_moe_expert_hits_total" and ("tier", "device") in lb)
    miss = sum(v for (n, lb), v in s.items() if n == "tiered_moe_expert_misses_total" and ("tier", "device") in lb)
    assert hits > 0 and miss > 0
    assert s[("tiered_moe_capacity_experts", (("tier", "device"),))] == 4
    assert s[("tiered_moe_resident_experts", (("tier", "device"),))] <= 4
    moved = s[("tiered_moe_transfer_bytes_total", (("link", "host_to_device"),))]
    from runtime.store import Manifest
    assert moved == miss * Manifest.read(server.cfg.model).blob_bytes   # one blob per device miss
    # Without --cpu-experts every needed expert is computed on the device.
    assert s[("tiered_moe_expert_compute_total", (("where", "device"),))] == hits + miss
    assert s[("tiered_moe_expert_compute_total", (("where", "host"),))] == 0


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _query(base, expr):
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    d = json.loads(urllib.request.urlopen(url, timeout=10).read())
    assert d["status"] == "success", d
    return d["data"]["result"]


def test_real_prometheus_scrapes_and_answers_a_hit_rate_query(server, tmp_path):
    prom = require_tool("prometheus")
    port = _free_port()
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(f"global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: tiered-moe\n"
                   f"    static_configs:\n      - targets: ['{server.host}:{server.port}']\n")
    assert promtool("check", "config", str(cfg)).returncode == 0
    p = subprocess.Popen([prom, f"--config.file={cfg}", f"--storage.tsdb.path={tmp_path / 'data'}",
                          f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL,
                         stderr=open(tmp_path / "prometheus.log", "w"))
    base = f"http://127.0.0.1:{port}"
    try:
        traffic(server, 4)
        s = samples(scrape(server))
        dev = lambda n: sum(v for (m, lb), v in s.items() if m == n and ("tier", "device") in lb)  # noqa: E731
        ours = dev("tiered_moe_expert_hits_total") / (dev("tiered_moe_expert_hits_total") + dev("tiered_moe_expert_misses_total"))
        deadline, got = time.time() + 60, None
        while time.time() < deadline:
            try:
                res = _query(base, HIT_RATE)
                if res:
                    got = float(res[0]["value"][1])
                    if abs(got - ours) < 1e-9:
                        break
            except OSError:
                pass
            time.sleep(0.5)
        assert got is not None, (tmp_path / "prometheus.log").read_text()[-2000:]
        assert abs(got - ours) < 1e-9
        assert 0 < got < 1
        up = _query(base, 'up{job="tiered-moe"}')
        assert up and up[0]["value"][1] == "1"
        # The dashboard's panel form: a ratio of counter rates over a window.
        panel = HIT_RATE_PANEL
        deadline, rate = time.time() + 30, []
        while not rate and time.time() < deadline:
            traffic(server, 1)   # rate() needs the counters to move between two scrapes
            time.sleep(1.0)
            rate = _query(base, panel)
        assert rate and 0 <= float(rate[0]["value"][1]) <= 1
        # Every query of the Grafana dashboard parses and evaluates on a real Prometheus.
        from helpers import ROOT
        dash = json.load(open(os.path.join(ROOT, "docker", "grafana", "dashboards", "tiered-moe.json")))
        for expr in (t["expr"] for panel in dash["panels"] for t in panel["targets"]):
            _query(base, expr)
    finally:
        p.terminate()
        p.wait(10)
    assert os.path.exists(tmp_path / "data")
