"""The report: per trial its row (and its agreement with the reference engine's masks), per vocab and engine the
totals over every step, the string probes, the conclusion (verdict.py); written as grammar_engines.md and, when
asked, the raw results as JSON."""
from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field

from .figures import cpu_model, fmt, stats
from .schemas import PROBES
from .tokenizer import EOS_TEXT, Tok
from .verdict import verdict


@dataclass
class Setup:
    """A run of the bench: what it measured, with what (the report's header and the raw data's)."""
    cmd: str                       # the command line, as the report shows it
    started: float                 # time.time() at the start
    vocabs: list                   # vocab sizes asked for
    schemas: list                  # schema names
    seeds: int
    max_tokens: int
    repeats: int                   # compiles timed per trial
    runs: int                      # runs per generation
    outdir: str
    json_path: "str | None"        # where the raw results go (None: not written)
    versions: dict                 # package -> version
    skipped: dict                  # engine -> why it is not importable
    toks: dict                     # vocab -> Tok
    tok_info: dict                 # vocab -> how its tokenizer was trained


@dataclass
class Totals:
    """One engine at one vocab over its trials: every step's microseconds (of the schemas every engine completed)
    and what went wrong."""
    tot: list = field(default_factory=list)        # mask + convert + advance per step
    steady: list = field(default_factory=list)     # those from each generation's step 10 on
    engine: list = field(default_factory=list)     # mask + advance per step (the engine's part)
    ttfm: dict = field(default_factory=dict)       # schema -> time to first mask, ms (every schema it completed)
    wide: list = field(default_factory=list)       # steps with more than half the vocab allowed
    narrow: list = field(default_factory=list)     # the rest
    invalid: list = field(default_factory=list)    # "schema seed n: first error" of invalid outputs
    runs: int = 0                                  # generations
    failed: list = field(default_factory=list)     # "schema (status: reason)" of failed trials
    mean: float = float("nan")                     # mean of tot (set with the table)


def compare(tk: Tok, ref: list, other: list, tokens: list, rejected_at) -> dict:
    """Step by step along the reference tokens: how the allowed sets relate (identical, the reference's a strict
    subset, a strict superset, or each allowing tokens the other forbids), with the first step of each kind."""
    n = min(len(ref), len(other))
    kinds = {"identical": 0, "ref_subset": 0, "ref_superset": 0, "both": 0}
    first: dict = {}
    for i in range(n):
        a, b = int.from_bytes(ref[i], "little"), int.from_bytes(other[i], "little")
        only_a, only_b = a & ~b, b & ~a
        k = ("identical" if a == b else "ref_subset" if not only_a else "ref_superset" if not only_b else "both")
        kinds[k] += 1
        if k != "identical" and k not in first:
            def show(bits: int) -> str:
                ids = [j for j in range(tk.V) if (bits >> j) & 1]
                return f"{len(ids)}: " + " ".join(repr(tk.token_bytes[j] if j != tk.eos else EOS_TEXT)[1:]
                                                  for j in ids[:4]) + (" ..." if len(ids) > 4 else "")
            first[k] = {"step": i, "after": tk.text(tokens[:i])[-24:], "only_ref": show(only_a),
                        "only_this": show(only_b)}
    return {"compared": n, **kinds, "rejected_at": rejected_at, "first": first}


# -- per trial --------------------------------------------------------------------------------------------------
def trial_rows(results: list, refs: dict, ref_engine: "str | None", toks: dict) -> "tuple[list, list, list]":
    """Each trial's table row, each replayed trial's agreement row, and the invalid outputs; every ok result gets
    its ``summary`` (and a replayed one its ``agreement``)."""
    rows, agree_rows, bad = [], [], []
    for r in results:
        V, s, e = r["vocab"], r["schema"], r["engine"]
        if r["status"] != "ok":
            rows.append([V, s, e, r["status"] + ": " + r["reason"]] + ["-"] * 11)
            continue
        for o in r["outputs"]:
            if o["errors"]:
                bad.append((V, s, e, o["seed"], o["errors"][:3], o["text"][:200]))
        ref = refs.get((V, s))
        rows.append(_row(r, ref, ref_engine))
        if ref is not None and e != ref_engine and "replay_masks" in r:
            cmp = compare(toks[V], ref["masks"], r["replay_masks"], ref["tokens"], r["rejected_at"])
            r["agreement"] = cmp
            ex = "; ".join(f"{k} at step {f['step']} after {f['after']!r}: only {ref_engine} {f['only_ref']}; "
                           f"only {e} {f['only_this']}" for k, f in cmp["first"].items())
            agree_rows.append([V, s, e, cmp["compared"], cmp["identical"], cmp["ref_subset"], cmp["ref_superset"],
                               cmp["both"], "-" if cmp["rejected_at"] is None else cmp["rejected_at"],
                               "`" + ex.replace("`", "'").replace("|", "\\|") + "`" if ex else "-"])
    return rows, agree_rows, bad


