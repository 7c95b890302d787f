"""Live stall of the lookahead prefetch issued when a layer routes vs after its experts are combined (issue 28).

Issue 28 moved the engine's lookahead prefetch for MoE layer m+1 from after layer m's experts were combined to
the moment layer m routes (the ``routed`` step hook, runtime/model/layers/context.py), so the next layer's loads
overlap this layer's expert compute. On a CPU "device" stand-in the loads are memcpy threads on the cores the
experts compute on, so there is little to overlap (bench/results/refactor_speed.md). Here the slow tier is the
disk: on a machine without a GPU, ``--host-budget`` below the model keeps a share of the experts in host memory,
the rest are read from the store with O_DIRECT on a reader thread - real I/O that overlaps compute.

A synthetic Mixtral-format checkpoint (hidden 1024, 8 layers x 32 experts top-8, moe intermediate 768, bf16) is
converted to int4 experts; each run is a fresh process that decodes greedily at the CLI defaults (fused host
kernels, 8-bit activations) with a host budget of ``--fraction`` of the experts, LRU, lookahead prefetch with the
``always`` rule, and one of three issue points:

- ``routing``: as shipped - the hook fires right after layer m routes, before its experts compute, and a
  prefetch's read waits while demand reads are pending (runtime/store/mover.py ``DemandFirst``);
- ``routing-unordered``: issued at routing, but every read starts at once (``DemandFirst`` off in this bench's
  child): the prefetches split the disk with layer m's own misses;
- ``after``: the order before issue 28, rebuilt in this bench's child only - the hook's calls are held and
  delivered when layer m's forward returns (after its experts are combined), with the same arguments, reads
  unordered as they were then;
- ``none``: no prefetch (every miss read on demand).

The three alternate, round after round, so drift of this shared VM falls on all. Reported per case: decode
stall seconds (the steps' time waiting for experts; median of rounds), decode tok/s (median), MB read from
disk per token and prefetch precision, and whether the tokens are identical (they must be: a prefetch moves
bytes, never changes a result).

Usage: python bench/prefetch_issue_point.py [--workdir DIR] [--rounds 3] [--fraction 0.25,0.5] [--batch 1,4]
       [--tokens 48] [--out bench/results/prefetch_issue_point_live.md]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from exp_common import write_markdown  # noqa: E402

SHAPE = dict(hidden_size=1024, intermediate_size=768, num_layers=8, num_experts=32, top_k=8, vocab_size=512,
             num_heads=16, num_kv_heads=4)
ORDERS = ("routing", "routing-unordered", "after", "none")

# One run in a fresh child: argv = store, host budget bytes, order, batch, new tokens, prompt length.
RUN = r"""
import dataclasses, json, sys, torch
torch.set_num_threads(1)
from runtime.engine import Engine, SamplingParams
from runtime.engine.engine import Engine as _E
from runtime.model import load_model
store, budget, order, batch, new, plen = sys.argv[1], int(sys.argv[2]), sys.argv[3], *map(int, sys.argv[4:7])
model, st = load_model(store, host_budget=budget, policy="lru", max_batch=batch, host_act_quant="q8")
if order in ("after", "routing-unordered"):      # every read starts at once (before DemandFirst)
    st.mover.order.wait_turn = lambda key: True
if order == "after":
    # The pre-issue-28 order: each routed(m, used, x) call is held and delivered once layer m's forward (its
    # attention, routing, experts and combine) has returned - the same calls, later.
    held, real = [], [None]
    make = _E._hooks
    def hooks(self, record=True):
        h = make(self, record)
        real[0] = h.routed
        return h if h.routed is None else dataclasses.replace(h, routed=lambda *a: held.append(a))
    _E._hooks = hooks
    def wrap(f):
        def forward(x, ctx):
            y = f(x, ctx)
            while held:
                real[0](*held.pop(0))
            return y
        return forward
    for layer in model.layers:
        layer.forward = wrap(layer.forward)
eng = Engine(model, st, max_batch=batch, prefill_chunk=plen, prefetch="none" if order == "none" else "lookahead",
             prefetch_rule="always" if order != "none" else "cost")
prompts = torch.randint(0, 512, (batch, plen), generator=torch.Generator().manual_seed(batch)).tolist()
ids = [eng.add_request(p, SamplingParams(max_tokens=new, ignore_eos=True)) for p in prompts]
eng.run()
dec = [s for s in eng.steps if s.tokens == s.batch]           # decode steps
sm = eng.summary()
toks = sum(s.batch for s in dec)
print(json.dumps({"tok_s": toks / sum(s.seconds for s in dec), "stall_s": sum(s.stall_seconds for s in dec),
                  "steps": len(dec), "tokens": toks, "disk_bytes": sum(s.bytes.get("disk_to_host", 0) for s in dec),
                  "hits": sm["hits"], "precision": sm["prefetch"]["precision"],
                  "outputs": [eng.done[i].output for i in ids]}))
