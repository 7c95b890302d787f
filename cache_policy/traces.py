"""Routing traces: the format, validation, statistics, and continuous-batching schedules.

Format (numpy ``.npz``, the layout of ``../shared/traces/README.md``):

| key           | shape        | meaning                                                    |
|---------------|--------------|------------------------------------------------------------|
| ids           | [T, L, k]    | expert ids chosen by token t at traced MoE layer l (int)   |
| seq_offsets   | [S+1] int    | sequence s is tokens seq_offsets[s]:seq_offsets[s+1]       |
| num_experts   | scalar int   | routed experts per layer                                   |
| weights       | [T, L, k]    | optional router weight of each chosen expert               |
| model         | scalar str   | optional: model the trace came from                        |
| layer_numbers | [L] int      | optional: model layer index of each traced layer           |
| expert_bytes  | scalar int   | optional: bytes of one expert in the store that ran it     |
| expert_dtype  | scalar str   | optional: its format as the cost model names it (mxfp4...) |

Tokens of a sequence are in order; the k ids of one token at one layer must be distinct.
"""
from __future__ import annotations

import os
import zipfile
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Trace:
    ids: np.ndarray                 # ids: [T, L, k] integer expert ids
    seq_offsets: np.ndarray         # seq_offsets: [S+1] int64
    num_experts: int
    weights: "np.ndarray | None" = None   # weights: [T, L, k] float32
    model: str = "unknown"
    layer_numbers: "np.ndarray | None" = None
    source: str = "<memory>"
    expert_bytes: "int | None" = None     # a live store's trace: its real blob size (replay sizes experts by it)
    expert_dtype: "str | None" = None     # and its format (cost_model.DTYPE_BITS name)

    def __post_init__(self) -> None:
        validate(self)

    @property
    def num_tokens(self) -> int:
        return int(self.ids.shape[0])

    @property
    def num_layers(self) -> int:
        return int(self.ids.shape[1])

    @property
    def top_k(self) -> int:
        return int(self.ids.shape[2])

    @property
    def num_sequences(self) -> int:
        return int(len(self.seq_offsets) - 1)

    def seq_lengths(self) -> np.ndarray:
        return np.diff(self.seq_offsets)

    def subset(self, seqs) -> "Trace":
        """A trace of the given sequences (in the given order)."""
        seqs = np.asarray(seqs, dtype=np.int64)
        if seqs.size == 0:
            raise ValueError(f"{self.source}: empty sequence selection")
        so = self.seq_offsets
        idx = np.concatenate([np.arange(so[s], so[s + 1]) for s in seqs])
        lens = so[seqs + 1] - so[seqs]
        return Trace(ids=self.ids[idx], seq_offsets=np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
                     num_experts=self.num_experts,
                     weights=None if self.weights is None else self.weights[idx],
                     model=self.model, layer_numbers=self.layer_numbers, source=self.source,
                     expert_bytes=self.expert_bytes, expert_dtype=self.expert_dtype)

    def split(self, fraction: float) -> "tuple[Trace, Trace]":
        """First `fraction` of the sequences, and the rest (never overlapping)."""
        if not 0.0 < fraction < 1.0:
            raise ValueError(f"split fraction must be in (0, 1), got {fraction}")
        n = max(1, min(self.num_sequences - 1, int(round(self.num_sequences * fraction))))
        if self.num_sequences < 2:
            raise ValueError(f"{self.source}: a split needs at least 2 sequences")
        return self.subset(range(n)), self.subset(range(n, self.num_sequences))

    def save(self, path: str) -> None:
        arrays = dict(ids=self.ids, seq_offsets=self.seq_offsets, num_experts=np.int64(self.num_experts),
                      model=np.str_(self.model))
        if self.weights is not None:
            arrays["weights"] = self.weights.astype(np.float32)
        if self.layer_numbers is not None:
            arrays["layer_numbers"] = np.asarray(self.layer_numbers, dtype=np.int64)
        if self.expert_bytes is not None:
            arrays["expert_bytes"] = np.int64(self.expert_bytes)
            arrays["expert_dtype"] = np.str_(self.expert_dtype or "")
        np.savez_compressed(path, **arrays)


