"""Decode tokens/s side by side, same checkpoint, batch 1 and 16 (issue 3 benchmark).

(a) every expert resident                 - our engine, device tier holds all experts
(b) 25% of experts on the device tier     - LRU + lookahead (gate) prefetch
(c) on demand, no cache                   - policy none: every step loads what it needs
(d) transformers' own generate            - MixtralForCausalLM on the same checkpoint (grouped_mm experts, its default)
(e) the same with experts_implementation="eager" - its per-expert loop, like ours
Greedy, 8-token prompts, 32 new tokens per sequence, timed after one warm-up run each. On a
machine without CUDA the device tier is CPU memory (a load is a memcpy), which the output says.
Goals: (b)/(a) >= 0.8; ours >= transformers at both batch sizes.

Usage: python bench/decode_speed.py [--workdir DIR] [--out bench/results/decode_speed.md]
"""
import argparse
import os
import platform
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from runtime.engine import Engine, SamplingParams  # noqa: E402
from runtime.model import load_model  # noqa: E402
from runtime.model.convert import convert  # noqa: E402
from runtime.model.synthetic import SyntheticModelSpec, build_checkpoint  # noqa: E402
from runtime.store import Manifest  # noqa: E402

NEW, PROMPT = 32, 8


def prompts(batch, vocab, seed=None):
    g = torch.Generator().manual_seed(batch if seed is None else seed)
    return torch.randint(0, vocab, (batch, PROMPT), generator=g)


def ours(store, batch, *, frac, policy, prefetch):
    """One store, three runs on it: a warm-up on other prompts (cold loads from disk are not
    decode), then two timed runs on two prompt sets - the first is the one compared with
    transformers; neither replays the prompts that warmed the cache."""
    m = Manifest.read(store)
    slots = max(2, int(frac * m.num_layers * m.num_experts))
    best = None
    outs = None
    model, st = load_model(store, expert_budget=slots * m.blob_stride, policy=policy)
    try:
        for rep, seed in enumerate((1000 + batch, batch, 2000 + batch)):
            eng = Engine(model, st, max_batch=batch, prefill_chunk=PROMPT, prefetch=prefetch)
            ids = [eng.add_request(p, SamplingParams(max_tokens=NEW, ignore_eos=True))
                   for p in prompts(batch, model.cfg.vocab_size, seed).tolist()]
            t0 = time.perf_counter()
            eng.run()
            dt = time.perf_counter() - t0
            if rep == 1:
                outs = [eng.done[i].output for i in ids]
                s = eng.summary()
            if rep:
                best = dt if best is None else min(best, dt)
    finally:
        st.close()
    return batch * NEW / best, s["hit_rate_device"], outs


def reference(hf_dir, batch, reps=3, experts=None):
    from transformers import AutoModelForCausalLM
    kw = {"experts_implementation": experts} if experts else {}
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, **kw).eval()
    x = prompts(batch, model.config.vocab_size)
    best = None
    for _ in range(reps):
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW, min_new_tokens=NEW,
                                 do_sample=False, eos_token_id=None, pad_token_id=None)
            dt = time.perf_counter() - t0
        best = dt if best is None else min(best, dt)
    return batch * NEW / best, out[:, PROMPT:].tolist()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "tiered-moe-bench-decode"))
    ap.add_argument("--out", default=os.path.join(HERE, "results", "decode_speed.md"))
    a = ap.parse_args()
    hf, store = os.path.join(a.workdir, "hf"), os.path.join(a.workdir, "store")
    spec = SyntheticModelSpec()
    if not Manifest.current(store):
        build_checkpoint(hf, spec)
        convert(hf, store)
    rows = []
    default_threads = torch.get_num_threads()
    for threads in sorted({default_threads, 1}, reverse=True):
        torch.set_num_threads(threads)
        for batch in (1, 16):
            ra, hit_a, out_a = ours(store, batch, frac=1.0, policy="lru", prefetch="none")
            rb, hit_b, out_b = ours(store, batch, frac=0.25, policy="lru", prefetch="lookahead")
            rc, hit_c, out_c = ours(store, batch, frac=0.25, policy="none", prefetch="none")
            rd, out_d = reference(hf, batch)
            re_, out_e = reference(hf, batch, experts="eager")
            same = out_a == out_b == out_c == out_d == out_e
            rows.append((threads, batch, ra, rb, rc, rd, re_, hit_b, same))
            print(f"threads {threads} batch {batch:>2}: (a) {ra:7.1f}  (b) {rb:7.1f}  (c) {rc:7.1f}  (d) transformers {rd:7.1f} "
                  f"(e) transformers eager experts {re_:7.1f} tok/s; "
                  f"(b)/(a) {rb / ra:.2f}, (a)/(d) {ra / rd:.2f}, (b)/(d) {rb / rd:.2f}; outputs identical: {same}", flush=True)
    dev = "CUDA" if torch.cuda.is_available() else "CPU memory standing in for HBM (a load is a memcpy)"
    with open(a.out, "w") as f:
        f.write("# Decode speed: resident vs tiered vs on-demand vs transformers\n\n")
        f.write("Command: `python bench/decode_speed.py`\n\n")
        f.write(f"Machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}; device tier: {dev}. "
                f"Checkpoint: the demo's synthetic Mixtral-format model ({spec.num_layers} layers x {spec.num_experts} "
                f"experts, top-{spec.top_k}, hidden {spec.hidden_size}, fp32). Greedy, {PROMPT}-token prompts, {NEW} new "
                f"tokens per sequence; transformers: best of 3 runs (the first warms up); ours: three runs on one "
                f"store, a warm-up on other prompts, then the best of two timed runs on two further prompt sets (so (a) "
                f"times decode with every expert loaded, and (b) does not replay the prompts that warmed its cache); tokens/s = generated tokens / wall time including "
                f"prefill. Each row runs ours and transformers with the same torch intra-op thread count "
                f"(`--threads` in our CLI).\n\n")
        f.write("| threads | batch | (a) resident | (b) 25% LRU+lookahead | (c) on demand | (d) transformers | (e) transformers, eager experts | (b)/(a) | (a)/(d) | (b)/(d) | (a)/(e) | (b) device hit rate | same tokens |\n")
        f.write("|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
        for t, b, ra, rb, rc, rd, re_, hit, same in rows:
            f.write(f"| {t} | {b} | {ra:.1f} | {rb:.1f} | {rc:.1f} | {rd:.1f} | {re_:.1f} | {rb / ra:.2f} | {ra / rd:.2f} | "
                    f"{rb / rd:.2f} | {ra / re_:.2f} | {hit:.3f} | {same} |\n")
        f.write("\nBest setting of each side per batch size (ours = (a), transformers = best of (d), (e)):\n\n")
        for b in (1, 16):
            ours_best = max((r for r in rows if r[1] == b), key=lambda r: r[2])
            hf_best = max([(r[5], r[0], "(d)") for r in rows if r[1] == b] + [(r[6], r[0], "(e)") for r in rows if r[1] == b])
            f.write(f"- batch {b}: ours {ours_best[2]:.1f} tok/s ({ours_best[0]} thread(s)), transformers {hf_best[0]:.1f} "
                    f"tok/s ({hf_best[2]}, {hf_best[1]} thread(s)): ratio {ours_best[2] / hf_best[0]:.2f}\n")
        f.write("\nGoals: (b)/(a) >= 0.8; ours >= transformers at both batch sizes.\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
