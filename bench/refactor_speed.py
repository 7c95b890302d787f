"""Decode speed, tokens, hits, bytes and expert stalls of two source trees on the same store (a refactor
must change none of them, and must not slow decoding down). Goal: new / old >= 0.97 on the resident rows.

A synthetic Mixtral-format checkpoint of realistic shape (hidden 512, 8 layers, 32 experts top-4,
float32) is built and converted once; each (tree, case) run is a fresh process that imports tiered-moe
from that tree alone, loads the store, warms up once and times greedy decode of 32 new tokens per
sequence (8-token prompts). Cases: the fused CPU decode and the composed layers
(TIERED_MOE_FUSED_DECODE=0) at batch 1 and 16 with every expert resident; and a tiered run (a quarter of
the experts on the device tier, lookahead prefetch) whose stall seconds show whether the next layer's
loads overlap this layer's compute. The trees alternate, round after round, so drift of a shared machine
falls on both.

Usage: python bench/refactor_speed.py --old DIR --new DIR [--rounds 3] [--out bench/results/refactor_speed.md]
(``git worktree add /tmp/old <commit>`` gives an old tree.)
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
NEW_TOKENS, PROMPT = 32, 8

RUN = r"""
import json, sys, time, torch
torch.set_num_threads(1)
from runtime.engine import Engine, SamplingParams
from runtime.model import load_model
from runtime.store import Manifest
store, batch, new, plen, frac, prefetch = (sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]),
                                           float(sys.argv[5]), sys.argv[6])
m = Manifest.read(store)
budget = None if frac >= 1 else int(frac * m.num_layers * m.num_experts) * m.blob_stride
# the same prompts in every repetition: the timed runs do the same work, and their hits and bytes are comparable
prompts = torch.randint(0, 1024, (batch, plen), generator=torch.Generator().manual_seed(batch)).tolist()
best, outs, rec, last = None, None, None, None
for rep in range(3):                      # rep 0 warms up
    model, st = load_model(store, expert_budget=budget, policy="lru")   # a fresh store: the same placement each rep
    eng = Engine(model, st, max_batch=batch, prefill_chunk=plen, prefetch=prefetch,
                 prefetch_rule="always" if prefetch != "none" else "cost")
    ids = [eng.add_request(p, SamplingParams(max_tokens=new, ignore_eos=True))
           for p in prompts]
    eng.run()
    dec = [s for s in eng.steps if s.tokens == s.batch]          # decode steps only
    tps = sum(s.batch for s in dec) / sum(s.seconds for s in dec)
    sm = eng.summary()
    if rep and (best is None or tps > best):
        best = tps
        rec = {"stall_seconds": sm["stall_seconds"], "decode_stall_s": sum(s.stall_seconds for s in dec),
               "steps": len(dec)}
    outs = [eng.done[i].output for i in ids]
    last = {"hits": sm["hits"], "bytes": sm["bytes"]}   # the last repetition's, beside its outputs
    st.close()
