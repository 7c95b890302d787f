"""Decode speed of two source trees on the same store (issue 17: the layer / scheduler refactor must
not slow decoding down). Goal: new / old >= 0.97 at batch 1 and 16, best of 3, interleaved.

A synthetic Mixtral-format checkpoint of realistic shape (hidden 512, 8 layers, 32 experts top-4,
float32, every expert resident) is built and converted once; each (tree, batch) run is a fresh process
that imports tiered-moe from that tree alone, loads the store, warms up once and times greedy decode
of 32 new tokens per sequence (8-token prompts). The trees alternate, round after round, so drift of
a shared machine falls on both.

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
store, batch, new, plen = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
model, st = load_model(store)
g = torch.Generator().manual_seed(batch)
best, outs = None, None
for rep in range(3):                      # rep 0 warms up
    eng = Engine(model, st, max_batch=batch, prefill_chunk=plen)
    ids = [eng.add_request(p, SamplingParams(max_tokens=new, ignore_eos=True))
           for p in torch.randint(0, model.cfg.vocab_size, (batch, plen), generator=g).tolist()]
    eng.run()
    dec = [s for s in eng.steps if s.tokens == s.batch]          # decode steps only
    tps = sum(s.batch for s in dec) / sum(s.seconds for s in dec)
    if rep:
        best = tps if best is None else max(best, tps)
    outs = [eng.done[i].output for i in ids]
st.close()
print(json.dumps({"tokens_per_s": best, "first_output": outs[0]}))
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


def run(tree: str, store: str, batch: int) -> dict:
    p = subprocess.run([sys.executable, "-c", RUN, store, str(batch), str(NEW_TOKENS), str(PROMPT)], cwd=tree,
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": "1"})
    if p.returncode:
        raise SystemExit(f"{tree} batch {batch}: {p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True)
    ap.add_argument("--new", default=os.path.dirname(HERE))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "tiered-moe-refactor-speed"))
    ap.add_argument("--out", default=os.path.join(HERE, "results", "refactor_speed.md"))
    a = ap.parse_args()
    os.makedirs(a.workdir, exist_ok=True)
    store = build(a.workdir, a.new)
    res = {(t, b): [] for t in ("old", "new") for b in (1, 16)}
    outs = {}
    for r in range(a.rounds):
        for b in (1, 16):
            for t in (("old", "new") if r % 2 == 0 else ("new", "old")):
                x = run(getattr(a, t), store, b)
                res[(t, b)].append(x["tokens_per_s"])
                outs[(t, b)] = x["first_output"]
                print(f"round {r + 1} batch {b:>2} {t}: {x['tokens_per_s']:.1f} tok/s", flush=True)
    lines = ["# Decode speed before / after the issue 17 refactor", "",
             f"Command: `python bench/refactor_speed.py --old {a.old} --new {a.new} --rounds {a.rounds}`", "",
             "Synthetic Mixtral-format store (hidden 512, 8 layers, 32 experts top-4, float32, all resident), "
             "greedy decode of 32 tokens after 8-token prompts, 1 torch thread, each run a fresh process, trees "
             "alternated; best and median of the rounds.", "",
             "| batch | old tok/s (runs) | new tok/s (runs) | new / old (best) | new / old (median) | tokens identical |",
             "|---|---|---|---|---|---|"]
    for b in (1, 16):
        o, n = res[("old", b)], res[("new", b)]
        lines.append(f"| {b} | {max(o):.1f} ({', '.join(f'{x:.1f}' for x in o)}) | {max(n):.1f} "
                     f"({', '.join(f'{x:.1f}' for x in n)}) | {max(n) / max(o):.3f} | "
                     f"{statistics.median(n) / statistics.median(o):.3f} | "
                     f"{'yes' if outs[('old', b)] == outs[('new', b)] else 'NO'} |")
    lines += ["", "Goal: new / old >= 0.97 at both batch sizes."]
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
