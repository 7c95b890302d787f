"""Where a batch-1 decode token's time goes on the host (issue 30): our kernels against the Python between them,
with the one-call step (layers/fused_step.py, the default) and one layer at a time (TIERED_MOE_FUSED_STEP=0), side
by side in one run.

Each configuration runs in a fresh process: the store loaded with every expert resident (bench/vs_llama_cpp.py's
loader), 8-token prompt, a warm-up, then ``--tokens`` decode tokens timed; every host-kernel entry point is wrapped
to add up its wall time (a wrapper costs well under a microsecond a call). Reported per token: wall time, time inside
kernels, the rest (Python: the store's requests, the engine's step, the glue), and decode tok/s. Interleaved over
--reps, the best kept per configuration.

Usage: python bench/decode_breakdown.py --stores DIR[,DIR...] [--dense-quant int4] [--act-quant q8] [--tokens 128]
       [--reps 3] [--out bench/results/decode_breakdown.md]
  (stores: e.g. bench/vs_llama_cpp.py's --workdir: mid-store-int4, qnext-store-int4, ...)
"""
import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
ENTRIES = ("tm_decode_layers", "tm_moe", "tm_attn_block", "tm_mla_block", "tm_gdn_block", "tm_mlp_block",
           "tm_linear_q", "tm_linear_bf16")


def worker(store: str, act_quant: str, dense_quant: str, tokens: int) -> dict:
    sys.path.insert(0, ROOT)
    sys.path.insert(0, HERE)
    from runtime import kernels
    lib, spent = kernels.lib(), [0]
    for name in ENTRIES:
        f = getattr(lib, name)

        def timed(*a, _f=f):
            t = time.perf_counter_ns()
            try:
                return _f(*a)
            finally:
                spent[0] += time.perf_counter_ns() - t
        setattr(lib, name, timed)
    import vs_llama_cpp
    from runtime.engine import Engine, SamplingParams
    model, st = vs_llama_cpp._resident(store, 1, act_quant, dense_quant)
    try:
        def run(n: int) -> tuple:
            eng = Engine(model, st, max_batch=1, prefill_chunk=8, prefetch="none")
            eng.add_request([(61 * i + 7) % model.cfg.vocab_size for i in range(1, 9)],
                            SamplingParams(max_tokens=n, ignore_eos=True))
            eng.step()                                      # the prompt
            spent[0] = 0
            t, k = time.perf_counter(), 0
            while eng.has_work():
                k += sum(1 for o in eng.step() if o.token is not None)
            return k, time.perf_counter() - t, spent[0] / 1e9
        run(8)
        k, wall, kern = run(tokens)
    finally:
        st.close()
    return {"tok_s": k / wall, "us_token": wall / k * 1e6, "kernel_us": kern / k * 1e6, "rest_us": (wall - kern) / k * 1e6}


def measure(store: str, step: bool, a) -> dict:
    env = {**os.environ, "TIERED_MOE_FUSED_STEP": "1" if step else "0"}
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", store, "--act-quant", a.act_quant,
           "--dense-quant", a.dense_quant, "--tokens", str(a.tokens)]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    if p.returncode:
        raise RuntimeError(f"worker failed on {store}:\n{p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stores", default="")
    ap.add_argument("--act-quant", default="q8")
    ap.add_argument("--dense-quant", default="int4")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "decode_breakdown.md"))
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker(a.worker, a.act_quant, a.dense_quant, a.tokens)))
        return
    stores = [s for s in a.stores.split(",") if s]
    if not stores:
        ap.error("--stores: at least one converted store")
    best: dict = {}
    for rep in range(a.reps):
        for store in stores:
            for step in ((True, False) if rep % 2 == 0 else (False, True)):    # alternate which goes first
                r = measure(store, step, a)
                print(f"rep {rep} {os.path.basename(store)} step={step}: {r['tok_s']:.1f} tok/s", flush=True)
                key = (store, step)
                if key not in best or r["tok_s"] > best[key]["tok_s"]:
                    best[key] = r
    from runtime import kernels
    cmd = "python bench/decode_breakdown.py" + "".join(" " + x for x in sys.argv[1:])
    lines = ["# A batch-1 decode token on the host: kernels against the Python between them\n\n",
             f"Command: `{cmd}` ({os.cpu_count()} cores, the {kernels.isa()} build). Every expert resident, "
             f"--host-act-quant {a.act_quant}, --dense-quant {a.dense_quant}, 1 thread, {a.tokens} decode tokens "
             f"after an 8-token prompt, best of {a.reps} interleaved reps. One call: the step's fused layers in one "
             "tm_decode_layers call (the default); per layer: TIERED_MOE_FUSED_STEP=0.\n\n",
             "| store | step | tok/s | us / token | in kernels | rest (Python) | one call / per layer |\n",
             "|---|---|---|---|---|---|---|\n"]
    for store in stores:
        on, off = best[(store, True)], best[(store, False)]
        for name, r in (("one call", on), ("per layer", off)):
            ratio = f"{on['tok_s'] / off['tok_s']:.2f}x" if r is on else ""
            lines.append(f"| {os.path.basename(store)} | {name} | {r['tok_s']:.1f} | {r['us_token']:.0f} | "
                         f"{r['kernel_us']:.0f} | {r['rest_us']:.0f} | {ratio} |\n")
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        f.writelines(lines)
    print("".join(lines))


if __name__ == "__main__":
    main()
