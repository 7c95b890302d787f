"""The report's conclusion, from the numbers: the lowest per-token overhead per vocab (overall and per schema),
what each engine faster than llguidance (as the runtime calls it) costs otherwise, and whether keeping llguidance
is justified."""
from __future__ import annotations

from typing import TYPE_CHECKING

from .figures import stats
from .schemas import PROBES

if TYPE_CHECKING:
    from .report import Totals


def verdict(summary: "dict[tuple, Totals]", best: dict, vocabs: list, toks: dict, common: dict,
            results: list) -> list:
    """The conclusion, from the numbers: the lowest per-token overhead per vocab (overall and per schema), and
    what each engine faster than llguidance (as the runtime calls it) costs otherwise - time to first mask per
    new schema, invalid outputs, JSON strings it gets wrong (any vocab)."""
    ok = [r for r in results if r["status"] == "ok"]
    invalid, against = _faults(ok)
    out, extra, reasons = [], [], {}
    # A faster engine's drawback in any vocab counts (a wrong string grammar is wrong at every vocab size).
    drawbacks = {x: bool(invalid.get(x)) or any(not PROBES[k][1] for k in against.get(x, {})) for x in invalid}
    for V in vocabs:
        if V not in best:
            continue
        eng = {e: d for (v, e), d in summary.items() if v == V and d.tot}
        out.append(_headline(V, eng, best[V], toks, common, ok))
        llg = eng.get("llguidance")
        if llg is None:
            continue
        faster = [x for x in eng if not x.startswith("llguidance") and eng[x].mean < llg.mean]
        for x in faster:
            why = _drawbacks(eng[x], llg, invalid.get(x), against.get(x))
            reasons[x] = reasons.get(x, []) + why
            out.append(f"  - {x} is faster per token ({eng[x].mean:.1f} us); " +
                       ("but " + "; ".join(why) if why else "with no failure, invalid output or slow compile here")
                       + ".")
        if not faster:
            out.append("  - no other engine is faster per token here.")
        for x in faster:
            extra.append((V, x, llg.mean - eng[x].mean, bool(drawbacks.get(x)) or bool(reasons[x])))
        conv = {x: eng[x].mean - stats(eng[x].engine)["mean"] for x in eng}
        fastest = min(eng, key=lambda x: eng[x].mean)
        out.append(f"  - the conversion to bool [vocab] (the runtime's expression, the same for every engine) costs "
                   f"{min(conv.values()):.0f}-{max(conv.values()):.0f} us per token here: "
                   f"{conv[fastest] / eng[fastest].mean:.0%} of {fastest}'s step.")
    if against.get("llguidance"):
        out.append("- llguidance differs from RFC 8259 in strings: " + _rfc(against["llguidance"]) + ".")
    out += ["", "For scale: bench/results/decode_speed.md measures about 100 tokens/s at batch 1 for the demo model "
                "on this machine (about 10 ms a step); a real model's step is longer."]
    return out + _closing(extra, summary)


def _faults(ok: list) -> "tuple[dict, dict]":
    """Per engine its invalid outputs ("vocab V schema seed n"), and the string probes it answers against RFC 8259
    ({engine: {probe: {schema, ...}}})."""
    invalid, against = {}, {}
    for r in ok:
        invalid.setdefault(r["engine"], []).extend(f"vocab {r['vocab']:,} {r['schema']} seed {o['seed']}"
                                                   for o in r["outputs"] if o["errors"])
        for k, (_, want) in PROBES.items():
            if r.get("probes", {}).get(k, want) != want:
                against.setdefault(r["engine"], {}).setdefault(k, set()).add(r["schema"])
    return invalid, against


def _rfc(against: dict) -> str:
    return ", ".join(f"{'accepts' if not PROBES[k][1] else 'rejects'} {k} ({', '.join(sorted(sch))})"
                     for k, sch in against.items())


def _headline(V: int, eng: dict, best: tuple, toks: dict, common: dict, ok: list) -> str:
    """A vocab's line: its fastest engine overall (against llguidance as the runtime calls it) and per schema."""
    e, mean = best
    line = (f"- vocab {toks[V].V:,} (schemas {', '.join(common[V])}): lowest per-token overhead: **{e}**, "
            f"{mean:.1f} us per step (mask + conversion + advance)")
    llg = eng.get("llguidance")
    if llg is not None and e != "llguidance":
        line += (f"; llguidance as the runtime calls it: {llg.mean:.1f} us ({llg.mean / mean:.2f}x, "
                 f"{llg.mean - mean:.0f} us more per token)")
    per = []
    for s in common[V]:
        rs = {r["engine"]: r["summary"]["step"]["mean"] for r in ok if (r["vocab"], r["schema"]) == (V, s)}
        w = min(rs, key=rs.get)
        per.append(f"{s}: {w} {rs[w]:.1f} us" + (f" (llguidance {rs['llguidance']:.1f})"
                                                  if "llguidance" in rs and w != "llguidance" else ""))
    return line + ". Per schema, the fastest: " + "; ".join(per) + "."


def _drawbacks(d: "Totals", llg: "Totals", invalid: "list | None", against: "dict | None") -> list:
    """What an engine faster than llguidance costs otherwise: failed trials, a slow first mask, invalid outputs,
    strings against RFC 8259."""
    why = []
    worst_x = max(d.ttfm.values()) if d.ttfm else float("nan")
    worst_l = max(llg.ttfm.values()) if llg.ttfm else float("nan")
    if d.failed:
        why.append(f"failed on {'; '.join(d.failed)}")
    if worst_x > 5 * worst_l and worst_x > 10:
        why.append(f"its time to first mask reaches {worst_x:,.0f} ms per new schema (llguidance "
                   f"{worst_l:,.1f} ms)")
    if invalid:
        why.append(f"{len(invalid)} invalid output(s) in this run ({', '.join(invalid[:3])})")
    if against:
        why.append("differs from RFC 8259 in strings: " + _rfc(against))
    return why


def _closing(extra: list, summary: dict) -> list:
    """The verdict: whether keeping llguidance is justified. extra: (vocab, faster engine, us it saves per token,
    whether it has a drawback)."""
    if extra:
        worst = max(extra, key=lambda x: x[2])
        clean = [f"{x} (vocab {V:,})" for V, x, _, bad in extra if not bad]
        return ["", "**Verdict.** llguidance is not the fastest per token: " + "; ".join(
            f"{x} saves {d:.0f} us per token at vocab {V:,}" for V, x, d, _ in extra) + ". "
            + (f"Keeping llguidance is not justified by these numbers: {', '.join(clean)} is faster with none of "
               "the drawbacks measured here." if clean else
               f"Keeping llguidance is justified all the same: every faster engine has a drawback listed above (a "
               f"slow first mask for each new schema, JSON it gets wrong, or both), and the most llguidance costs "
               f"extra is {worst[2]:.0f} us per token "
               f"({worst[2] / 1e4:.1%} of a 10 ms decode step).")]
    if summary:
        return ["", "**Verdict.** No engine measured here is faster per token than llguidance: keeping it is "
                    "justified."]
    return []