st.close()
"""


def build(workdir: str) -> str:
    """The int4 store of the synthetic checkpoint (cached in workdir)."""
    hf, store = os.path.join(workdir, "hf"), os.path.join(workdir, "store")
    if not os.path.exists(os.path.join(store, "manifest.json")):
        code = ("import sys, torch; from runtime.model.synthetic import SyntheticModelSpec, build_checkpoint; "
                f"build_checkpoint(sys.argv[1], SyntheticModelSpec(**{SHAPE!r}), dtype=torch.bfloat16, "
                "shard_by_layer=True)")
        subprocess.run([sys.executable, "-c", code, hf], cwd=ROOT, check=True)
        subprocess.run([sys.executable, "-m", "runtime.cli", "convert", "--model", hf, "--out", store,
                        "--quantize", "int4"], cwd=ROOT, check=True)
    return store


def run(store: str, budget: int, order: str, batch: int, tokens: int, plen: int) -> dict:
    p = subprocess.run([sys.executable, "-c", RUN, store, str(budget), order, str(batch), str(tokens), str(plen)],
                       cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"})
    if p.returncode:
        raise SystemExit(f"{order} batch {batch}: {p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "tiered-moe-issue-point"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--fraction", default="0.25,0.5", help="shares of the experts the host budget holds")
    ap.add_argument("--batch", default="1,4")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--prompt", type=int, default=8)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "prefetch_issue_point_live.md"))
    a = ap.parse_args()
    os.makedirs(a.workdir, exist_ok=True)
    store = build(a.workdir)
    sys.path.insert(0, ROOT)
    from runtime.store import Manifest
    m = Manifest.read(store)
    budget = {f: int(f * m.num_layers * m.num_experts) * m.blob_stride for f in map(float, a.fraction.split(","))}
    cases = [(f, int(b)) for f in budget for b in a.batch.split(",")]
    res = {(c, o): [] for c in cases for o in ORDERS}
    for r in range(a.rounds):
        for c in cases:
            for o in ORDERS:
                x = run(store, budget[c[0]], o, c[1], a.tokens, a.prompt)
                res[c, o].append(x)
                print(f"round {r + 1} host {c[0]:.0%} batch {c[1]} {o:8s}: stall {x['stall_s'] * 1e3:7.1f} ms  {x['tok_s']:6.1f} tok/s  "
                      f"disk {x['disk_bytes'] / x['tokens'] / 1e6:5.2f} MB/tok  precision {x['precision'] or 0:.2f}",
                      flush=True)
    med = lambda v: statistics.median(v)  # noqa: E731
    rows = []
    for c in cases:
        ref = res[c, "routing"][0]["outputs"]
        for o in ORDERS:
            v = res[c, o]
            same = all(x["outputs"] == ref for x in v)
            each = ", ".join(f"{x['stall_s'] * 1e3:.0f}" for x in v)
            rows.append(f"| {c[0]:.0%} | {c[1]} | {o} | {med([x['stall_s'] for x in v]) * 1e3:.1f} "
                        f"({each}) | {med([x['tok_s'] for x in v]):.1f} "
                        f"| {med([x['disk_bytes'] / x['tokens'] for x in v]) / 1e6:.2f} "
                        f"| {med([x['precision'] or 0 for x in v]):.2f} | {'yes' if same else 'NO'} |")
        r_, u_, a_ = (med([x["stall_s"] for x in res[c, o]]) for o in ("routing", "routing-unordered", "after"))
        rows.append(f"| {c[0]:.0%} | {c[1]} | **routing / after** | **{r_ / a_:.2f}x** (unordered {u_ / a_:.2f}x) "
                    "| | | | |")
    cmd = "python bench/prefetch_issue_point.py " + " ".join(sys.argv[1:])
    lines = ["# Lookahead prefetch issued at routing vs after the combine: live stall, disk tier (issue 28)", "",
             f"`{cmd}`", "", __doc__.split("\n\n")[1].replace("\n", " "), "",
             f"Model: {SHAPE}, int4 experts ({m.blob_stride / 1e6:.2f} MB each), host budgets "
             f"{', '.join(f'{v / 2**20:.0f} MiB ({f:.0%} of the experts)' for f, v in budget.items())}, {a.tokens} new tokens per sequence after "
             f"{a.prompt}-token prompts, 1 thread, {a.rounds} rounds interleaved.", "",
             "| host tier | batch | issue point | decode stall ms (each round) | tok/s | disk MB/tok | prefetch precision "
             "| tokens same as routing |", "|---|---|---|---|---|---|---|---|", *rows]
    write_markdown(a.out, lines)


if __name__ == "__main__":
    main()