print(json.dumps({"tokens_per_s": best, "outputs": outs, **rec, **last}))
"""


def build(workdir: str, tree: str) -> str:
    store = os.path.join(workdir, "store")
    if os.path.exists(os.path.join(store, "manifest.json")):
        return store
    code = ("import sys; from runtime.model.synthetic import SyntheticModelSpec, build_checkpoint; "
            "from runtime.model.convert import convert; "
            "build_checkpoint(sys.argv[1], SyntheticModelSpec(vocab_size=1024, hidden_size=512, intermediate_size=512, "
            "num_layers=8, num_experts=32, top_k=4, num_heads=8, num_kv_heads=4)); convert(sys.argv[1], sys.argv[2])")
    subprocess.run([sys.executable, "-c", code, os.path.join(workdir, "hf"), store], cwd=tree, check=True,
                   env={**os.environ, "PYTHONPATH": tree})
    return store


# (label, batch, fraction of experts on the device, prefetch, TIERED_MOE_FUSED_DECODE)
CASES = [("fused, resident", 1, 1.0, "none", "1"), ("fused, resident", 16, 1.0, "none", "1"),
         ("composed, resident", 1, 1.0, "none", "0"), ("composed, resident", 16, 1.0, "none", "0"),
         ("fused, 25% on the device, lookahead prefetch", 1, 0.25, "lookahead", "1"),
         ("composed, 25% on the device, lookahead prefetch", 1, 0.25, "lookahead", "0")]


def run(tree: str, store: str, case: tuple) -> dict:
    _, batch, frac, prefetch, fused = case
    p = subprocess.run([sys.executable, "-c", RUN, store, str(batch), str(NEW_TOKENS), str(PROMPT), str(frac), prefetch],
                       cwd=tree, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": "1", "TIERED_MOE_FUSED_DECODE": fused})
    if p.returncode:
        raise SystemExit(f"{tree} {case}: {p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True)
    ap.add_argument("--new", default=os.path.dirname(HERE))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--title", default="Decode speed before / after a refactor")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "tiered-moe-refactor-speed"))
    ap.add_argument("--out", default=os.path.join(HERE, "results", "refactor_speed.md"))
    a = ap.parse_args()
    os.makedirs(a.workdir, exist_ok=True)
    store = build(a.workdir, a.new)
    res = {(t, c): [] for t in ("old", "new") for c in CASES}
    last = {}
    for r in range(a.rounds):
        for c in CASES:
            for t in (("old", "new") if r % 2 == 0 else ("new", "old")):
                x = run(getattr(a, t), store, c)
                res[(t, c)].append(x)
                last[(t, c)] = x
                print(f"round {r + 1} {c[0]} batch {c[1]:>2} {t}: {x['tokens_per_s']:.1f} tok/s, "
                      f"stall {x['decode_stall_s'] * 1e3:.1f} ms", flush=True)
    lines = [f"# {a.title}", "",
             f"Command: `python bench/refactor_speed.py --old {a.old} --new {a.new} --rounds {a.rounds}`", "",
             "Synthetic Mixtral-format store (hidden 512, 8 layers, 32 experts top-4, float32), greedy decode of "
             f"{NEW_TOKENS} tokens after {PROMPT}-token prompts, 1 torch thread, each run a fresh process, trees "
             "alternated, round after round; each run's best of 2 timed repetitions (after a warm-up), best and "
             "median over the rounds. Tiered rows: 25% of the experts on the (stand-in) device tier, LRU, lookahead "
             "prefetch with the `always` rule; stall = seconds decode steps waited for experts (median of rounds).", "",
             "| case | batch | old tok/s (runs) | new tok/s (runs) | new / old (best) | new / old (median) "
             "| stall old / new ms | tokens, hits, bytes identical |",
             "|---|---|---|---|---|---|---|---|"]
    for c in CASES:
        o, n = res[("old", c)], res[("new", c)]
        ot, nt = [x["tokens_per_s"] for x in o], [x["tokens_per_s"] for x in n]
        so, sn = (statistics.median(x["decode_stall_s"] for x in v) * 1e3 for v in (o, n))
        lo, ln = last[("old", c)], last[("new", c)]
        same = [lo[k] == ln[k] for k in ("outputs", "hits", "bytes")]
        lines.append(f"| {c[0]} | {c[1]} | {max(ot):.1f} ({', '.join(f'{x:.1f}' for x in ot)}) | {max(nt):.1f} "
                     f"({', '.join(f'{x:.1f}' for x in nt)}) | {max(nt) / max(ot):.3f} | "
                     f"{statistics.median(nt) / statistics.median(ot):.3f} | {so:.1f} / {sn:.1f} | "
                     f"{', '.join('yes' if x else 'NO' for x in same)} |")
    lines += ["", "Goal: new / old >= 0.97 on the resident rows; tokens identical everywhere."]
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
