"""Replay a routing trace through tier placement and report hit rates, bytes and projected speed.

Everything is decided by ``placement.TieredPlacement`` - the same code the live store uses.
"""
from __future__ import annotations

import bisect
import time
from array import array
from dataclasses import dataclass, field

import numpy as np

from . import cost_model as cm
from .keys import SCOPES, Capacity, CpuExperts
from .placement import TieredPlacement
from .policies import LRU, POLICIES, check_policy_name, static_profile  # noqa: F401 - static_profile: callers import it here
from .prefetch import OraclePrefetcher, PrefetchController, make_prefetcher
from .traces import Groups, Trace, build_groups, continuous_batches


PREFETCH_RULES = ("cost", "always")


@dataclass
class ReplayConfig:
    policy: str = "reuse"
    scope: str = "global"
    device_capacity: str = "0.1"
    host_capacity: "str | None" = None       # None: the host holds every expert
    prefetch: str = "none"
    prefetch_budget: "int | None" = None     # experts per layer per step; default top-k
    profile: str = "h200"
    dtype: str = "bf16"
    geometry: "str | None" = None            # expert geometry name; default from the trace's model
    expert_bytes: "int | None" = None        # overrides geometry x dtype
    lfu_half_life: float = 1024.0
    freq_ema: float = 0.05
    reuse_cross_weight: float = 0.0          # reuse: weight of the cross-layer prediction for the next layer
    reuse_gamma: float = 0.0                 # reuse: discount per step of a later use
    fit_trace: "Trace | None" = field(default=None, repr=False)  # static profile / transition fit
    transition_model: "str | None" = None
    cpu_experts: str = "0"                   # 0 | N (first N MoE layers on the host) | auto (cost model)
    prefetch_rule: str = "cost"              # cost: only prefetches expected to pay (PrefetchGate); always
    # Parsed once, at construction (read-only for the replay):
    cpu: CpuExperts = field(init=False, repr=False)
    device_slots: Capacity = field(init=False, repr=False)
    host_slots: "Capacity | None" = field(init=False, repr=False)
    cost_profile: object = field(init=False, repr=False)

    def __post_init__(self) -> None:
        check_policy_name(self.policy)
        self.cpu = CpuExperts.parse(self.cpu_experts)
        if self.prefetch_rule not in PREFETCH_RULES:
            raise ValueError(f"unknown prefetch rule {self.prefetch_rule!r}; choose one of {', '.join(PREFETCH_RULES)}")
        if self.scope not in SCOPES:
            raise ValueError(f"unknown scope {self.scope!r}; choose one of {', '.join(SCOPES)}")
        self.device_slots = Capacity.parse(self.device_capacity, "--device-capacity")
        self.host_slots = None if self.host_capacity in (None, "") else Capacity.parse(self.host_capacity, "--host-capacity")
        make_prefetcher(self.prefetch, num_layers=1, num_experts=1,
                        gate_fn=(lambda *a: None) if self.prefetch == "lookahead" else None)  # name check only
        if self.prefetch == "lookahead":
            raise ValueError("prefetch 'lookahead' needs hidden states from a running model "
                             "(tiered-moe generate / regimes --model); replay has none: use freq, transition or oracle")
        if self.prefetch_budget is not None and self.prefetch_budget < 1:
            raise ValueError(f"--prefetch-budget must be at least 1, got {self.prefetch_budget}")
        if self.dtype not in cm.DTYPE_BITS:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose one of {', '.join(cm.DTYPE_BITS)}")
        if self.geometry is not None and self.geometry not in cm.EXPERT_GEOMETRY:
            raise ValueError(f"unknown expert geometry {self.geometry!r}; choose one of {', '.join(cm.EXPERT_GEOMETRY)}")
        if self.expert_bytes is not None and self.expert_bytes < 1:
            raise ValueError(f"--expert-bytes must be positive, got {self.expert_bytes}")
        self.cost_profile = cm.load_profile(self.profile)


