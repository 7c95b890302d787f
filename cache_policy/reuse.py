"""The ``reuse`` eviction policy (the default) and the group-level routing statistics it predicts
from (see ``Reuse`` and ``ReuseStats``)."""
from __future__ import annotations

from collections import deque

import numpy as np

from .policy_base import _EMPTY, _ScoreHeap, fit_source
from .traces import build_groups, continuous_batches

__all__ = ["Reuse", "ReuseStats"]


class ReuseStats:
    """Group-level routing statistics of one model: the input of ``reuse``'s predictions.

    Counted over groups (the experts one layer needs in one step: the union over the step's
    tokens), so a fit at batch B means what the policy sees when it serves batch B.
      reuse[b][r]       reuses of an expert r steps after its previous use (r = 1..A; index A+1:
                        later), split by the expert's class b at that previous use: how many of
                        the last W steps up to then (that one included) used it (1..W)
      cross_c[l][i, j]  groups of layer l holding i whose next group (layer l+1; after the last
                        layer, layer 0 of the next step) holds j;  cross_n[l][i]: such groups
      uses[l][e], groups[l]  groups of layer l holding e, and groups of layer l
    """

    A = 64          # reuse distances counted exactly up to A steps
    W = 16          # class window, in steps

    def __init__(self, num_layers: int, num_experts: int) -> None:
        if num_layers < 1 or num_experts < 1:
            raise ValueError(f"reuse statistics need at least 1 layer and 1 expert, got {num_layers} x {num_experts}")
        L, E = self.L, self.E = int(num_layers), int(num_experts)
        self.reuse = np.zeros((self.W + 1, self.A + 2))  # reuse: [W+1, A+2] (class 0: never used)
        self.cross_c = np.zeros((L, E, E), np.float32)   # cross_c: [L, E, E]
        self.cross_n = np.zeros((L, E))                  # cross_n: [L, E]
        self.uses = np.zeros((L, E))                     # uses: [L, E]
        self.groups = np.zeros(L)                        # groups: [L]

    def copy(self) -> "ReuseStats":
        c = ReuseStats.__new__(ReuseStats)
        c.L, c.E = self.L, self.E
        for a in ("reuse", "cross_c", "cross_n", "uses", "groups"):
            setattr(c, a, getattr(self, a).copy())
        return c

    def tables(self, gamma: float) -> "tuple[list, list]":
        """Per class b and elapsed steps a (0..A+1): V[b][a] = E[gamma^(R - a) | R >= a], the
        (discounted) chance of a reuse at the next step given none for a-1 steps (gamma = 0:
        exactly P(R = a | R >= a)), and H[b][a] = P(R = a | R >= a). A class without data
        borrows the pooled counts."""
        A = self.A
        cnt = np.vstack([self.reuse, self.reuse.sum(0, keepdims=True)])   # cnt: [W+2, A+2]
        sw = np.zeros_like(cnt)
        sc = np.zeros_like(cnt)
        acc_w = acc_c = 0.0
        for a in range(A + 1, -1, -1):   # suffix sums: sw[a] = sum_{r>=a} cnt[r] gamma^(r-a)
            acc_w = cnt[:, a] + gamma * acc_w
            acc_c = cnt[:, a] + acc_c
            sw[:, a], sc[:, a] = acc_w, acc_c
        ok = sc > 0
        V = np.where(ok, sw / np.maximum(sc, 1e-12), np.nan)
        H = np.where(ok, cnt / np.maximum(sc, 1e-12), np.nan)
        V[-1] = np.where(np.isnan(V[-1]), 0.0, V[-1])
        H[-1] = np.where(np.isnan(H[-1]), 0.0, H[-1])
        V[:-1] = np.where(np.isnan(V[:-1]), V[-1][None, :], V[:-1])
        H[:-1] = np.where(np.isnan(H[:-1]), H[-1][None, :], H[:-1])
        return V[:-1].tolist(), H[:-1].tolist()

    @staticmethod
    def fit(trace, batch: int = 1) -> "ReuseStats":
        """Count a training trace's groups under continuous batching at ``batch`` (vectorised
        with bincounts and searchsorted: no BLAS, which crawls on a shared, loaded machine)."""
        g = build_groups(trace, continuous_batches(trace.seq_offsets, batch))
        L, E, S = g.num_layers, g.num_experts, g.num_steps
        A, W = ReuseStats.A, ReuseStats.W
        st = ReuseStats(L, E)
        layer = g.keys // E
        step = np.repeat(np.arange(S * L, dtype=np.int64), np.diff(g.ptr)) // L
        order = np.argsort(layer, kind="stable")       # by layer, then step (processing order)
        cuts = np.searchsorted(layer[order], np.arange(L + 1))
        ent = []                                        # per layer: (steps [n], experts [n]) by step
        for l in range(L):
            sel = order[cuts[l]:cuts[l + 1]]
            ent.append((step[sel], (g.keys[sel] - l * E).astype(np.int64)))
        for l in range(L):
            sa, ea = ent[l]
            st.uses[l] = np.bincount(ea, minlength=E)
            st.groups[l] = S
            if l + 1 < L:
                sb, eb = ent[l + 1]
                st.cross_c[l] = _pair_counts(sa, ea, sb, eb, E, S)
                st.cross_n[l] = st.uses[l]
            else:   # the last layer is followed by layer 0 of the next step
                sb, eb = ent[0]
                keep = sa < S - 1
                st.cross_c[l] = _pair_counts(sa[keep], ea[keep], sb - 1, eb, E, S)
                st.cross_n[l] = np.bincount(ea[keep], minlength=E)
            # Uses by expert then step; a use's class = uses of that expert in its last W steps.
            by = np.lexsort((sa, ea))
            e2, s2 = ea[by], sa[by]
            key = e2 * (S + W + 1) + s2                 # sorted: expert-major timeline
            cls = np.arange(len(key)) - np.searchsorted(key, key - (W - 1)) + 1
            cls = np.minimum(cls, W)
            same = e2[1:] == e2[:-1]
            dist = (s2[1:] - s2[:-1])[same]
            st.reuse += np.bincount(cls[:-1][same] * (A + 2) + np.minimum(dist, A + 1),
                                    minlength=(W + 1) * (A + 2)).reshape(W + 1, A + 2)
        return st