def _row(r: dict, ref: "dict | None", ref_engine: "str | None") -> list:
    """An ok trial's row of the main table; sets its ``summary``."""
    V, s, e = r["vocab"], r["schema"], r["engine"]
    tot = [m + c + d for m, c, d in zip(r["mask_us"], r["convert_us"], r["advance_us"])]
    st = stats(tot)
    comp = statistics.median(r["compile_ms"])
    valid = sum(not o["errors"] for o in r["outputs"])
    same = "ref" if e == ref_engine else ("-" if ref is None else
                                         ("yes" if r["tokens"][0] == ref["tokens"] else "no"))
    r["summary"] = {"step": st, "mask_mean": stats(r["mask_us"])["mean"],
                    "convert_mean": stats(r["convert_us"])["mean"], "advance_mean": stats(r["advance_us"])["mean"],
                    "compile_ms": comp, "ttfm_ms": comp + (r["first_step_us"] or 0) / 1e3, "steps": len(tot),
                    "valid": valid, "runs": len(r["outputs"])}
    return [V, s, e, fmt(r["setup_ms"], 0), fmt(comp, 2), fmt(r["summary"]["ttfm_ms"], 2), len(tot),
            fmt(st["mean"]), fmt(st["p50"]), fmt(st["p99"]), fmt(r["summary"]["mask_mean"]),
            fmt(r["summary"]["convert_mean"]), fmt(r["summary"]["advance_mean"]),
            f"{valid}/{len(r['outputs'])}", same]


# -- the report -------------------------------------------------------------------------------------------------
def header(su: Setup, results: list, ref_engine: "str | None", rows: list) -> list:
    """The report's lines up to the per-trial table, included."""
    vocabs, toks, tok_info = su.vocabs, su.toks, su.tok_info
    schemas, seeds, max_tokens, repeats, runs = su.schemas, su.seeds, su.max_tokens, su.repeats, su.runs
    L = ["# Structured-output grammar engines: per-token overhead", "",
         f"Command: `{su.cmd}`", "",
         f"Machine: {platform.machine()}, {os.cpu_count()} cores ({cpu_model()}, a shared VM), Python "
         f"{platform.python_version()}; torch at 1 intra-op thread in the trials.", "",
         "Versions: " + ", ".join(f"{k} {v}" for k, v in su.versions.items()) + ".", ""]
    if su.skipped:
        L += ["Skipped (not importable here): " + "; ".join(f"{k}: {v}" for k, v in su.skipped.items()) + ".", ""]
    L += ["Tokenizers (the same tokenizer.json for every engine): a byte-level BPE trained here with HF tokenizers "
          "(GPT-2 style ByteLevel pre-tokenizer and decoder, the 256 bytes as base alphabet, min_frequency 2, "
          f"`{EOS_TEXT}` = token 0 = EOS) on the .py and .md files, in sorted order, of:"]
    for V in vocabs:
        i = tok_info[V]
        L.append(f"- {V:,} requested, {toks[V].V:,} tokens: {i['files']:,} files, {i['bytes'] / 1e6:.1f} MB "
                 f"from {', '.join(i['roots'])} (the repository without .venv/.git; capped at 64 MB)")
    vt = sorted({f"{r['vocab_type']} at {r['vocab']:,}" for r in results if r.get("vocab_type")})
    if vt:
        L.append(f"- xgrammar's TokenizerInfo.from_huggingface read them as {', '.join(vt)}; llguidance got the "
                 "tokenizer.json path (as the runtime passes it), outlines-core a Vocabulary of each token's bytes "
                 "(the byte-level strings decoded)")
    L += ["", f"Schemas: {', '.join(f'`{s}`' for s in schemas)} (in the script: SCHEMAS); every engine in compact "
          "JSON with no free whitespace (llguidance separators \",\" and \":\", xgrammar any_whitespace=False "
          "separators (\",\", \":\") strict_mode=False, outlines-core whitespace_pattern \"\"; the schemas say "
          "additionalProperties false themselves).", "",
          f"Per trial: {repeats} fresh compile(s) (median; xgrammar's cache off; one only when it takes over 5 s), "
          f"then {seeds} generation(s) (seeds 0..{seeds - 1}) of up to ~{max_tokens} tokens: a seeded random "
          f"allowed token, steered to close the JSON from token {int(0.6 * max_tokens)} on; a step = the engine's "
          "mask + conversion to bool [vocab] (runtime Matcher.allowed's expression) + advancing by the token. "
          f"Each generation runs {runs} time(s) on fresh matchers (the same tokens each time); per step the run "
          "with the median time counts (a stall of this shared machine in one run does not; a step slow every time "
          "does). Timed with perf_counter_ns, GC off during the loop; the EOS step is not counted.", "",
          "Columns: setup = the engine's tokenizer object (once per server); compile = schema -> matcher ready; "
          "TTFM = compile + the first step (time to first mask); step = mask + convert + advance (us per token); "
          "valid = generations that parse as JSON and validate; same tokens = the seed-0 generation is token for "
          f"token the reference's ({ref_engine}).", "",
          "| vocab | schema | engine | setup ms | compile ms | TTFM ms | steps | step mean us | p50 | p99 | "
          "mask us | convert us | advance us | valid | same tokens |",
          "|" + "---|" * 15]
    L += ["| " + " | ".join(str(x) for x in row) + " |" for row in rows]
    L.append("")
    return L