def _expert_size(trace: Trace, cfg: ReplayConfig) -> dict:
    if cfg.geometry:
        geo, known = cfg.geometry, True
    else:
        geo, known = cm.geometry_for_model(trace.model)
    hidden, inter = cm.EXPERT_GEOMETRY[geo]
    params = cm.expert_params(hidden, inter)
    if not cfg.geometry and not cfg.expert_bytes and trace.expert_bytes and trace.expert_dtype in cm.DTYPE_BITS:
        # A live store's trace: its experts' real size, from the store's manifest.
        b, dt = int(trace.expert_bytes), trace.expert_dtype
        return {"params": int(round(b * 8 / cm.DTYPE_BITS[dt])), "bytes": b,
                "source": f"the store's manifest: {b:,} bytes per expert ({dt})"}
    nbytes = cfg.expert_bytes or cm.expert_bytes(params, cfg.dtype)
    if cfg.expert_bytes:
        params = int(round(cfg.expert_bytes * 8 / cm.DTYPE_BITS[cfg.dtype]))
        src = f"--expert-bytes {cfg.expert_bytes}"
    elif known:
        src = f"{geo} expert ({hidden}x{inter} SwiGLU, {cfg.dtype})"
    else:
        src = (f"trace model {trace.model!r} has no known geometry: assumed a {geo} expert "
               f"({hidden}x{inter} SwiGLU, {cfg.dtype}); set --geometry or --expert-bytes")
    return {"params": params, "bytes": int(nbytes), "source": src}


def device_slots_for(trace: Trace, cfg: ReplayConfig, nbytes: int) -> "tuple[int, int | None]":
    L, E, k = trace.num_layers, trace.num_experts, trace.top_k
    dev = cfg.device_slots.slots(scope=cfg.scope, num_layers=L, num_experts=E, expert_bytes=nbytes, flag="--device-capacity")
    if cfg.scope == "layer" and dev < k:
        raise ValueError(f"--device-capacity {cfg.device_capacity} gives {dev} slot(s) per layer with scope 'layer', "
                         f"below top-k = {k}: one token's experts would not fit (minimum {k} per layer, "
                         f"{k * L} in all)")
    if dev < 1:
        raise ValueError(f"--device-capacity {cfg.device_capacity} gives no slot at all (expert size {nbytes} bytes)")
    host = None
    if cfg.host_slots is not None:
        host = cfg.host_slots.slots(scope=cfg.scope, num_layers=L, num_experts=E, expert_bytes=nbytes, flag="--host-capacity")
        if host < dev:
            raise ValueError(f"--host-capacity {cfg.host_capacity} gives {host} slots, below the device tier's {dev}; "
                             f"tiers are inclusive, the host must hold at least what the device holds")
    return dev, host


def make_policy_factory(trace: Trace, cfg: ReplayConfig, future=None, batch: int = 1):
    """The replay's factory of the configured policy's instances (the policy class says how it is
    built from a trace and the config: ``EvictionPolicy.for_replay``)."""
    return POLICIES[check_policy_name(cfg.policy)].for_replay(trace, cfg, future, batch)


class _Future:
    """Next use of a key after the current group, for Belady's prefetched keys and the oracle."""

    def __init__(self, groups: Groups) -> None:
        gid = np.repeat(np.arange(len(groups.ptr) - 1), np.diff(groups.ptr))
        order = np.lexsort((gid, groups.keys))
        ks, gs = groups.keys[order], gid[order]
        cuts = np.flatnonzero(np.diff(ks)) + 1
        self.by_key = {int(ks[a]): gs[a:b].tolist() for a, b in zip(np.r_[0, cuts], np.r_[cuts, len(ks)])}
        self.g = 0

    def __call__(self, key: int) -> float:
        lst = self.by_key.get(key)
        if not lst:
            return float("inf")
        i = bisect.bisect_right(lst, self.g)
        return lst[i] if i < len(lst) else float("inf")


@dataclass
class PlacementSetup:
    """A replay's tiers, built from a trace and its config (``build_placement``)."""
    size: dict                      # expert params, bytes and where the size came from
    dev_slots: int
    host_slots: "int | None"
    factory: object                 # the policy factory
    cost: cm.HybridCost
    place: TieredPlacement
    warm: int                       # experts loaded by the warm start