def validate(tr: Trace) -> None:
    src = tr.source
    ids = tr.ids
    if not isinstance(ids, np.ndarray) or ids.ndim != 3:
        raise ValueError(f"{src}: 'ids' must be a 3-d array [tokens, layers, top_k], got shape "
                         f"{getattr(ids, 'shape', None)}")
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"{src}: 'ids' must hold integers, got dtype {ids.dtype}")
    T, L, k = ids.shape
    if T == 0 or L == 0 or k == 0:
        raise ValueError(f"{src}: 'ids' is empty (shape {ids.shape})")
    E = tr.num_experts
    if not isinstance(E, (int, np.integer)) or E < 1:
        raise ValueError(f"{src}: 'num_experts' must be a positive integer, got {E!r}")
    tr.num_experts = E = int(E)
    if k > E:
        raise ValueError(f"{src}: top_k {k} is larger than num_experts {E}")
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0:
        raise ValueError(f"{src}: 'ids' holds a negative expert id ({lo})")
    if hi >= E:
        t, l, j = np.argwhere(ids >= E)[0]
        raise ValueError(f"{src}: expert id {hi} >= num_experts {E} (first at token {t}, layer {l}, slot {j})")
    if k > 1:
        s = np.sort(ids, axis=2)
        dup = np.argwhere(s[:, :, 1:] == s[:, :, :-1])
        if len(dup):
            t, l, _ = dup[0]
            raise ValueError(f"{src}: token {t} at layer {l} chooses the same expert twice ({ids[t, l].tolist()})")
    so = np.asarray(tr.seq_offsets)
    if so.ndim != 1 or len(so) < 2 or not np.issubdtype(so.dtype, np.integer):
        raise ValueError(f"{src}: 'seq_offsets' must be a 1-d integer array [S+1] with S >= 1, got shape {so.shape}")
    if so[0] != 0 or so[-1] != T:
        raise ValueError(f"{src}: 'seq_offsets' must start at 0 and end at the token count {T}, "
                         f"got {int(so[0])}..{int(so[-1])}: it does not cover the trace")
    if np.any(np.diff(so) <= 0):
        s = int(np.argmax(np.diff(so) <= 0))
        raise ValueError(f"{src}: 'seq_offsets' must be strictly increasing (sequence {s} is empty or reversed)")
    tr.seq_offsets = so.astype(np.int64)
    if tr.weights is not None:
        w = np.asarray(tr.weights)
        if w.shape != ids.shape:
            raise ValueError(f"{src}: 'weights' shape {w.shape} does not match 'ids' shape {ids.shape}")
        if not np.all(np.isfinite(w)):
            raise ValueError(f"{src}: 'weights' holds NaN or infinite values")
        tr.weights = w.astype(np.float32)
    if tr.layer_numbers is not None:
        ln = np.asarray(tr.layer_numbers).reshape(-1)
        if len(ln) != L:
            raise ValueError(f"{src}: 'layer_numbers' has {len(ln)} entries for {L} traced layers")
        tr.layer_numbers = ln


def load_trace(path: str) -> Trace:
    if not os.path.exists(path):
        raise ValueError(f"trace file {path!r} does not exist")
    try:
        z = np.load(path, allow_pickle=False)
    except (OSError, ValueError, zipfile.BadZipFile) as e:
        raise ValueError(f"{path}: not a readable .npz trace ({e})") from None
    if not hasattr(z, "files"):
        raise ValueError(f"{path}: expected an .npz archive with 'ids', 'seq_offsets' and 'num_experts', got a single array")
    missing = [k for k in ("ids", "seq_offsets", "num_experts") if k not in z.files]
    if missing:
        raise ValueError(f"{path}: missing array(s) {', '.join(missing)} (has: {', '.join(z.files) or 'nothing'})")
    ne = np.asarray(z["num_experts"])
    if ne.size != 1 or not np.issubdtype(ne.dtype, np.integer):
        raise ValueError(f"{path}: 'num_experts' must be one integer, got {ne!r}")
    return Trace(ids=z["ids"], seq_offsets=z["seq_offsets"], num_experts=int(ne),
                 weights=z["weights"] if "weights" in z.files else None,
                 model=str(z["model"]) if "model" in z.files else "unknown",
                 layer_numbers=z["layer_numbers"] if "layer_numbers" in z.files else None,
                 source=path, expert_bytes=int(z["expert_bytes"]) if "expert_bytes" in z.files else None,
                 expert_dtype=(str(z["expert_dtype"]) or None) if "expert_dtype" in z.files else None)


