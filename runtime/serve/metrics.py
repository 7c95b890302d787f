"""Prometheus metrics of one server, in its own registry (no global state, two servers in one
process never share counters).

Expert-cache counters live in the engine process; each ``step`` message carries their cumulative
values and the front-end exposes them through a custom collector (what an exporter does), so a
counter never goes backwards and never double counts. Histograms of per-step values and request
latencies are observed here as messages arrive. Labels are bounded: ``tier`` (device, host, disk),
``layer`` (the model's MoE layers), ``link`` (disk_to_host, host_to_device), ``finish_reason``, and under
tensor parallelism ``rank`` (0 .. ranks - 1) on the figures that differ by rank (bytes moved, stall,
resident bytes: ``tiered_moe_rank_*``); the unlabelled ones are rank 0's.

A device hit-rate panel in PromQL:
  sum(rate(tiered_moe_expert_hits_total{tier="device"}[1m]))
    / (sum(rate(tiered_moe_expert_hits_total{tier="device"}[1m])) + sum(rate(tiered_moe_expert_misses_total{tier="device"}[1m])))
"""
from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

P = "tiered_moe_"
_SECONDS_FAST = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_SECONDS_SLOW = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


# The keys of an engine's ``stats`` that are cumulative counters (the rest are gauges); under ``ranks`` each
# rank's ``bytes`` and ``stall_seconds``.
_COUNTER_KEYS = ("layer_hits", "bytes", "evictions", "prefetch", "preemptions", "computed", "host_compute_seconds",
                 "load_errors", "prefix_cache")
_RANK_COUNTER_KEYS = ("bytes", "stall_seconds")


def _plus(a, b):
    """a + b leaf by leaf (numbers, lists, dicts; a leaf missing on one side counts as 0)."""
    if isinstance(a, dict) or isinstance(b, dict):
        a, b = a or {}, b or {}
        return {k: _plus(a.get(k), b.get(k)) for k in {**a, **b}}
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        a, b = list(a or []), list(b or [])
        n = max(len(a), len(b))
        return [_plus(a[i] if i < len(a) else None, b[i] if i < len(b) else None) for i in range(n)]
    return (a or 0) + (b or 0)