def build_placement(trace: Trace, cfg: ReplayConfig, batch: int, future=None) -> PlacementSetup:
    """The tiers a replay runs through (also cache_policy/spec_replay.py's, so both place experts alike)."""
    L, E = trace.num_layers, trace.num_experts
    size = _expert_size(trace, cfg)
    dev_slots, host_slots = device_slots_for(trace, cfg, size["bytes"])
    factory = make_policy_factory(trace, cfg, future, batch)
    cost = cm.HybridCost(cfg.cost_profile, size["params"], size["bytes"])
    if cfg.cpu.layers > L:
        raise ValueError(f"--cpu-experts {cfg.cpu.layers}: the trace has {L} MoE layers")
    place = TieredPlacement(num_layers=L, num_experts=E, scope=cfg.scope, device_slots=dev_slots,
                            host_slots=host_slots, policy_factory=factory,
                            host_policy_factory=LRU if cfg.policy == "none" else factory,
                            hybrid=cost if cfg.cpu.auto else None, cpu_layers=cfg.cpu.layers)
    return PlacementSetup(size, dev_slots, host_slots, factory, cost, place, place.warm_start())


def replay_batch(trace: Trace, cfg: ReplayConfig, batch: int, *, progress=None) -> dict:
    t_start = time.perf_counter()
    L, E, k = trace.num_layers, trace.num_experts, trace.top_k
    groups = build_groups(trace, continuous_batches(trace.seq_offsets, batch))
    future = _Future(groups) if (cfg.policy == "belady" or cfg.prefetch == "oracle") else None
    ps = build_placement(trace, cfg, batch, future)
    size, dev_slots, host_slots, factory, cost, place, warm = (ps.size, ps.dev_slots, ps.host_slots, ps.factory,
                                                               ps.cost, ps.place, ps.warm)
    budget = cfg.prefetch_budget or k
    # The controller the live engine runs too (cache_policy.prefetch.PrefetchController).
    ctl = PrefetchController(cfg.prefetch, num_layers=L, num_experts=E, budget=budget, rule=cfg.prefetch_rule,
                             link_s=cost.t_link, saving_s=cost.prefetch_saving(cfg.cpu.auto),
                             fit_trace=cfg.fit_trace if cfg.prefetch == "transition" else None,
                             model_path=cfg.transition_model)
    wants = factory().wants if cfg.policy != "belady" else "next_use"
    run = _run_groups(groups, place, ctl, cost, future, wants, cfg, L, E, progress)
    run["wall"] = time.perf_counter() - t_start
    return _report(trace, cfg, int(batch), groups, place, ctl, size, run,
                   dict(dev_slots=dev_slots, host_slots=host_slots, warm=warm, budget=budget))


def _run_groups(groups: Groups, place, ctl, cost, future, wants, cfg: ReplayConfig, L, E, progress) -> dict:
    """Every group through placement (and the prefetch controller), in chunks of 64k groups.
    Returns the flat per-group records, the prefetch loads landing per group and the host seconds."""
    G = len(groups.ptr) - 1
    aux_all = groups.weights() if wants == "weights" else (groups.next_use() if wants == "next_use" else None)
    weights_all = groups.weights() if ctl.active else None
    rec = array("q")              # flat, per group: device hits, host hits, disk loads, waves, prefetch used, host computed
    pref = np.zeros((G + 1, 2), dtype=np.int64)   # prefetch loads landing for group g: (from host, from disk)
    host_sec = np.zeros((G + 1, 2))               # per group: host compute s, device compute s it replaced
    ptr = groups.ptr.tolist()
    CH = 1 << 16
    simple = not ctl.active and place.host is None and cfg.policy != "none" and not cfg.cpu.enabled
    for c0 in range(0, G, CH):
        c1 = min(G, c0 + CH)
        pa, pb = ptr[c0], ptr[min(G, c1 + 1)]  # one group beyond, for prefetch scoring
        keys = groups.keys[pa:pb].tolist()
        aux = aux_all[pa:pb].tolist() if aux_all is not None else None
        if simple:
            _demand_only(place, keys, aux, ptr, pa, c0, c1, L, rec)
        else:
            wts = weights_all[pa:pb].tolist() if weights_all is not None else None
            cnts = groups.count[pa:pb].tolist()
            _general(place, ctl, cost, future, keys, aux, wts, cnts, ptr, pa, c0, c1, G, L, E, rec, pref, host_sec)
        if progress is not None:
            progress(c1, G)
    return {"R": np.frombuffer(rec, dtype=np.int64).reshape(G, 6), "pref": pref[:G], "host_sec": host_sec[:G]}


