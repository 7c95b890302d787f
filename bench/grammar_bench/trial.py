"""One trial, (engine, vocab, schema), in a forked child process: the engine's setup and compiles, seeded
constrained generations timed step by step, the reference engine's tokens replayed, the string probes."""
from __future__ import annotations

import gc
import multiprocessing as mp
import random
import time
import traceback
from dataclasses import dataclass

from .engines import CLASSES, to_bool
from .schemas import PROBE_PREFIX, PROBES, check_output
from .tokenizer import Tok


@dataclass
class Job:
    """What a trial runs."""
    engine: str
    tokenizer: str                 # the tokenizer.json path
    schema: dict
    schema_name: str
    seeds: int                     # generations (seeds 0..seeds-1)
    max_tokens: int                # about this many tokens per generation
    end_at: int                    # the step from which the choice is steered to end the JSON
    compile_repeats: int
    runs: int                      # times each generation runs (per step the median)
    mem_limit_gb: float            # address space the child may add
    replay: "list | None" = None   # the reference engine's seed-0 tokens (None: this is the reference)


def _classes(tk: Tok):
    """Per-token bool [V] classes that steer the random choice (bytes of the token)."""
    import torch

    def cls(pred):
        return torch.tensor([bool(b) and pred(b) for b in tk.token_bytes], dtype=torch.bool)     # [V]
    return {"closer": cls(lambda b: set(b) <= set(b'"]}')),
            "no_open": cls(lambda b: not (set(b) & set(b"{[,"))),
            "has_close": cls(lambda b: bool(set(b) & set(b"]}"))),
            "ends_item": cls(lambda b: bool(set(b) & set(b'",'))),
            "structural": cls(lambda b: bool(set(b) & set(b'",:')) and not (set(b) & set(b"{["))),}


def pick(ok, eos: int, step: int, end_at: int, rng: random.Random, c: dict) -> int:
    """A seeded random allowed token, a function of the mask alone (engines that agree pick the same tokens).
    First part: uniform among the allowed, but 1 in 5 steps among tokens with a quote or a comma (ends a string or
    a number: short ones, as real JSON's are) and otherwise not closing a container (fuller objects and arrays);
    from end_at on, prefer tokens of closing chars only, then tokens with a separator and no opening bracket (a
    required next property), then tokens opening nothing (so the JSON ends). EOS once the grammar allows it.
    ok: bool [V]."""
    r = rng.random()                        # drawn every step, so the stream stays aligned across engines
    if ok[eos]:
        return eos
    if step >= end_at:
        prefs = (ok & c["closer"], ok & c["structural"], ok & c["no_open"])
    else:
        prefs = (ok & c["ends_item"],) if r < 0.2 else (ok & ~c["has_close"],)
    for p in prefs:
        if p.any():
            ok = p
            break
    ids = ok.nonzero().flatten()            # ids: [n allowed]
    return int(ids[rng.randrange(len(ids))])



def feed(eng, m, tk: "Tok", data: bytes) -> bool:
    """Whether the engine lets data be generated from m's state: at each point the longest allowed token that
    is a prefix of what is left (so an engine that allows only canonical tokens of forced text still gets it)."""
    by_bytes = getattr(tk, "_by_bytes", None)
    if by_bytes is None:
        by_bytes = tk._by_bytes = {b: i for i, b in enumerate(tk.token_bytes) if b and i not in tk.special}
    i = 0
    while i < len(data):
        ok = to_bool(eng.words(m, eng.mask(m)), tk.V)                       # ok: bool [V]
        for n in range(min(len(data) - i, 64), 0, -1):
            t = by_bytes.get(data[i:i + n])
            if t is not None and ok[t]:
                break
        else:
            return False
        eng.advance(m, t)
        i += n
    return True


@dataclass
class Run:
    """One timed generation on a fresh matcher."""
    ids: list                      # the tokens chosen (EOS left out)
    steps: list                    # per token (mask, convert, advance) ns
    ended: bool                    # EOS came (else it ran out of steps)
    masks: list                    # per step the packed mask's bytes (only when asked for)
    allowed: list                  # per token how many tokens were allowed