def totals(results: list, vocabs: list, schemas: list) -> "tuple[dict, dict]":
    """({(vocab, engine): Totals}, {vocab: the schemas every engine completed})."""
    # The headline: per vocab, over the schemas every engine completed (so engines are compared on the same
    # work), every step of every generation; "from step 10" leaves out each generation's first 10 steps (where an
    # engine that builds its tables lazily per request pays for that).
    summary: dict = {}
    common = {V: [s for s in schemas
                  if all(r["status"] == "ok" for r in results if (r["vocab"], r["schema"]) == (V, s))] for V in vocabs}
    for r in results:
        d = summary.setdefault((r["vocab"], r["engine"]), Totals())
        if r["status"] != "ok":
            d.failed.append(f"{r['schema']} ({r['status']}: {r['reason']})")
            continue
        d.ttfm[r["schema"]] = r["summary"]["ttfm_ms"]
        d.runs += len(r["outputs"])
        d.invalid += [f"{r['schema']} seed {o['seed']}: {o['errors'][0]}" for o in r["outputs"] if o["errors"]]
        if r["schema"] in common[r["vocab"]]:
            tot = [m + c + x for m, c, x in zip(r["mask_us"], r["convert_us"], r["advance_us"])]
            d.tot += tot
            d.steady += [t for t, i in zip(tot, r["step_idx"]) if i >= 10]
            d.engine += [m + x for m, x in zip(r["mask_us"], r["advance_us"])]
            # "wide" steps: more than half the vocab allowed (free text: inside a string); the rest "narrow"
            for t, n in zip(tot, r["allowed"]):
                (d.wide if n > r["vocab"] // 2 else d.narrow).append(t)
    return summary, common


def totals_table(summary: dict, common: dict) -> "tuple[list, dict]":
    """The per-vocab table's lines, and per vocab the engine with the lowest mean step: {vocab: (engine, us)};
    sets each Totals' mean."""
    L = ["Per token, per vocab, over the schemas every engine completed (every step of every generation); wide "
         "steps = more than half the vocab allowed (free text inside a string), narrow = the rest:", "",
         "| vocab | schemas | engine | steps | step mean us | p50 | p99 | mean from step 10 | wide steps: share, "
         "mean us | narrow steps: mean us | engine part (mask + advance) mean us | conversion mean us | "
         "worst TTFM ms (all schemas) | invalid outputs |",
         "|" + "---|" * 14]
    best = {}
    for (V, e), d in sorted(summary.items()):
        if not d.tot:
            continue
        st = stats(d.tot)
        conv = st["mean"] - stats(d.engine)["mean"]
        worst = max(d.ttfm.values()) if d.ttfm else float("nan")
        L.append(f"| {V:,} | {', '.join(common[V])} | {e} | {len(d.tot)} | {st['mean']:.1f} | {st['p50']:.1f} | "
                 f"{st['p99']:.1f} | {stats(d.steady)['mean']:.1f} | "
                 f"{len(d.wide) / len(d.tot):.0%}, {fmt(stats(d.wide)['mean'])} | "
                 f"{fmt(stats(d.narrow)['mean'])} | {stats(d.engine)['mean']:.1f} | "
                 f"{conv:.1f} | {fmt(worst, 1)}{' + failed: ' + '; '.join(d.failed) if d.failed else ''} | "
                 f"{len(d.invalid)}/{d.runs} |")
        d.mean = st["mean"]
        if V not in best or st["mean"] < best[V][1]:
            best[V] = (e, st["mean"])
    L.append("")
    return L, best


def sections(agree_rows: list, results: list, bad: list, ref_engine: "str | None") -> list:
    """The agreement table, the string probes' table and the invalid outputs (each where there is one)."""
    L: list = []
    if agree_rows:
        L += [f"Allowed-token sets along the reference's ({ref_engine}) seed-0 tokens (the masks compared step by "
              f"step, the EOS step included): identical, {ref_engine}'s a strict subset (it forbids tokens this "
              "engine allows), a strict superset, or each allowing tokens the other forbids; 'rejected at' = the "
              "step whose reference token this engine forbids (the replay stops there); examples: the first step "
              "of each kind, the text before it, the tokens only one side allows (count: first few).", "",
              "| vocab | schema | engine | steps | identical | ref subset | ref superset | both | rejected at | "
              "first of each kind |", "|---|---|---|---|---|---|---|---|---|---|"]
        L += ["| " + " | ".join(str(x) for x in row) + " |" for row in agree_rows]
        L.append("")
    probe_rows = [[r["vocab"], r["schema"], r["engine"]] +
                  [("yes" if r["probes"][k] else "no") + ("" if r["probes"][k] == want else " (!)")
                   for k, (_, want) in PROBES.items()] for r in results if r.get("probes")]
    if probe_rows:
        L += ["JSON string conformance: inside a string of the schema (flat, nested: with maxLength; json_object: "
              "without), is this accepted (fed token by token, the longest allowed token first)? RFC 8259: "
              "control characters must be escaped, DEL and any other character may be raw, the escapes are "
              "valid in every string. (!) = differs from RFC 8259: accepting a raw control character lets the "
              "engine produce text that is not JSON (a bug); rejecting an escape or a character only narrows what "
              "the model may write (the same string may have another spelling: `A` for `\\u0041`, `/` for `\\/`; "
              "a newline has none but `\\n`).", "",
              "| vocab | schema | engine | " + " | ".join(f"`{k}`" for k in PROBES) + " |",
              "|" + "---|" * (3 + len(PROBES))]
        L += ["| " + " | ".join(str(x) for x in row) + " |" for row in probe_rows]
        L.append("")
    if bad:
        L += ["Invalid outputs:", ""] + [f"- {V} {s} {e} seed {sd}: {errs}: `{t!r}`" for V, s, e, sd, errs, t in bad]
        L.append("")
    return L


def write(su: Setup, results: list, refs: dict, ref_engine: "str | None") -> dict:
    """The report written to su.outdir (and the raw results to su.json_path); returns the raw results."""
    rows, agree_rows, bad = trial_rows(results, refs, ref_engine, su.toks)
    L = header(su, results, ref_engine, rows)
    summary, common = totals(results, su.vocabs, su.schemas)
    table, best = totals_table(summary, common)
    L += table + sections(agree_rows, results, bad, ref_engine)
    L += ["## Conclusion", ""] + verdict(summary, best, su.vocabs, su.toks, common, results)
    L += ["", f"Run time: {time.time() - su.started:.0f} s.", ""]
    text = "\n".join(L)
    os.makedirs(su.outdir, exist_ok=True)
    path = os.path.join(su.outdir, "grammar_engines.md")
    with open(path, "w") as f:
        f.write(text)
    print(f"wrote {path}", file=sys.stderr)
    bulky = ("ref_masks", "replay_masks", "mask_us", "convert_us", "advance_us", "step_idx", "allowed")
    data = {"command": su.cmd, "versions": su.versions, "skipped": su.skipped,
            "vocabs": {V: su.toks[V].V for V in su.vocabs}, "tokenizers": su.tok_info, "report": path,
            "results": [{k: v for k, v in r.items() if k not in bulky} for r in results]}
    if su.json_path:
        with open(su.json_path, "w") as f:
            json.dump(data, f, indent=1, default=str)
    return data