def _projection(groups: Groups, prof, params: int, nbytes: int, L: int, run: dict) -> dict:
    """Step times projected by the cost model (serial and overlapped links) and all-resident ones."""
    G = len(groups.ptr) - 1
    dev_hits, _, disk, _, _, host_computed = run["R"].T
    pref, host_sec = run["pref"], run["host_sec"]
    sizes = np.diff(groups.ptr)
    # Compute time of an expert depends only on its token count (at most the batch): look it up.
    per_count = prof.compute_seconds(np.arange(int(groups.count.max()) + 1), params)
    if (groups.count == 1).all():
        compute = sizes * per_count[1]
    else:
        gid = np.repeat(np.arange(G), sizes)
        compute = np.bincount(gid, weights=per_count[groups.count], minlength=G)
    ideal = compute.reshape(-1, L).sum(1) + prof.non_expert_us_per_layer * 1e-6 * L
    times = cm.project_step_times(profile=prof, params=params, nbytes=nbytes, num_layers=L,
                                  compute_s=np.maximum(compute - host_sec[:, 1], 0.0),
                                  demand_h2d=sizes - dev_hits - host_computed, demand_disk=disk,
                                  pref_h2d=pref.sum(1), pref_disk=pref[:, 1], host_s=host_sec[:, 0])
    return {"times": times, "ideal": ideal}


