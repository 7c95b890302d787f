"""Prefill speed on the host at the settings issue 30 changed, side by side in one run: the prefill chunk (64, the
old default, against 512, llama.cpp's ubatch and ours now) and the activations of prefill-size products (exact
float32, ``--host-act-quant none``, against the default q8: 8-bit for 4-bit weights, bf16 for bf16 weights).

Each (store, threads) runs in a fresh process: the store loaded with every expert resident (bench/vs_llama_cpp.py's
loader) once per activation setting, then one ``--prompt``-token prompt at batch 1 per configuration, interleaved
over --reps after a warm-up, prompt tokens / the time to the first token, the best kept. Prefix caching on (the
default), a new random prompt each run (no cache hits).

Usage: python bench/prefill_chunk.py --stores DIR[,DIR...] [--threads 1,2] [--prompt 512] [--reps 3]
       [--out bench/results/prefill_chunk.md]
  (stores: e.g. bench/vs_llama_cpp.py's --workdir: mid-store-bf16, qnext-store-int4, ...)
"""
import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# (label, prefill chunk, --host-act-quant): the old default, the new chunk with exact activations, the new default
CONFIGS = (("chunk 64, q8 (before)", 64, "q8"), ("chunk 512, exact", 512, "none"), ("chunk 512, q8 (default)", 512, "q8"))


def worker(store: str, threads: int, prompt: int, reps: int) -> dict:
    sys.path.insert(0, ROOT)
    sys.path.insert(0, HERE)
    import torch
    import vs_llama_cpp
    from runtime.engine import Engine, SamplingParams
    loaded = {act: vs_llama_cpp._resident(store, threads, act, "none") for act in {c[2] for c in CONFIGS}}
    vocab = next(iter(loaded.values()))[0].cfg.vocab_size
    best = {label: 0.0 for label, _, _ in CONFIGS}
    try:
        for rep in range(reps + 1):
            for label, chunk, act in CONFIGS:
                model, st = loaded[act]
                eng = Engine(model, st, max_batch=1, prefill_chunk=chunk, prefetch="none")
                g = torch.Generator().manual_seed(1000 * rep + chunk + len(act))
                eng.add_request(torch.randint(0, vocab, (prompt,), generator=g).tolist(),
                                SamplingParams(max_tokens=1, ignore_eos=True))
                t0 = time.perf_counter()
                while eng.has_work():
                    eng.step()
                if rep:                                     # rep 0: the warm-up
                    best[label] = max(best[label], prompt / (time.perf_counter() - t0))
    finally:
        for _, st in loaded.values():
            st.close()
    return best


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        print("RESULT " + json.dumps(worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stores", required=True)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "prefill_chunk.md"))
    a = ap.parse_args()
    sys.path.insert(0, ROOT)
    from runtime import kernels
    rows = []
    stores = a.stores.split(",")
    threads = [int(t) for t in a.threads.split(",")]
    total, done = len(stores) * len(threads), 0
    for store in stores:
        for t in threads:
            env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": str(t)}
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", store, str(t), str(a.prompt),
                                  str(a.reps)], env=env, capture_output=True, text=True, check=True).stdout
            r = json.loads([x for x in out.splitlines() if x.startswith("RESULT ")][-1][7:])
            rows.append((os.path.basename(store.rstrip("/")), t, r))
            done += 1
            print(f"[{done}/{total}] {rows[-1][0]} threads {t}: "
                  + ", ".join(f"{k} {v:.0f}" for k, v in r.items()), file=sys.stderr, flush=True)
    cmd = "python bench/prefill_chunk.py " + " ".join(sys.argv[1:])
    load = os.getloadavg()[0]
    L = ["# Prefill on the host: the prefill chunk and the activations of prefill-size products\n\n",
         f"Command: `{cmd}` ({os.cpu_count()} cores, the {kernels.isa()} build; 1-minute load average at the end "
         f"{load:.1f}). One {a.prompt}-token prompt, batch 1, every expert resident, prompt tokens / the time to the "
         f"first token, best of {a.reps} interleaved runs after a warm-up. Exact: --host-act-quant none (float32 "
         "activations; bf16 weights widened to float32). q8: the CLI's default (8-bit activations for 4-bit weights, "
         "bf16 rows for bf16 weights past the GEMV).\n\n",
         "| store | threads | " + " | ".join(c[0] for c in CONFIGS) + " | default now / before |\n",
         "|---|---|" + "---|" * len(CONFIGS) + "---|\n"]
    for name, t, r in rows:
        vals = [r[c[0]] for c in CONFIGS]
        L.append(f"| {name} | {t} | " + " | ".join(f"{v:.0f}" for v in vals) + f" | {vals[-1] / vals[0]:.2f} |\n")
    with open(a.out, "w") as f:
        f.write("".join(L))
    print("".join(L))


if __name__ == "__main__":
    main()