def _zero(x):
    """x's shape with every number 0."""
    if isinstance(x, dict):
        return {k: _zero(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_zero(v) for v in x]
    return 0 if isinstance(x, (int, float)) and not isinstance(x, bool) else x


class _StoreCollector:
    """Mirrors the engine's cumulative store counters and gauges (the latest ``stats``). An engine restarts
    its counters at 0: what the engines before it counted is kept (``engine_gone``) and added, so a counter
    the server exposes never goes backwards across restarts."""

    def __init__(self) -> None:
        self.stats: "dict | None" = None
        self.base: dict = {}          # counters of engines that are gone
        self.lock = threading.Lock()

    def update(self, stats: dict) -> None:
        with self.lock:
            if "ranks" not in stats and self.stats is not None and "ranks" in self.stats:
                stats = {**stats, "ranks": self.stats["ranks"]}   # per-rank figures come at most once a second
            self.stats = stats

    def engine_gone(self) -> None:
        """The engine died: fold its last counters into the base; its gauges read 0 (nothing is resident, nothing
        runs) until the next engine reports."""
        with self.lock:
            s = self.stats
            if s is None:
                return
            self.stats = _zero(s)
            done = {k: s[k] for k in _COUNTER_KEYS if k in s}
            if s.get("ranks"):
                done["ranks"] = [{k: r[k] for k in _RANK_COUNTER_KEYS if k in r} for r in s["ranks"]]
            self.base = _plus(self.base, done)

    def _view(self) -> "dict | None":
        """The latest stats with the base added to their counters."""
        with self.lock:
            s, base = self.stats, self.base
        if s is None:
            return None
        if not base:
            return s
        out = dict(s)
        for k in _COUNTER_KEYS:
            if k in s or k in base:
                out[k] = _plus(base.get(k), s.get(k))
        if s.get("ranks") and base.get("ranks"):
            out["ranks"] = [{**r, **{k: _plus(b.get(k), r.get(k)) for k in _RANK_COUNTER_KEYS}}
                            for r, b in zip(s["ranks"], base["ranks"] + [{}] * len(s["ranks"]))]
        return out

    def collect(self):
        s = self._view()
        if s is None:
            return
        hits = CounterMetricFamily(P + "expert_hits", "Expert accesses found resident in a tier", labels=["tier", "layer"])
        misses = CounterMetricFamily(P + "expert_misses", "Expert accesses not resident in a tier (device: loaded from "
                                     "host or disk; host: read from disk)", labels=["tier", "layer"])
        for layer, (dev, host, disk) in enumerate(s["layer_hits"]):
            hits.add_metric(["device", str(layer)], dev)
            misses.add_metric(["device", str(layer)], host + disk)
            hits.add_metric(["host", str(layer)], host)
            misses.add_metric(["host", str(layer)], disk)
        yield hits
        yield misses
        moved = CounterMetricFamily(P + "transfer_bytes", "Expert bytes moved between tiers", labels=["link"])
        for link, v in s["bytes"].items():
            moved.add_metric([link], v)
        yield moved
        ev = CounterMetricFamily(P + "expert_evictions", "Experts dropped from a tier", labels=["tier"])
        for tier, v in s["evictions"].items():
            ev.add_metric([tier], v)
        yield ev
        for what, doc in (("issued", "Experts loaded ahead of need by the prefetcher"),
                          ("used", "Prefetched experts that a later demand access used"),
                          ("wasted", "Prefetched experts evicted before any use")):
            yield CounterMetricFamily(P + f"prefetch_{what}", doc, value=s["prefetch"][what])
        for name, key, doc in (("resident_experts", "resident_experts", "Experts resident in a tier"),
                               ("resident_bytes", "resident_bytes", "Bytes of experts resident in a tier"),
                               ("capacity_experts", "capacity_experts", "Expert slots of a tier"),
                               ("capacity_bytes", "capacity_bytes", "Bytes of expert slots of a tier")):
            g = GaugeMetricFamily(P + name, doc, labels=["tier"])
            for tier, v in s[key].items():
                g.add_metric([tier], v)
            yield g
        if "kv_blocks" in s:
            g = GaugeMetricFamily(P + "kv_cache_blocks", "KV cache blocks (preallocated), by state", labels=["state"])
            g.add_metric(["used"], s["kv_blocks"]["used"])
            g.add_metric(["free"], s["kv_blocks"]["free"])
            yield g
            yield GaugeMetricFamily(P + "kv_cache_bytes", "Bytes of the preallocated KV cache", value=s["kv_blocks"]["bytes"])
            yield CounterMetricFamily(P + "preemptions", "Running requests preempted for KV blocks (recomputed later)",
                                      value=s.get("preemptions", 0))
            pc = s.get("prefix_cache") or {}
            yield CounterMetricFamily(P + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      value=pc.get("queries", 0))
            yield CounterMetricFamily(P + "prefix_cache_hits", "Prompt tokens found in the prefix cache (their prefill "
                                      "skipped)", value=pc.get("hits", 0))
        if "computed" in s:
            c = CounterMetricFamily(P + "expert_compute", "Experts computed, by where: on the device, or on the host CPU "
                                    "from host memory without a transfer (hybrid execution)", labels=["where"])
            for where, v in s["computed"].items():
                c.add_metric([where], v)
            yield c
            yield CounterMetricFamily(P + "host_expert_compute_seconds", "Wall time of expert compute on the host CPU "
                                      "(hybrid execution)", value=s.get("host_compute_seconds", 0.0))
            yield CounterMetricFamily(P + "prefetch_cancelled", "Prefetches dropped unstarted once their layer had run",
                                      value=s["prefetch"].get("cancelled", 0))
        yield CounterMetricFamily(P + "expert_load_errors", "Expert loads that failed (corrupt twice): the requests of "
                                  "that step failed", value=s.get("load_errors", 0))
        if s.get("ranks"):      # tensor parallelism: what each rank moves and holds (its slices); label values 0..N-1
            rb = CounterMetricFamily(P + "rank_transfer_bytes", "Expert bytes moved between tiers by one tensor-parallel "
                                     "rank (its slices)", labels=["rank", "link"])
            rs = CounterMetricFamily(P + "rank_stall_seconds", "Time one tensor-parallel rank waited for experts",
                                     labels=["rank"])
            rr = GaugeMetricFamily(P + "rank_resident_bytes", "Bytes of expert slices resident in a tier of one rank "
                                   "(host: the node's shared tier)", labels=["rank", "tier"])
            for i, r in enumerate(s["ranks"]):
                for link, v in r["bytes"].items():
                    rb.add_metric([str(i), link], v)
                rs.add_metric([str(i)], r["stall_seconds"])
                for tier, v in r["resident_bytes"].items():
                    rr.add_metric([str(i), tier], v)
            yield rb
            yield rs
            yield rr
        yield GaugeMetricFamily(P + "requests_running", "Requests in the running batch", value=s.get("running", 0))
        yield GaugeMetricFamily(P + "requests_waiting", "Requests waiting for a batch slot", value=s.get("waiting", 0))


class ServerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.store = _StoreCollector()
        r.register(self.store)
        self.engine_up = Gauge(P + "engine_up", "1 while the engine process is alive", registry=r)
        self.engine_restarts = Counter(P + "engine_restarts", "Engine processes restarted by the supervisor (after an "
                                       "exit or a missed heartbeat)", registry=r)
        self.request_errors = Counter(P + "request_errors", "Requests that failed in the engine, by cause",
                                      ["cause"], registry=r)
        self.stall = Histogram(P + "expert_stall_seconds", "Per step: time compute waited for experts",
                               buckets=(0.0,) + _SECONDS_FAST, registry=r)
        self.step = Histogram(P + "step_duration_seconds", "Engine step time (schedule, execute, record)",
                              buckets=_SECONDS_FAST, registry=r)
        self.batch = Histogram(P + "step_batch_size", "Sequences in a step", buckets=_COUNTS, registry=r)
        self.unique = Histogram(P + "step_unique_experts", "Per step: distinct experts per MoE layer (mean over layers)",
                                buckets=_COUNTS, registry=r)
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Request arrival to its first token",
                              buckets=_SECONDS_SLOW, registry=r)
        self.itl = Histogram(P + "inter_token_latency_seconds", "Time between consecutive tokens of a request",
                             buckets=_SECONDS_FAST + (5.0,), registry=r)
        self.e2e = Histogram(P + "request_duration_seconds", "Request arrival to its last token",
                             buckets=_SECONDS_SLOW, registry=r)
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens of accepted requests", registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "Generated tokens", registry=r)
        self.requests = Counter(P + "requests", "Finished requests by finish_reason: stop, length, abort (the client "
                                "left or aborted), error (the engine failed it or died)", ["finish_reason"], registry=r)
        self.steps_total = Counter(P + "steps", "Engine steps", registry=r)
        # speculative decoding (runtime/engine/spec_step.py): counts, and per verify chunk its accepted drafts
        self.spec_draft = Counter(P + "spec_draft_tokens", "Draft tokens verified (speculative decoding)", registry=r)
        self.spec_accepted = Counter(P + "spec_accepted_tokens", "Draft tokens the target model accepted", registry=r)
        self.spec_length = Histogram(P + "spec_accepted_length", "Per verify chunk: drafts accepted (0..K)",
                                     buckets=tuple(range(17)), registry=r)
        self.spec_unique = Histogram(P + "spec_verify_unique_experts", "Per step with verify chunks: distinct experts "
                                     "per MoE layer (mean over layers) the verify chunks routed to", buckets=_COUNTS,
                                     registry=r)

    def on_step(self, record: dict, stats: dict) -> None:
        self.store.update(stats)
        if record:
            self.steps_total.inc()
            self.stall.observe(record["stall_seconds"])
            self.step.observe(record["seconds"])
            self.batch.observe(record["batch"])
            self.unique.observe(record["mean_unique_experts"])
            self._on_spec(record)

    def _on_spec(self, record: dict) -> None:
        if record.get("spec_drafted"):
            self.spec_draft.inc(record["spec_drafted"])
            self.spec_accepted.inc(record.get("spec_accepted", 0))
        for a in record.get("spec_lengths") or ():
            self.spec_length.observe(a)
        if record.get("spec_verify_unique_experts") is not None:
            self.spec_unique.observe(record["spec_verify_unique_experts"])

    def render(self) -> bytes:
        return generate_latest(self.registry)