def _report(trace: Trace, cfg: ReplayConfig, batch: int, groups: Groups, place, ctl, size: dict, run: dict,
            slots: dict) -> dict:
    L, E = trace.num_layers, trace.num_experts
    prof, nbytes, params = cfg.cost_profile, size["bytes"], size["params"]
    G = len(groups.ptr) - 1
    dev_hits, host_hits, disk, waves, used, host_computed = run["R"].T
    pref, host_sec, wall = run["pref"], run["host_sec"], run["wall"]
    sizes = np.diff(groups.ptr)
    acc = int(sizes.sum())
    dh, hh, dk = int(dev_hits.sum()), int(host_hits.sum()), int(disk.sum())
    dev_miss = acc - dh
    T = trace.num_tokens
    per_layer_acc, per_layer_dev = sizes.reshape(-1, L).sum(0), dev_hits.reshape(-1, L).sum(0)
    per_layer_host = host_hits.reshape(-1, L).sum(0)
    n_host = int(host_computed.sum())
    h2d_experts = dev_miss - n_host + int(pref.sum())
    disk_experts = dk + int(pref[:, 1].sum())
    proj = _projection(groups, prof, params, nbytes, L, run)
    times = proj["times"]
    issued, pused, wasted = place.prefetch_issued, place.prefetch_used, place.prefetch_wasted
    gate, pf_on = ctl.gate, ctl.active
    dev_slots, host_slots = slots["dev_slots"], slots["host_slots"]
    return {
        "trace": trace.source, "model": trace.model, "batch": batch, "policy": cfg.policy, "scope": cfg.scope,
        "prefetch": cfg.prefetch, "prefetch_budget": slots["budget"] if pf_on else 0,
        "prefetch_rule": cfg.prefetch_rule if pf_on else None, "cpu_experts": str(cfg.cpu),
        "device_capacity": cfg.device_capacity, "host_capacity": cfg.host_capacity or "all",
        "device_slots": dev_slots, "host_slots": host_slots if host_slots is not None else L * E if cfg.scope == "global" else E,
        "slots_are": "per layer" if cfg.scope == "layer" else "in total",
        "device_fraction": (dev_slots * (L if cfg.scope == "layer" else 1)) / (L * E),
        "hits": {"device": dh, "host": hh, "disk": dk},
        "hit_rate": {"device": dh / acc, "host": (hh / dev_miss) if dev_miss else 1.0},
        "served_from": {"device": dh / acc, "host": hh / acc, "disk": dk / acc},
        "hit_rate_per_layer": {"device": (per_layer_dev / per_layer_acc).tolist(),
                               "host": (per_layer_host / np.maximum(per_layer_acc - per_layer_dev, 1)).tolist()},
        "unique_experts_per_layer_step": acc / G,
        "mean_batch": float(T / groups.num_steps),
        "host_compute": {"experts": n_host, "share": n_host / acc,
                         "seconds_per_token": float(host_sec[:, 0].sum() / T)},
        "waves": {"groups_over_capacity": int((waves > 1).sum()), "extra_waves": int((waves - 1).sum())},
        "bytes_per_token": {"host_to_device": h2d_experts * nbytes / T, "disk_to_host": disk_experts * nbytes / T},
        "experts_moved": {"host_to_device": h2d_experts, "disk_to_host": disk_experts, "warm_start": slots["warm"]},
        "evictions": {"device": place.device_evictions, "host": place.host_evictions,
                      "back_invalidations": place.back_invalidations},
        "prefetch_stats": {
            "issued": issued, "used": pused, "wasted": wasted, "unused_at_end": len(place.pending),
            "wasted_bytes": wasted * nbytes, "wasted_bytes_per_token": wasted * nbytes / T,
            "gate_considered": gate.considered if gate is not None else None,
            "gate_moved": gate.moved if gate is not None else None,
            "precision": (pused / issued) if issued else None,
            "recall": (pused / (pused + dev_miss)) if (pused + dev_miss) else None,
            **{f"prediction_{k}": v for k, v in ctl.precision_recall().items()},
        },
        "expert_bytes": nbytes, "expert_params": params, "expert_size_source": size["source"],
        "profile": prof.name,
        "projected": {
            "step_ms_serial": float(times["serial"].mean() * 1e3),
            "step_ms_overlap": float(times["overlap"].mean() * 1e3),
            "tokens_per_s_serial": float(T / times["serial"].sum()),
            "tokens_per_s_overlap": float(T / times["overlap"].sum()),
            "tokens_per_s_all_resident": float(T / proj["ideal"].sum()),
            # prefetch stall (link time no compute hides) per token, the prefetch issued when the layer before
            # routes (the runtime) and, for comparison, only after its experts are combined
            "prefetch_stall_ms_per_token": float(times["stall"].sum() / T * 1e3),
            "prefetch_stall_ms_per_token_after_combine": float(times["stall_after_combine"].sum() / T * 1e3),
            "h2d_ms_per_expert": times["h2d_seconds_per_expert"] * 1e3,
            "h2d_GBps": prof.h2d_GBps(nbytes),
        },
        "projected_tokens_per_s": float(T / times["overlap"].sum()),
        "accesses": acc, "tokens": T, "steps": groups.num_steps,
        "wall_seconds": wall, "accesses_per_s": acc / wall if wall > 0 else None,
    }


def _demand_only(place, keys, aux, ptr, pa, c0, c1, L, rec):
    """The loop for a device tier over a host that holds everything, without prefetch: the
    same Pool.access as every other path, without the tier bookkeeping it does not need."""
    pools = place.device
    sizes = np.diff(np.asarray(ptr[c0:c1 + 1], dtype=np.int64))
    if all(type(p.policy) is LRU for p in pools) and sizes.max() <= min(p.capacity for p in pools):
        # LRU's whole-run loop (the same per-group semantics as its group_access).
        hits = array("q")
        ev = LRU.run([(p.policy, p) for p in pools], keys, [x - pa for x in ptr[c0:c1 + 1]], c0 % L, hits)
        place.device_evictions += ev
        h = np.frombuffer(hits, dtype=np.int64)
        block = np.zeros((c1 - c0, 6), dtype=np.int64)
        block[:, 0], block[:, 1], block[:, 3] = h, sizes - h, 1
        rec.frombytes(block.tobytes())
        return
    t, layer = divmod(c0, L)
    out = rec.extend
    evictions = 0
    for g in range(c0, c1):
        a, b = ptr[g] - pa, ptr[g + 1] - pa
        n_hits, _, ev, waves = pools[layer].access(keys[a:b], t, aux[a:b] if aux is not None else None, False)
        if ev:
            evictions += len(ev)
        out((n_hits, b - a - n_hits, 0, waves, 0, 0))
        layer += 1
        if layer == L:
            layer = 0
            t += 1
    place.device_evictions += evictions


