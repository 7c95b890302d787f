"""Writes dashboards/tiered-moe.json (run after changing a panel: python docker/grafana/make_dashboard.py).
Every expression is a plain PromQL string the tests run against a real Prometheus."""
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))


def ratio(tier, by=""):
    g = f"sum{' by (' + by + ')' if by else ''}"
    h = f'{g}(rate(tiered_moe_expert_hits_total{{tier="{tier}"}}[1m]))'
    m = f'{g}(rate(tiered_moe_expert_misses_total{{tier="{tier}"}}[1m]))'
    return f"{h} / ({h} + {m})"


def q(name, p):
    return f"histogram_quantile({p}, sum by (le)(rate({name}_bucket[1m])))"


def mean(name):
    return f"rate({name}_sum[1m]) / rate({name}_count[1m])"


PANELS = [
    ("Expert hit rate per tier", "percentunit", [(ratio("device"), "device"), (ratio("host"), "host")]),
    ("Device hit rate per layer", "percentunit", [(ratio("device", "layer"), "layer {{layer}}")]),
    ("Bytes/s per link", "Bps", [("sum by (link)(rate(tiered_moe_transfer_bytes_total[1m]))", "{{link}}")]),
    ("Time stalled waiting for experts", "s", [
        ("rate(tiered_moe_expert_stall_seconds_sum[1m])", "stalled seconds per second"),
        (q("tiered_moe_expert_stall_seconds", 0.99), "p99 per step")]),
    ("Tokens/s", "short", [("rate(tiered_moe_generation_tokens_total[1m])", "generated"),
                           ("rate(tiered_moe_prompt_tokens_total[1m])", "prompt")]),
    ("Batch size per step", "short", [(mean("tiered_moe_step_batch_size"), "mean"),
                                      (q("tiered_moe_step_batch_size", 0.99), "p99")]),
    ("Unique experts per layer per step", "short", [(mean("tiered_moe_step_unique_experts"), "mean"),
                                                    (q("tiered_moe_step_unique_experts", 0.99), "p99")]),
    ("Request latency", "s", [(q("tiered_moe_request_duration_seconds", 0.5), "e2e p50"),
                              (q("tiered_moe_request_duration_seconds", 0.99), "e2e p99"),
                              (q("tiered_moe_time_to_first_token_seconds", 0.5), "TTFT p50"),
                              (q("tiered_moe_time_to_first_token_seconds", 0.99), "TTFT p99"),
                              (q("tiered_moe_inter_token_latency_seconds", 0.5), "ITL p50"),
                              (q("tiered_moe_inter_token_latency_seconds", 0.99), "ITL p99")]),
    ("Requests running / waiting", "short", [("tiered_moe_requests_running", "running"),
                                             ("tiered_moe_requests_waiting", "waiting")]),
    ("Resident vs capacity per tier", "bytes", [("tiered_moe_resident_bytes", "resident {{tier}}"),
                                                ("tiered_moe_capacity_bytes", "capacity {{tier}}")]),
    ("Prefetches/s", "short", [("rate(tiered_moe_prefetch_issued_total[1m])", "issued"),
                               ("rate(tiered_moe_prefetch_used_total[1m])", "used"),
                               ("rate(tiered_moe_prefetch_wasted_total[1m])", "wasted")]),
    ("Evictions/s per tier", "short", [("sum by (tier)(rate(tiered_moe_expert_evictions_total[1m]))", "{{tier}}")]),
    ("Experts computed/s: device vs host CPU (hybrid execution)", "short",
     [("sum by (where)(rate(tiered_moe_expert_compute_total[1m]))", "{{where}}")]),
    ("Host expert compute (s/s) and prefetches cancelled/s", "short",
     [("rate(tiered_moe_host_expert_compute_seconds_total[1m])", "host compute s/s"),
      ("rate(tiered_moe_prefetch_cancelled_total[1m])", "prefetch cancelled/s")]),
]


def dashboard() -> dict:
    panels = []
    for i, (title, unit, targets) in enumerate(PANELS):
        panels.append({
            "id": i + 1, "type": "timeseries", "title": title,
            "datasource": {"type": "prometheus", "uid": "prometheus"},
            "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "targets": [{"refId": chr(65 + j), "expr": e, "legendFormat": lg,
                         "datasource": {"type": "prometheus", "uid": "prometheus"}} for j, (e, lg) in enumerate(targets)],
        })
    return {"uid": "tiered-moe", "title": "tiered-moe expert cache", "schemaVersion": 39, "version": 1,
            "time": {"from": "now-30m", "to": "now"}, "refresh": "10s", "tags": ["tiered-moe"], "panels": panels}


if __name__ == "__main__":
    path = os.path.join(HERE, "dashboards", "tiered-moe.json")
    with open(path, "w") as f:
        json.dump(dashboard(), f, indent=1)
        f.write("\n")
    print(f"wrote {path}")