def _pair_counts(sa, ea, sb, eb, E, S):
    """[E, E] number of steps s with expert i in a's entries at s and j in b's at s. Entries are
    (step, expert) arrays sorted by step; steps of b outside [0, S) are ignored."""
    ok = (sb >= 0) & (sb < S)
    sb, eb = sb[ok], eb[ok]
    ptr = np.searchsorted(sb, np.arange(S + 1))          # ptr: [S+1] b's entries of each step
    n = ptr[sa + 1] - ptr[sa]                           # n: [len a] b entries sharing a's step
    out = np.zeros(E * E, np.float64)
    CH = 1 << 16                                        # chunks of a bound the pair arrays
    for c0 in range(0, len(sa), CH):
        nc, st0 = n[c0:c0 + CH], ptr[sa[c0:c0 + CH]]
        tot = int(nc.sum())
        if not tot:
            continue
        idx = np.arange(tot) + np.repeat(st0 - (np.cumsum(nc) - nc), nc)
        out += np.bincount(np.repeat(ea[c0:c0 + CH], nc) * E + eb[idx], minlength=E * E)
    return out.reshape(E, E)


def _mean_rows(c, n, g, fallback):
    """mean over i in g of c[i] / n[i] (P(j next | i now)); a row never seen counts as ``fallback``."""
    ng = n[g]                                           # ng: [|g|]
    rows = c[g]                                         # rows: [|g|, E]
    known = ng > 0
    if known.all():
        return (rows / ng[:, None]).sum(0) / len(g)
    p = (rows[known] / ng[known, None]).sum(0) if known.any() else 0.0
    return (p + (len(g) - int(known.sum())) * fallback) / len(g)