def _general(place, ctl, cost, future, keys, aux, wts, cnts, ptr, pa, c0, c1, G, L, E, rec, pref, host_sec):
    t, layer = divmod(c0, L)
    pf, gate = ctl.pf, ctl.gate
    access = place.access
    out = rec.extend
    devtab, hosttab = cost.tables(max(cnts) if cnts else 1)
    t_link = cost.t_link
    idle = type(cost).idle_link_seconds
    queued = 0.0          # link seconds the prefetch for this group spills (the hybrid rule sees them)
    hits = [0, 0]         # device hits, accesses so far: the prefetch rule's estimate of a displaced resident's reuse
    for g in range(c0, c1):
        a, b = ptr[g] - pa, ptr[g + 1] - pa
        ks = keys[a:b]
        cs = cnts[a:b]
        r = access(layer, ks, t, aux[a:b] if aux is not None else None, cs, queued)
        out(r)
        n_host = r[5]
        hk = ()
        if n_host:
            hk = set(place.last_host)
            hs = hd = 0.0
            for kk, c in zip(ks, cs):
                if kk in hk:
                    hs += hosttab[c]
                    hd += devtab[c]
            host_sec[g, 0], host_sec[g, 1] = hs, hd
        last = layer == L - 1
        queued = 0.0
        if pf is not None:
            base = layer * E
            experts = [x - base for x in ks]
            ctl.observe(layer, experts, wts[a:b], t)
            if g + 1 < G:
                target = 0 if last else layer + 1
                tb = target * E
                nxt = keys[b:ptr[g + 2] - pa]
                if future is not None:
                    future.g = g
                if isinstance(pf, OraclePrefetcher):
                    pf.future = lambda _l, nxt=nxt, tb=tb: [x - tb for x in nxt]
                pk = [tb + x for x in ctl.predict(target, experts)]
                ns = set(nxt)
                ctl.learn(pk, ns, calibrate=False)    # precision / recall of every prediction
                if last:
                    place.end_step()
                if target < place.cpu_layers:
                    pk = []           # computed on the host: never moved
                elif gate is not None:
                    # The link time this group leaves idle (the cost model's overlap formula).
                    if hk:
                        free = idle(cost, [c for kk, c in zip(ks, cs) if kk not in hk], b - a - r[0] - n_host,
                                    [c for kk, c in zip(ks, cs) if kk in hk])
                    else:
                        free = idle(cost, cs, b - a - r[0])
                    tp = place.device[target]
                    hits[0] += r[0]
                    hits[1] += b - a
                    q = hits[0] / hits[1] if len(tp.resident) >= tp.capacity else 0.0
                    sel = ctl.select(pk, free, tp.resident, q)
                    ctl.calibrate(pk, ns)     # the outcome, learned after the decision
                    pk = sel
                # The group being computed is protected; after the last layer nothing is.
                pref[g + 1] = place.prefetch(target, pk, t, set() if last else set(ks))
                if gate is not None and pk:
                    queued = max(0.0, float(pref[g + 1].sum()) * t_link - free)
            elif last:
                place.end_step()
        elif last:
            place.end_step()
        layer += 1
        if layer == L:
            layer = 0
            t += 1


def replay(trace: Trace, cfg: ReplayConfig, batches=(1,), progress=None) -> list:
    for b in batches:
        if not isinstance(b, (int, np.integer)) or b < 1:
            raise ValueError(f"--batch sizes must be positive integers, got {b!r}")
    return [replay_batch(trace, cfg, int(b), progress=progress) for b in batches]