def trial(job: Job, conn) -> None:
    """One (engine, vocab, schema): tokenizer setup, compiles, generations, replay of the reference tokens."""
    import torch
    torch.set_num_threads(1)
    _limit_memory(job.mem_limit_gb)
    try:
        out = _measure(job, conn)
    except Exception as e:  # noqa: BLE001 - an engine's failure is a row of the report
        out = {"status": "error", "reason": f"{type(e).__name__}: {e}".splitlines()[0][:300],
               "trace": traceback.format_exc()[-2000:]}
    conn.send(("done", out))
    conn.close()


def _limit_memory(gb: float) -> None:
    # A compile that blows up (outlines-core's per-state tables at 128k tokens) must not take the shared
    # machine's memory: past the limit its allocation fails and the trial is reported as failed.
    import resource
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    lim = vm + int(gb * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (lim, lim))


def _measure(job: Job, conn) -> dict:
    import torch
    out: dict = {"status": "ok"}
    tk = Tok(job.tokenizer)
    c = _classes(tk)
    t0 = time.perf_counter()
    eng = CLASSES[job.engine](tk)
    out["setup_ms"] = (time.perf_counter() - t0) * 1e3
    out["vocab_type"] = getattr(eng, "vocab_type", None)
    out["compile_ms"], compiled = _compile(eng, job, conn)
    # The server's torch is warm: the conversion's first calls in a fresh process (lazy op setup) are not its.
    for _ in range(50):
        to_bool(torch.zeros((tk.V + 31) // 32, dtype=torch.int32), tk.V)
    mask_us, conv_us, adv_us, outputs, tokens, ref_masks, step_idx, allowed = [], [], [], [], [], [], [], []
    check_runtime = job.engine == "llguidance"
    for seed in range(job.seeds):
        # The same generation (same seed, so the same tokens) runs job.runs times, each on a fresh matcher;
        # per step the run with the median time counts: a stall of the shared machine in one run does not,
        # a step that is slow every time (an engine building tables lazily per request) does.
        runs = []
        for run in range(job.runs):
            # The very first generation uses the matcher the timed compile built (TTFM's first mask).
            m = compiled[1] if seed == 0 and run == 0 else eng.matcher(compiled[0])
            r = _generate(eng, tk, c, m, job, seed, masks=seed == 0 and run == 0, check=check_runtime,
                          count=run == 0)
            check_runtime = False
            if runs and r.ids != runs[0].ids:
                raise AssertionError(f"seed {seed}: run {run} took other tokens than run 0 (not deterministic)")
            runs.append(r)
            if run == 0:
                allowed += r.allowed
            if seed == 0 and run == 0:
                out["first_step_us"] = sum(r.steps[0]) / 1e3 if r.steps else None
                ref_masks = r.masks
        for i in range(len(runs[0].ids)):
            per_run = sorted((r.steps[i] for r in runs), key=sum)
            st = per_run[len(per_run) // 2]
            mask_us.append(st[0] / 1e3)
            conv_us.append(st[1] / 1e3)
            adv_us.append(st[2] / 1e3)
            step_idx.append(i)
        ids, ended = runs[0].ids, runs[0].ended
        text = tk.text(ids)
        outputs.append({"seed": seed, "tokens": len(ids), "text": text, "ended": ended,
                        "errors": check_output(text, job.schema) if ended else ["no EOS: unfinished"]})
        tokens.append(ids)
    out.update(mask_us=mask_us, convert_us=conv_us, advance_us=adv_us, outputs=outputs, tokens=tokens,
               step_idx=step_idx, allowed=allowed,
               ref_masks=ref_masks)
    if job.replay is not None:       # the reference engine's seed-0 tokens: the masks along them
        masks, out["rejected_at"] = _replay(eng, eng.matcher(compiled[0]), job.replay)
        out["replay_masks"] = masks
    out["probes"] = {name: feed(eng, eng.matcher(compiled[0]), tk, (PROBE_PREFIX[job.schema_name] + body).encode())
                     for name, (body, _) in PROBES.items()}
    return out


def _compile(eng, job: Job, conn) -> tuple:
    """job.compile_repeats fresh compiles (each reported to the parent as it ends): (their ms, the last one)."""
    comp, compiled = [], None
    for i in range(job.compile_repeats):
        t0 = time.perf_counter()
        compiled = eng.compile(job.schema)
        comp.append((time.perf_counter() - t0) * 1e3)
        conn.send(("compiled", comp[-1]))
        if comp[-1] > 5000:                 # an expensive compile (outlines-core at 128k): once is enough
            break
    return comp, compiled


def _generate(eng, tk: Tok, c: dict, m, job: Job, seed: int, masks: bool, check: bool, count: bool) -> Run:
    """One generation from matcher m, timed per step. masks: keep each step's mask; check: compare the first
    step's conversion with the runtime's own (untimed); count: how many tokens each step allowed."""
    import torch
    rng = random.Random(seed)
    r = Run([], [], False, [], [])
    ns = time.perf_counter_ns
    gc.disable()
    for step in range(3 * job.max_tokens):
        a = ns()
        raw = eng.mask(m)
        b = ns()
        ok = to_bool(eng.words(m, raw), tk.V)                   # ok: bool [V]
        d = ns()
        if check:   # the conversion here is the runtime's own (untimed, once)
            from runtime.engine.grammar import Matcher
            shim = type("S", (), {"m": m, "gt": type("G", (), {"vocab_size": tk.V})})()
            assert torch.equal(Matcher.allowed(shim), ok)
            check = False
        if masks:
            r.masks.append(eng.words(m, raw).numpy().tobytes())
        t = pick(ok, tk.eos, step, job.end_at, rng, c)
        if t == tk.eos:
            break
        e = ns()
        eng.advance(m, t)
        f = ns()
        r.steps.append((b - a, d - b, f - e))
        r.ids.append(t)
        if count:
            r.allowed.append(int(ok.sum()))
    gc.enable()
    r.ended = t == tk.eos
    return r


def _replay(eng, m, tokens: list) -> "tuple[list, int | None]":
    """The masks along ``tokens`` from matcher m (one more after the last: EOS allowed?), and the step whose token
    this engine forbids (the replay stops there; None: none)."""
    masks = []
    for i, t in enumerate(tokens):
        w = eng.words(m, eng.mask(m)).numpy().tobytes()
        masks.append(w)
        if not _allowed(w, t):
            return masks, i
        eng.advance(m, t)
    masks.append(eng.words(m, eng.mask(m)).numpy().tobytes())    # after the last: EOS allowed?
    return masks, None


def _allowed(mask: bytes, t: int) -> bool:
    return bool((mask[t // 8] >> (t % 8)) & 1)


def run_trial(job: Job, compile_timeout: float, run_timeout: float) -> dict:
    """trial() in a forked child; a compile past compile_timeout (or a run past run_timeout) is killed."""
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    p = ctx.Process(target=trial, args=(job, child), daemon=True)
    p.start()
    child.close()
    deadline, compiled = time.time() + compile_timeout, False
    try:
        while True:
            left = deadline - time.time()
            if left <= 0 or not parent.poll(left):
                what = "run" if compiled else "compile"
                limit = run_timeout if compiled else compile_timeout
                return {"status": "timeout", "reason": f"{what} exceeded {limit:.0f} s"}
            kind, val = parent.recv()
            if kind == "done":
                return val
            if not compiled:        # the first compile finished: the rest of the trial gets run_timeout
                compiled, deadline = True, time.time() + run_timeout
    except EOFError:
        p.join()
        return {"status": "error", "reason": f"the child died (exit code {p.exitcode}; past the memory limit?)"}
    finally:
        if p.is_alive():
            p.kill()
        p.join()
