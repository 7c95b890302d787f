"""Independent brute-force reference for tier placement: plain lists, one eviction at a time,
written from the semantics in cache_policy/placement.py's docstring - not from its code."""
import math


def groups_of(trace, batch):
    """[(step, layer, sorted experts needed)] via an explicit slot simulation of continuous batching."""
    so = [int(x) for x in trace.seq_offsets]
    S = len(so) - 1
    slots = [None] * batch          # (seq, position) per slot
    nxt = 0
    out = []
    step = 0
    while True:
        for i in range(batch):
            if slots[i] is None and nxt < S:
                slots[i] = [nxt, 0]
                nxt += 1
        active = [s for s in slots if s is not None]
        if not active:
            break
        toks = [so[s] + p for s, p in active]
        for layer in range(trace.num_layers):
            need = sorted({int(e) for t in toks for e in trace.ids[t, layer]})
            out.append((step, layer, need))
        for i in range(batch):
            if slots[i] is not None:
                slots[i][1] += 1
                s, p = slots[i]
                if so[s] + p >= so[s + 1]:
                    slots[i] = None
        step += 1
    return out


def next_uses(flat):
    """flat: list of (group index, key) in order -> next group index needing the key (inf)."""
    res = [math.inf] * len(flat)
    last = {}
    for i in range(len(flat) - 1, -1, -1):
        g, k = flat[i]
        res[i] = last.get(k, math.inf)
        last[k] = g
    return res


def replay(groups, *, policy, cap, scope, L, E, static_scores=None):
    """Returns (hits, misses, max resident seen). policy: lru | belady | static | none | fifo
    (first in, first out: a hit does not refresh)."""
    pools = {}
    flat = [(gi, layer * E + e) for gi, (_, layer, need) in enumerate(groups) for e in need]
    nu = next_uses(flat) if policy == "belady" else None
    nu_by = {}
    if nu is not None:
        for (gi, k), n in zip(flat, nu):
            nu_by[(gi, k)] = n
    if policy == "static":  # warm start: each pool filled with its top-scored experts
        units = range(L) if scope == "layer" else [None]
        for u in units:
            keys = range(u * E, (u + 1) * E) if u is not None else range(L * E)
            ranked = sorted((k for k in keys if static_scores.get(k, 0) > 0), key=lambda k: (-static_scores[k], k))
            pools[u if u is not None else 0] = {"order": ranked[:cap], "nu": {}}
    hits = misses = 0
    max_res = 0
    prev_step = None
    for gi, (step, layer, need) in enumerate(groups):
        pid = layer if scope == "layer" else 0
        pool = pools.setdefault(pid, {"order": [], "nu": {}})
        if policy == "none" and step != prev_step:
            for p in pools.values():
                p["order"].clear()
        prev_step = step
        order = pool["order"]
        keys = [layer * E + e for e in need]

        def victim(protected):
            cands = [k for k in order if k not in protected]
            if policy in ("lru", "none", "fifo"):
                return cands[0]
            if policy == "belady":
                return max(cands, key=lambda k: (pool["nu"][k], -k))
            if policy == "static":
                return min(cands, key=lambda k: (static_scores.get(k, 0.0), k))
            raise ValueError(policy)

        def touch(k):
            if policy == "belady":
                pool["nu"][k] = nu_by[(gi, k)]
            if policy == "lru" and k in order:
                order.remove(k)
                order.append(k)

        hit_keys = [k for k in keys if k in order]
        miss_keys = [k for k in keys if k not in order]
        hits += len(hit_keys)
        misses += len(miss_keys)
        if policy == "lru" and len(keys) <= cap:
            # A group that fits: its keys become the most recent in ascending order (hits and
            # loads alike), then the least recent others leave.
            order[:] = [k for k in order if k not in keys] + keys
            del order[: max(0, len(order) - cap)]
            max_res = max(max_res, len(order))
            continue
        for k in hit_keys:
            touch(k)
        if len(keys) <= cap:
            waves = [(miss_keys, set(keys))]
        else:
            first = cap - len(hit_keys)
            waves = [(miss_keys[:first], set(hit_keys) | set(miss_keys[:first]))] if first > 0 else []
            for i in range(max(first, 0), len(miss_keys), cap):
                waves.append((miss_keys[i:i + cap], set(miss_keys[i:i + cap])))
        for new, protected in waves:
            for k in new:
                if len(order) >= cap:
                    order.remove(victim(protected))
                order.append(k)
                touch(k)
            max_res = max(max_res, len(order))
    return hits, misses, max_res