# ---------------------------------------------------------------------------------------------
# Statistics


def reuse_distances(tr: Trace) -> np.ndarray:
    """Per access (token, layer, expert), tokens since the same expert was last used at that layer
    (over the whole trace in order); first uses are left out."""
    T, L, k = tr.ids.shape
    E = tr.num_experts
    key = (tr.ids.astype(np.int64) + (np.arange(L, dtype=np.int64) * E)[None, :, None]).reshape(-1)
    tok = np.repeat(np.arange(T, dtype=np.int64), L * k)
    order = np.lexsort((tok, key))
    ks, ts = key[order], tok[order]
    same = ks[1:] == ks[:-1]
    return (ts[1:] - ts[:-1])[same]


def trace_stats(tr: Trace) -> dict:
    T, L, k = tr.ids.shape
    E = tr.num_experts
    counts = np.zeros((L, E), dtype=np.int64)
    flat = (tr.ids.astype(np.int64) + (np.arange(L) * E)[None, :, None]).reshape(-1)
    counts = np.bincount(flat, minlength=L * E).reshape(L, E)
    top = max(1, int(round(0.1 * E)))
    srt = -np.sort(-counts, axis=1)
    share_top10 = srt[:, :top].sum(1) / np.maximum(counts.sum(1), 1)
    p = counts / np.maximum(counts.sum(1, keepdims=True), 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        ent = -np.nansum(np.where(p > 0, p * np.log2(p), 0.0), axis=1)
    rd = reuse_distances(tr)
    q = [0.1, 0.25, 0.5, 0.75, 0.9, 0.99]
    # Temporal persistence: share of a token's experts also chosen by the previous token of its sequence.
    prev_ok = np.ones(T, dtype=bool)
    prev_ok[tr.seq_offsets[:-1]] = False
    if prev_ok[1:].any():
        a = np.sort(tr.ids[1:][prev_ok[1:]], axis=2)
        b = np.sort(tr.ids[:-1][prev_ok[1:]], axis=2)
        inter = sum((a[..., i:i + 1] == b).any(-1).sum() for i in range(k))
        persistence = float(inter / a.size)
    else:
        persistence = float("nan")
    lens = tr.seq_lengths()
    return {
        "file": tr.source, "model": tr.model, "tokens": T, "sequences": tr.num_sequences,
        "seq_len_mean": float(lens.mean()), "seq_len_min": int(lens.min()), "seq_len_max": int(lens.max()),
        "layers": L, "experts": E, "top_k": k, "has_weights": tr.weights is not None,
        "accesses": int(T * L * k),
        "top10pct_share_per_layer": share_top10.tolist(),
        "top10pct_share_mean": float(share_top10.mean()),
        "uniform_top10pct_share": top / E,
        "entropy_bits_per_layer_mean": float(ent.mean()), "entropy_bits_max": float(np.log2(E)),
        "experts_never_used": int((counts == 0).sum()),
        "persistence": persistence, "uniform_persistence": k / E,
        "reuse_distance_tokens": {f"p{int(x * 100)}": float(np.quantile(rd, x)) for x in q} if rd.size else {},
        "first_uses": int(T * L * k - rd.size),
    }


def format_stats(s: dict) -> str:
    lines = [
        f"trace          {s['file']}",
        f"model          {s['model']}",
        f"tokens         {s['tokens']:,}",
        f"sequences      {s['sequences']:,} (length mean {s['seq_len_mean']:.1f}, min {s['seq_len_min']}, max {s['seq_len_max']})",
        f"layers         {s['layers']}",
        f"experts        {s['experts']} per layer",
        f"top-k          {s['top_k']}",
        f"weights        {'yes' if s['has_weights'] else 'no'}",
        f"accesses       {s['accesses']:,} (token x layer x top-k)",
        f"top-10% share  {s['top10pct_share_mean']:.3f} of accesses on the 10% most used experts of a layer "
        f"(uniform: {s['uniform_top10pct_share']:.3f})",
        f"entropy        {s['entropy_bits_per_layer_mean']:.2f} bits per layer (uniform: {s['entropy_bits_max']:.2f})",
        f"persistence    {s['persistence']:.3f} of a token's experts reused by the next token (uniform: {s['uniform_persistence']:.3f})",
        f"never used     {s['experts_never_used']} (layer, expert) pairs",
    ]
    rd = s["reuse_distance_tokens"]
    if rd:
        lines.append("reuse distance " + "  ".join(f"{k}={v:g}" for k, v in rd.items()) + " tokens")
    lines.append("skew per layer " + " ".join(f"{x:.2f}" for x in s["top10pct_share_per_layer"]))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Continuous batching


@dataclass
class Schedule:
    """Which tokens each step holds. ``tokens[step_ptr[s]:step_ptr[s+1]]`` are step s's tokens."""

    batch: int
    tokens: np.ndarray     # tokens: [T] token indices ordered by step
    step_ptr: np.ndarray   # step_ptr: [steps+1]
    seq_start_step: np.ndarray = field(repr=False, default=None)  # [S]

    @property
    def num_steps(self) -> int:
        return int(len(self.step_ptr) - 1)

    def batch_sizes(self) -> np.ndarray:
        return np.diff(self.step_ptr)


def continuous_batches(seq_offsets: np.ndarray, batch: int) -> Schedule:
    """B sequences decode concurrently, one token of each active sequence per step; when one
    finishes, its slot takes the next unstarted sequence at the following step. Sequences are
    admitted in trace order; a free slot with the lowest index is filled first."""
    if not isinstance(batch, (int, np.integer)) or batch < 1:
        raise ValueError(f"batch size must be a positive integer, got {batch!r}")
    so = np.asarray(seq_offsets, dtype=np.int64)
    lens = np.diff(so)
    S = len(lens)
    start = np.empty(S, dtype=np.int64)
    if batch >= S:
        start[:] = 0
    else:
        import heapq
        free = [(0, slot) for slot in range(batch)]  # (step the slot is free from, slot)
        heapq.heapify(free)
        for s in range(S):
            st, slot = heapq.heappop(free)
            start[s] = st
            heapq.heappush(free, (st + int(lens[s]), slot))
    seq_of_tok = np.repeat(np.arange(S), lens)
    pos = np.arange(so[-1]) - so[seq_of_tok]
    step = start[seq_of_tok] + pos
    order = np.argsort(step, kind="stable")
    n_steps = int(step.max()) + 1
    ptr = np.zeros(n_steps + 1, dtype=np.int64)
    ptr[1:] = np.cumsum(np.bincount(step, minlength=n_steps))
    return Schedule(batch=int(batch), tokens=order.astype(np.int64), step_ptr=ptr, seq_start_step=start)


@dataclass
class Groups:
    """The needed experts of every (step, layer), as flat arrays in processing order.

    Group g = step * L + layer holds ``keys[ptr[g]:ptr[g+1]]`` (flat keys layer*E + expert,
    ascending), with ``count`` tokens routed to each and ``weight`` (router weight summed over
    those tokens; the count when the trace has no weights)."""

    num_layers: int
    num_experts: int
    num_steps: int
    keys: np.ndarray     # [N] int32 flat keys
    count: np.ndarray    # [N] int32 tokens routed to the expert in that step
    weight: "np.ndarray | None"   # [N] float32; None: equal to count (no router weights)
    ptr: np.ndarray      # [steps*L + 1]
    batch_sizes: np.ndarray  # [steps]

    def weights(self) -> np.ndarray:
        return self.weight if self.weight is not None else self.count.astype(np.float32)

    def next_use(self) -> np.ndarray:
        """For each entry, the group index of the next group needing the same key (inf: never)."""
        N = len(self.keys)
        gid = np.repeat(np.arange(len(self.ptr) - 1, dtype=np.int64), np.diff(self.ptr))
        order = np.lexsort((gid, self.keys))
        nxt = np.full(N, np.inf)
        same = self.keys[order[1:]] == self.keys[order[:-1]]
        nxt[order[:-1][same]] = gid[order[1:][same]]
        return nxt


def build_groups(tr: Trace, sched: Schedule, chunk_steps: "int | None" = None) -> Groups:
    T, L, k = tr.ids.shape
    E = tr.num_experts
    if chunk_steps is None:  # bound the dense [steps, L, E] count grid to ~4M cells
        chunk_steps = max(1, 4_000_000 // (L * E))
    ids = tr.ids
    if sched.num_steps == T:  # one token per step: each group is that token's k experts, sorted
        toks = sched.tokens
        sel = ids if np.array_equal(toks, np.arange(T)) else ids[toks]
        off = (np.arange(L, dtype=np.int32) * E)[None, :, None]
        if tr.weights is None:
            keys = np.sort(sel, axis=2).astype(np.int32) + off
            w = None                                                     # equals the count: 1
        else:
            order = np.argsort(sel, axis=2, kind="stable")              # order: [T, L, k]
            keys = np.take_along_axis(sel, order, axis=2).astype(np.int32) + off
            wt = tr.weights if sel is ids else tr.weights[toks]
            w = np.take_along_axis(wt, order, axis=2).reshape(-1).astype(np.float32)
        return Groups(num_layers=L, num_experts=E, num_steps=T, keys=keys.reshape(-1),
                      count=np.ones(keys.size, dtype=np.int32), weight=w,
                      ptr=np.arange(0, T * L * k + 1, k, dtype=np.int64), batch_sizes=sched.batch_sizes())
    keys_l, cnt_l, w_l, sizes = [], [], [], []
    for s0 in range(0, sched.num_steps, chunk_steps):
        s1 = min(sched.num_steps, s0 + chunk_steps)
        a, b = sched.step_ptr[s0], sched.step_ptr[s1]
        toks = sched.tokens[a:b]
        local_step = np.repeat(np.arange(s1 - s0), np.diff(sched.step_ptr[s0:s1 + 1]))
        # cell: [tokens, L, k] index of (step, layer, expert) in a dense [steps, L, E] grid
        cell = ((local_step[:, None, None] * L + np.arange(L)[None, :, None]) * E
                + ids[toks].astype(np.int64))
        n = (s1 - s0) * L * E
        cnt = np.bincount(cell.reshape(-1), minlength=n)
        if tr.weights is not None:
            wsum = np.bincount(cell.reshape(-1), weights=tr.weights[toks].reshape(-1), minlength=n)
        nz = np.flatnonzero(cnt)
        grp = nz // E
        keys_l.append(((grp % L) * E + nz % E).astype(np.int32))
        cnt_l.append(cnt[nz].astype(np.int32))
        w_l.append((wsum[nz] if tr.weights is not None else cnt[nz]).astype(np.float32))
        sizes.append(np.bincount(grp, minlength=(s1 - s0) * L))
    sizes = np.concatenate(sizes)
    ptr = np.zeros(len(sizes) + 1, dtype=np.int64)
    ptr[1:] = np.cumsum(sizes)
    return Groups(num_layers=L, num_experts=E, num_steps=sched.num_steps, keys=np.concatenate(keys_l),
                  count=np.concatenate(cnt_l), weight=np.concatenate(w_l), ptr=ptr,
                  batch_sizes=sched.batch_sizes())
