"""Structured-output grammar engines side by side: llguidance (what runtime/engine/grammar.py uses), xgrammar and
outlines-core, on the same byte-level BPE tokenizer, at two vocab sizes (4,096 and 128,000 tokens) and three JSON
schemas (a flat object: a string with maxLength, an integer, an enum; a nested object with an array of objects;
json_object = any JSON object). Each engine not importable is skipped with the reason in the report.

Measured per (engine, vocab, schema):
- compile: the schema to a matcher ready for its first mask (median of --compile-repeats fresh compiles, no
  cache); TTFM = that plus the first step (lazy work some engines leave to the first mask);
- one decoding step as the engine pays it: the allowed-token mask of the current state (packed int32 bits), its
  conversion to the bool [vocab] mask the engine consumes (the expression of runtime Matcher.allowed), and the
  advance of the state by the chosen token - mean / p50 / p99 microseconds over --seeds whole constrained
  generations of at most about --max-tokens tokens (a seeded random choice among the allowed tokens, steered to
  end the JSON in the second part so every run terminates), each run --runs times (per step the median run);
- correctness: every generation's text must parse as JSON and validate against the schema (a small validator of
  the keywords used here); along the reference engine's (llguidance's) tokens the engines' allowed sets are
  compared step by step; and a few strings (a raw control character, escapes, DEL, non-ASCII) are probed inside
  each schema's strings against RFC 8259.
"llguidance-inplace" is llguidance writing its mask into a preallocated tensor instead of the runtime's
compute_bitmask() -> bytearray path: what that path costs.

Whitespace: every engine is set to compact JSON with no free whitespace (llguidance x-guidance
whitespace_flexible false with "," and ":" separators; xgrammar any_whitespace=False, separators (",", ":");
outlines-core whitespace_pattern ""), so their languages can agree. The server itself uses ", " and ": " (one
space each); a fixed separator byte costs the same per step.

Each trial runs in a forked child process (a compile past --compile-timeout is killed and reported; the child's
address space is capped at --mem-limit-gb more than it starts with) with torch at 1 intra-op thread (steadier on
a shared 2-core machine; the masks here are 128k elements at most). The tokenizers are trained once and cached
in --workdir.

Usage: python bench/grammar_engines.py [--quick] [--engines llguidance,llguidance-inplace,xgrammar,outlines-core]
       [--vocab 4096,128000] [--schemas flat,nested,json_object] [--outdir DIR] [--json PATH]
--quick: the 4,096 vocab, the flat schema, one 60-token generation run once, one compile (seconds; what the
test runs); without --outdir it writes into a temporary folder, not over bench/results.

The pieces are in bench/grammar_bench/: tokenizer.py (training and reading the tokenizers), schemas.py (the
schemas, the validator, the string probes), engines.py (each engine as its integration calls it), trial.py (one
trial in a forked child), report.py and verdict.py (the report and its conclusion); this file is the command.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
RESULTS = os.path.join(HERE, "results")
# HF tokenizers trains with rayon; the children fork afterwards and must not inherit a thread pool.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from grammar_bench.engines import ENGINES, MODULE, engine_version, importable  # noqa: E402
from grammar_bench.report import Setup, write  # noqa: E402
from grammar_bench.schemas import SCHEMAS, check_output, validate  # noqa: E402
from grammar_bench.tokenizer import Tok, train_tokenizer  # noqa: E402
from grammar_bench.trial import Job, run_trial  # noqa: E402

__all__ = ["ENGINES", "MODULE", "SCHEMAS", "check_output", "importable", "main", "validate"]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="4,096 vocab, the flat schema, one short run (seconds)")
    ap.add_argument("--outdir", default=None, help="where grammar_engines.md goes (default bench/results; --quick: "
                                                   "a temporary folder)")
    ap.add_argument("--json", default=None, help="also write the raw results here")
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--vocab", default=None, help="vocab sizes, comma-separated (default 4096,128000)")
    ap.add_argument("--schemas", default=None, help=f"of {', '.join(SCHEMAS)} (default all)")
    ap.add_argument("--seeds", type=int, default=None, help="generations per trial (default 5)")
    ap.add_argument("--max-tokens", type=int, default=None, help="about this many tokens per generation (200)")
    ap.add_argument("--runs", type=int, default=None, help="times each generation runs; per step the median "
                                                             "(default 3)")
    ap.add_argument("--compile-repeats", type=int, default=None, help="fresh compiles timed (default 3)")
    ap.add_argument("--compile-timeout", type=float, default=120.0, help="seconds before a compile is killed")
    ap.add_argument("--mem-limit-gb", type=float, default=8.0, help="address space a trial may add (GB)")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "tiered-moe-grammar-bench"),
                    help="where the trained tokenizers are cached")
    return ap


def main(argv=None) -> dict:
    a = _parser().parse_args(argv)
    q = a.quick
    vocabs = [int(v) for v in (a.vocab or ("4096" if q else "4096,128000")).split(",")]
    max_tokens = a.max_tokens or (60 if q else 200)
    started = time.time()
    engines, skipped = _available(a.engines.split(","))
    toks, tok_info = _tokenizers(vocabs, a.workdir)
    su = Setup(cmd="python bench/grammar_engines.py" + " ".join([""] + (argv if argv is not None else sys.argv[1:])),
               started=started, vocabs=vocabs, schemas=(a.schemas or ("flat" if q else ",".join(SCHEMAS))).split(","),
               seeds=a.seeds or (1 if q else 5), max_tokens=max_tokens, repeats=a.compile_repeats or (1 if q else 3),
               runs=a.runs or (1 if q else 3),
               outdir=a.outdir or (tempfile.mkdtemp(prefix="grammar-engines-") if q else RESULTS),
               json_path=a.json, versions=_versions(engines), skipped=skipped, toks=toks, tok_info=tok_info)
    ref_engine = next((e for e in ("llguidance", "llguidance-inplace") if e in engines),
                      engines[0] if engines else None)
    results, refs = _trials(su, engines, ref_engine, a.mem_limit_gb, a.compile_timeout)
    return write(su, results, refs, ref_engine)


def _available(names: list) -> "tuple[list, dict]":
    """The engines importable here, and why each other one is not."""
    engines, skipped = [], {}
    for name in names:
        why = importable(name)
        if why:
            skipped[name] = why
            print(f"skipping {name}: {why}", file=sys.stderr)
        else:
            engines.append(name)
    return engines, skipped


def _versions(engines: list) -> dict:
    versions = {}
    for name in engines:
        versions[MODULE[name]] = engine_version(name)
    import importlib.metadata as md
    for p in ("torch", "tokenizers", "transformers", "apache-tvm-ffi"):
        try:
            versions[p] = md.version(p)
        except md.PackageNotFoundError:
            pass
    return versions


def _tokenizers(vocabs: list, workdir: str) -> "tuple[dict, dict]":
    """{vocab: Tok}, {vocab: how it was trained}: trained once into workdir, then read from there."""
    os.makedirs(workdir, exist_ok=True)
    toks, tok_info = {}, {}
    for V in vocabs:
        path = os.path.join(workdir, f"bpe{V}.json")
        if not os.path.exists(path):
            print(f"training the {V:,}-token byte-level BPE ...", file=sys.stderr)
            t0 = time.time()
            # Forked, so this process never holds rayon's threads when it forks the trials.
            p = mp.get_context("fork").Process(target=train_tokenizer, args=(path, V))
            p.start()
            p.join()
            if p.exitcode != 0:
                raise SystemExit(f"training the {V}-token tokenizer failed (exit {p.exitcode})")
            print(f"  {time.time() - t0:.1f} s", file=sys.stderr)
        toks[V] = Tok(path)
        with open(path + ".info") as f:
            tok_info[V] = json.load(f)
    return toks, tok_info


def _trials(su: Setup, engines: list, ref_engine: "str | None", mem_limit_gb: float,
            compile_timeout: float) -> "tuple[list, dict]":
    """Every (vocab, schema, engine) trial's result, and the reference engine's seed-0 tokens and masks per
    (vocab, schema) (what the others replay)."""
    jobs = [(V, s, e) for V in su.vocabs for s in su.schemas for e in engines]
    try:
        from tqdm import tqdm
        bar = tqdm(total=len(jobs), desc="trials", unit="trial", file=sys.stderr)
    except ImportError:
        bar = None
    results, refs = [], {}
    for V, s, e in jobs:
        if bar is not None:
            bar.set_postfix_str(f"{e} V={V} {s}")
        else:
            print(f"[{len(results) + 1}/{len(jobs)}] {e} V={V} {s}", file=sys.stderr, flush=True)
        job = Job(engine=e, tokenizer=su.toks[V].path, schema=SCHEMAS[s], schema_name=s, seeds=su.seeds,
                  max_tokens=su.max_tokens, end_at=int(0.6 * su.max_tokens), compile_repeats=su.repeats,
                  runs=su.runs, mem_limit_gb=mem_limit_gb,
                  replay=None if e == ref_engine else (refs.get((V, s)) or {}).get("tokens"))
        r = run_trial(job, compile_timeout, 600.0)
        r.update(engine=e, vocab=V, schema=s)
        if e == ref_engine and r["status"] == "ok":
            refs[(V, s)] = {"tokens": r["tokens"][0], "masks": r["ref_masks"]}
        results.append(r)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return results, refs


if __name__ == "__main__":
    main()