class Reuse(_ScoreHeap):
    """Evict the resident expert least likely to be used at its next chance (a learned Belady).

    An expert of layer l can only be used at a group of layer l, once per step. In a pool every
    slot is worth at most one hit per step, so - greedily - the slots should hold the experts
    with the highest chance of being used the next time their layer runs. That chance is
    predicted from the expert's age a (steps since its last use) and its class b (how many of
    the W steps up to that use used it too): H[b][a] = P(R = a | R >= a) over the reuse
    distances R fitted on a trace or learned online (``gamma`` > 0 also credits later uses,
    discounted per step). For the layer after the current group, the current routing may say
    more: ``cross_weight`` blends in P(needed now | what this layer needed) (cross-layer
    transitions). Unlike LRU this does not favour the layer just run over the layers about to
    run, which is why a global pool does not collapse when a step's experts exceed it (every
    step scans all layers in order: recency is exactly wrong); unlike LFU it forgets an
    expert that the running sequences stopped using within a few steps.

    Scores are refreshed when the expert's layer (or the layer before it) is seen: each group
    re-scores the residents of at most two layers; the lazy heap does the rest.

    Demand-only: it never loads anything. ``Reuse()`` learns online from the groups it sees
    (the live store); ``Reuse(stats)`` starts from a fit (``ReuseStats.fit``) and keeps learning.
    It needs the model's geometry, which ``TieredPlacement`` gives it (``bind``). A group that
    fits the pool comes whole (``group_access``); in waves, the evictions of a wave use what of
    the group is known by then. A key inserted by a prefetch (no aux, at another group's
    position) is scored but not counted as a use.
    """

    @classmethod
    def for_replay(cls, trace, cfg, future=None, batch=1):
        if cfg.fit_trace is None:
            # No fit: it learns online, as on a live store.
            return lambda: cls(cross_weight=cfg.reuse_cross_weight, gamma=cfg.reuse_gamma)
        stats = ReuseStats.fit(fit_source(trace, cfg), batch)   # group statistics mean what they mean at this batch
        return lambda: cls(stats, cross_weight=cfg.reuse_cross_weight, gamma=cfg.reuse_gamma)


    name = "reuse"
    wants = "weights"   # replay then passes aux with demand inserts only, which tells prefetches apart
    refresh_groups = 4096   # rebuild the H / V tables after this many groups (sooner while learning)

    def __init__(self, stats: "ReuseStats | None" = None, cross_weight: float = 0.0, gamma: float = 0.0,
                 learn: bool = True) -> None:
        super().__init__()
        self.learn = learn            # False: the statistics stay as given (tests, frozen fits)
        if not 0.0 <= cross_weight <= 1.0:
            raise ValueError(f"reuse: cross_weight must be in [0, 1], got {cross_weight!r}")
        if not 0.0 <= gamma < 1.0:
            raise ValueError(f"reuse: gamma (discount per step) must be in [0, 1), got {gamma!r}")
        self._fitted = stats
        self.cross_weight, self.gamma = cross_weight, gamma
        self.stats: "ReuseStats | None" = None
        self.L = self.E = 0
        self.by_layer: dict = {}      # layer -> resident keys of that layer
        self.cur_pos = None           # position t * L + layer of the group being seen
        self.cur_t = self.cur_layer = 0
        self.cur_keys: set = set()
        self.prev_g = None            # (position, layer, experts) of the last finished group
        self.last_use: list = []      # [L*E] step of each key's last use (-1: never)
        self.kcls: list = []          # [L*E] class at that use (0: never used)
        self.recent: dict = {}        # key -> its use steps within the last W steps
        self._since = self._seen = 0

    def bind(self, *, num_layers: int, num_experts: int, scope: str = "global") -> "Reuse":
        if self._fitted is not None:
            if (self._fitted.L, self._fitted.E) != (num_layers, num_experts):
                raise ValueError(f"reuse: statistics fitted on {self._fitted.L} layers x {self._fitted.E} experts, "
                                 f"the model has {num_layers} x {num_experts}")
            self.stats = self._fitted.copy()
        elif self.stats is None or (self.stats.L, self.stats.E) != (num_layers, num_experts):
            self.stats = ReuseStats(num_layers, num_experts)
        self.L, self.E = int(num_layers), int(num_experts)
        self.last_use = [-1] * (self.L * self.E)
        self.kcls = [0] * (self.L * self.E)
        self.V, self.H = self.stats.tables(self.gamma)
        return self

    # -- what the current step needs ------------------------------------------------------------
    def _note(self, keys, t) -> None:
        """Keys of the group at (t, their layer) are needed: start or grow that group, and
        re-score the layers it informs when it grew."""
        if self.stats is None:
            raise ValueError("reuse: unbound - it needs the model's geometry (use it through TieredPlacement, "
                             "or call bind(num_layers=..., num_experts=...))")
        if not keys:        # nothing of the group reaches the pool (e.g. every miss computed on the host)
            return
        layer = keys[0] // self.E
        pos = t * self.L + layer
        if pos != self.cur_pos:
            self._finish()
            self.cur_pos, self.cur_t, self.cur_layer = pos, t, layer
            self.cur_keys = set(keys)
        else:
            n0 = len(self.cur_keys)
            self.cur_keys.update(keys)
            if len(self.cur_keys) == n0:
                return
        self._rescore()

    def _class_now(self, k, t) -> int:
        """Class of a key used at step t: its uses in the W steps up to t, t included."""
        r = self.recent.get(k)
        if not r:
            return 1
        lo, n = t - self.stats.W, len(r)
        for s in r:          # oldest first: skip the uses that left the window
            if s > lo:
                break
            n -= 1
        if r[-1] == t:
            n -= 1
        return n + 1 if n + 1 < self.stats.W else self.stats.W

    def _finish(self) -> None:
        """Count the group just finished into the statistics."""
        if self.cur_pos is None:
            return
        st, pos, l, t = self.stats, self.cur_pos, self.cur_layer, self.cur_t
        E, A, W = self.E, st.A, st.W
        ks = sorted(self.cur_keys)
        prev = self.prev_g
        if self.cross_weight > 0:
            g = np.asarray(ks, dtype=np.int64) - l * E                    # g: [n] expert ids
            if self.learn:
                if prev is not None and prev[0] == pos - 1:
                    st.cross_c[prev[1]][np.ix_(prev[2], g)] += 1.0
                    st.cross_n[prev[1]][prev[2]] += 1.0
                st.uses[l][g] += 1.0
                st.groups[l] += 1.0
            self.prev_g = (pos, l, g)
        lu, kc, reuse, recent = self.last_use, self.kcls, st.reuse, self.recent
        lo = t - W
        for k in ks:
            u = lu[k]
            if 0 <= u < t and self.learn:
                r = t - u
                reuse[kc[k], r if r <= A else A + 1] += 1.0
            rk = recent.get(k)
            if rk is None:
                recent[k] = deque((t,))
                kc[k] = 1
            elif rk[-1] != t:
                while rk and rk[0] <= lo:
                    rk.popleft()
                rk.append(t)
                kc[k] = len(rk) if len(rk) < W else W
            lu[k] = t
        self._since += 1
        self._seen += 1
        if self.learn and self._since >= min(self.refresh_groups, self._seen // 2 + 8):   # often while learning
            self._since = 0
            self.V, self.H = st.tables(self.gamma)

    def _rescore(self) -> None:
        L, E, A1 = self.L, self.E, self.stats.A + 1
        l, t = self.cur_layer, self.cur_t
        V, lu, kc = self.V, self.last_use, self.kcls
        push = self._push
        res = self.by_layer.get(l)
        if res:   # layer l's next group is one step on
            cur, t1 = self.cur_keys, t + 1
            cnow = self._class_now
            for k in res:
                if k in cur:
                    push(k, V[cnow(k, t)][1])
                else:
                    u = lu[k]
                    a = t1 - u if u >= 0 else A1
                    push(k, V[kc[k]][a if a < A1 else A1])
        if L > 1 and self.cross_weight > 0:
            m = l + 1 if l + 1 < L else 0
            res = self.by_layer.get(m)
            if res:   # layer m's next group is the next group: the current routing predicts it
                st = self.stats
                g = np.asarray(sorted(self.cur_keys), dtype=np.int64) - l * E
                pc = _mean_rows(st.cross_c[l], st.cross_n[l], g, (st.uses[m] + 0.5) / (st.groups[m] + 1.0)).tolist()
                w = self.cross_weight
                tm = t if m else t + 1    # the step of layer m's next group
                base = m * E
                for k in res:
                    u = lu[k]
                    a = tm - u if u >= 0 else A1
                    push(k, w * pc[k - base] + (1.0 - w) * V[kc[k]][a if a < A1 else A1])

    def _score(self, k) -> float:
        """Chance of use at the key's next chance from its age alone (a key inserted by a
        demand or a prefetch)."""
        A1 = self.stats.A + 1
        t = self.cur_t
        if k in self.cur_keys:
            return self.V[self._class_now(k, t)][1]
        tn = t + 1 if k // self.E <= self.cur_layer else t       # the step of its layer's next group
        u = self.last_use[k]
        a = tn - u if u >= 0 else A1
        return self.V[self.kcls[k]][a if a < A1 else A1]

    # -- the policy contract --------------------------------------------------------------------
    def _add(self, keys) -> None:
        self.live.update(keys)
        E, bl = self.E, self.by_layer
        for k in keys:
            s = bl.get(k // E)
            if s is None:
                s = bl[k // E] = set()
            s.add(k)

    def group_access(self, pool, keys, t):
        self._note(keys, t)
        res = pool.resident
        misses = [k for k in keys if k not in res]
        n_hits = len(keys) - len(misses)
        if not misses:
            return n_hits, _EMPTY
        evicted = pool.evict_for(len(misses), keys)
        res.update(misses)
        self._add(misses)
        for k in misses:
            self._push(k, self._score(k))
        return n_hits, evicted

    def on_hit(self, keys, t, aux):
        if keys:
            self._note(keys, t)

    def on_bypass(self, keys, t, aux):
        if keys:
            self._note(keys, t)   # a use: it counts, though nothing is resident

    def on_demand(self, keys, t):
        if keys:
            self._note(keys, t)   # the loads that follow are demand loads, also without aux (live)

    def on_insert(self, keys, t, aux):
        if not keys:
            return
        demand = aux is not None or (self.stats is not None and t * self.L + keys[0] // self.E == self.cur_pos)
        if demand:
            self._note(keys, t)
        self._add(keys)   # after _note: a key is live only once it has a score (the heap's rebuild reads it)
        for k in keys:   # a prefetch, or keys of the noted group: scored from their age
            self._push(k, self._score(k))

    def evict(self, n, protected):
        out = super().evict(n, protected)
        E, bl = self.E, self.by_layer
        for k in out:
            bl[k // E].discard(k)
        return out

    def forget(self, key):
        super().forget(key)
        s = self.by_layer.get(key // self.E) if self.E else None
        if s is not None:
            s.discard(key)


# The registry: a policy is one entry here (and its class); the live store, the server's config,
# the CLI and replay all read it.
