"""Decode and prefill tokens/s of tiered-moe against llama.cpp, same checkpoint, same CPU, one run.

Measures decode speed (tokens/s after the prompt) of both runtimes on checkpoints built here with transformers
(seed 0, non-norm parameters x4 - decay parameters kept -, saved in bf16) in five shapes - Qwen3-MoE `mid`
(bench/decode_speed.py's MID) and `wide` (WIDE below: K3-like expert width, routed experts ~93% of the
weights), `wide128` (issue 30's wide shape: hidden 2048, 8 layers x 128 experts top-8, written layer by layer
by runtime/model/synthetic.py), `mla` (DeepSeek-V3-like), `gptoss` (sinks, sliding windows) and `qnext`
(Qwen3-Next-like: Gated DeltaNet + gated attention; the last two are bench/layer_backends.py's) - in paired weight
formats: BF16 GGUF vs our bf16 store, Q4_0 vs our int4 store, MXFP4_MOE vs our mxfp4 store, and the same bytes
on both sides (`int4-x`, `mxfp4-x`: llama.cpp's file with only the routed experts quantized, every other weight
bf16 as our 4-bit stores hold them at the defaults; stock Q4_0 quantizes attention, shared experts and the head
too); each at batch 1 and 8, 1 and 2 threads. And prefill (--prefill N, default 512): one N-token prompt, `llama-bench -p N -n 0` against our
engine at its defaults (time to the first token), 1 and 2 threads. The llama.cpp side (tree, GGUFs, runs) and
the checkpoints are in bench/llama_cpp_side.py.

How:
- llama.cpp: vendor/llama.cpp of the llama-cpp-python sdist, built CPU-only (cached: --llama-dir or
  ~/.cache/tiered-moe/llama.cpp). The checkpoint goes through its convert_hf_to_gguf.py (--outtype
  bf16), then llama-quantize to Q4_0 and MXFP4_MOE. The converter needs a HF tokenizer: a byte-level
  BPE of exactly vocab_size tokens is trained with `tokenizers` on a seeded synthetic corpus and saved
  as tokenizer.json + tokenizer_config.json (Qwen2Tokenizer). Its pre-tokenizer hash is not in the
  converter's table, so the converter runs through a shim that names it "qwen2" (tokenization is not
  timed: both sides decode token ids). Batch 1: `llama-bench -p 0 -n 32 -r 1 -o json` (avg_ts, decode
  only); batch 8: `llama-batched-bench -npp 8 -ntg 32 -npl 8 --output-format jsonl` (speed_tg).
- ours: each configuration in a fresh process with torch.set_num_threads(T), every expert resident
  (loaded into the device tier before timing, LRU, no prefetch), 8-token prompts (prefill_chunk 8), 32
  new tokens; the engine is stepped by hand: decode tokens/s = tokens produced after the step where
  every request had its first token / the time since that step (prefill timed apart). A warm-up run,
  then the best of two, at the CLI's defaults (DEFAULTS: 8-bit activations, as llama.cpp computes Q4_0 and
  MXFP4; --dense-quant auto: the dense weights as the store records). Each store holds what its GGUF holds:
  the stores paired with stock Q4_0 / MXFP4_MOE are converted with `--dense-quant int4` / `int8` (STORE_DENSE:
  llama-quantize makes their attention Q4_0 / Q8_0; our head int8 where Q4_0's is Q6_K), the experts-only files'
  stores (`int4-x`, `mxfp4-x`) without (dense bf16, as the checkpoint).
- Interleaved: each rep runs every configuration, llama.cpp and ours alternating which goes first;
  the best of --reps kept per side.
- Memory bandwidth: STREAM-like copy (read + write bytes) and read-only sum of a 512 MB float32
  array, 1 and 2 threads, best of 5; routed expert bytes per token (layers x top_k x one expert)
  times batch-1 decode tokens/s against it, for both sides.

Needs no pip package beyond the project's venv (the converter's qwen3moe path uses gguf-py from the
llama.cpp tree, numpy, tqdm, pyyaml, torch, transformers, tokenizers); outside it: cmake, a C/C++
compiler, network for the sdist (once). Delete --workdir after changing a shape (cached by name).

Usage: python bench/vs_llama_cpp.py [--workdir DIR] [--llama-dir DIR] [--reps 3] [--shapes mid,wide,mla,gptoss,qnext]
       [--formats bf16,int4,mxfp4] [--prefill 512] [--no-decode] [--out bench/results/vs_llama_cpp.md]
"""
import argparse
import json
import os
import platform
import shlex
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
sys.path.insert(0, HERE)

import decode_speed  # noqa: E402  (bench/decode_speed.py: MID, prompts, NEW, PROMPT)
from llama_cpp_side import (CMAKE_FLAGS, EXPERTS_ONLY, FORMATS, SDIST, build_hf, gguf_dense_bytes, ggufs,  # noqa: E402
                            llama_prefill, llama_rate, llama_tree, log, sh)
import layer_backends  # noqa: E402  (bench/layer_backends.py: the gpt-oss- and Qwen3-Next-like shapes)
from cache_policy.keys import PREFILL_CHUNK  # noqa: E402
from runtime import kernels  # noqa: E402
from runtime.model.convert import convert  # noqa: E402
from runtime.store import Manifest  # noqa: E402

NEW, PROMPT = decode_speed.NEW, decode_speed.PROMPT
# K3-like expert width on the MID architecture: hidden 2048, experts 1024 wide (~1.7 GB in bf16).
WIDE = dict(decode_speed.MID, hidden_size=2048, intermediate_size=4096, num_hidden_layers=4, num_attention_heads=16,
            num_key_value_heads=4, head_dim=128, moe_intermediate_size=1024)
# Issue 30's wide shape: hidden 2048, 8 layers x 128 experts top-8, width 768 (bench/bigger_than_memory.py's
# "large", Qwen3-30B-A3B-sized layers; 10 GB in bf16, 2.6 GB int4): the model in RAM, far past the caches. Written
# by runtime/model/synthetic.py (Mixtral names) - "_synthetic": its SyntheticModelSpec; the other keys describe it.
WIDE128 = dict(_synthetic=dict(vocab_size=4096, hidden_size=2048, intermediate_size=768, num_layers=8, num_experts=128,
                               top_k=8, num_heads=16, num_kv_heads=4),
               vocab_size=4096, hidden_size=2048, intermediate_size=768, num_hidden_layers=8, num_local_experts=128,
               num_experts_per_tok=8, num_attention_heads=16, num_key_value_heads=4, head_dim=128)
# The shapes off the GQA path (issue 30), hidden 512, 8 layers, 32 experts top-4 as bench/layer_backends.py builds
# them: MLA (DeepSeek-V3 / Kimi-K2-like: q through a low-rank factor, sigmoid routing, a shared expert, the first
# layer dense; llama.cpp takes a model without q LoRA only at DeepSeek-V2-Lite's 26-27 layers). "_arch": the
# transformers class prefix (Qwen3Moe where absent).
MLA = dict(_arch="DeepseekV3", vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=8,
           num_attention_heads=8, num_key_value_heads=8, q_lora_rank=192, kv_lora_rank=128, qk_nope_head_dim=64,
           qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=32, num_experts_per_tok=4, moe_intermediate_size=512,
           n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, max_position_embeddings=4096)


def _layer_shape(name: str) -> dict:
    """bench/layer_backends.py's shape ``name`` (the same checkpoints its A/B decodes) as a SHAPES entry."""
    _, cls, kw = layer_backends.SHAPES[name]
    return dict(kw, _arch=cls, eos_token_id=None, bos_token_id=None, pad_token_id=None)


# gpt-oss-like (sinks, sliding 128 / full alternating, biases, clamped SwiGLU) and Qwen3-Next-like (Gated DeltaNet :
# gated attention 3:1, a gated shared expert), hidden 512, 8 layers, 32 experts top-4
SHAPES = {"mid": decode_speed.MID, "wide": WIDE, "wide128": WIDE128, "mla": MLA, "gptoss": _layer_shape("gptoss"),
          "qnext": _layer_shape("gdn")}


def n_experts(c: dict) -> int:
    return c.get("num_experts") or c.get("num_local_experts") or c["n_routed_experts"]


def expert_width(c: dict) -> int:
    """An expert's intermediate width (gpt-oss names it intermediate_size: its only MLPs are experts)."""
    return c.get("moe_intermediate_size") or c["intermediate_size"]


def moe_layers(c: dict) -> int:
    """Layers with routed experts (DeepSeek's first_k_dense_replace layers are dense)."""
    return c["num_hidden_layers"] - (c.get("first_k_dense_replace") or 0)


def attention_desc(c: dict) -> str:
    if c.get("_arch") == "Qwen3Next":
        return (f"Gated DeltaNet ({c['linear_num_key_heads']} key / {c['linear_num_value_heads']} value heads of "
                f"{c['linear_key_head_dim']}) : gated attention ({c['num_attention_heads']}/{c['num_key_value_heads']} "
                f"heads of {c['head_dim']}) 3:1, a gated shared expert")
    if c.get("_arch") == "GptOss":
        return (f"{c['num_attention_heads']}/{c['num_key_value_heads']} heads of {c['head_dim']} with sinks, sliding "
                f"window {c['sliding_window']} / full alternating, biases, clamped SwiGLU")
    if "kv_lora_rank" in c:
        return (f"MLA: {c['num_attention_heads']} heads, latent {c['kv_lora_rank']}, q/k {c['qk_nope_head_dim']} + "
                f"rotary {c['qk_rope_head_dim']}, v {c['v_head_dim']}, q LoRA {c.get('q_lora_rank') or 'none'}")
    return f"{c['num_attention_heads']}/{c['num_key_value_heads']} heads of {c['head_dim']}"
BATCHES, THREADS = (1, 8), (1, 2)
# The dense weights our store records at convert (--dense-quant), as the paired GGUF holds them: stock Q4_0 has
# Q4_0 attention (the head Q6_K; ours int8), MXFP4_MOE Q8_0 attention and head; the experts-only files keep them
# bf16, and so do their stores. (Before, these ran as a second "fast" setting with --dense-quant given by hand.)
STORE_DENSE = {"int4": "int4", "mxfp4": "int8"}


# Our side's run: what `tiered-moe generate` / `serve` use - 8-bit activations for 4-bit and 8-bit weights since
# issue 30, the dense weights as the store records (auto); --host-act-quant none is the exact path.
DEFAULTS = ("q8", "auto")


def ours_best(r: dict) -> float:
    """Our rate of a configuration (the defaults; results of older runs also had a hand-set "fast" one)."""
    return max(r["ours"], r.get("ours_fast", 0.0))


def stores(hf: str, work: str, shape: str, formats: list) -> dict:
    out = {}
    for f in formats:
        dq = STORE_DENSE.get(f)
        store = os.path.join(work, f"{shape}-store-{FORMATS[f][1] or 'bf16'}" + (f"-dense-{dq}" if dq else ""))
        if not Manifest.current(store):
            log(f"{shape}: tiered-moe convert {f}{f' --dense-quant {dq}' if dq else ''} -> {store}")
            convert(hf, store, quantize=FORMATS[f][1], dense_quant=dq)
        out[f] = store
    return out


# -- ours ------------------------------------------------------------------------------------------
def _resident(store: str, threads: int, act_quant: str, dense_quant: str, batch: int = 1) -> tuple:
    """(model, store) loaded with torch at ``threads`` and every expert in the device tier before timing
    (llama.cpp's are mapped)."""
    import inspect
    from runtime.model import load_model
    torch.set_num_threads(threads)
    m = Manifest.read(store)
    kw = {"max_batch": batch} if "max_batch" in inspect.signature(load_model).parameters else {}
    model, st = load_model(store, expert_budget=m.num_layers * m.num_experts * m.blob_stride, policy="lru",
                           host_act_quant=act_quant, dense_quant=dense_quant, **kw)
    for layer in range(m.num_layers):
        st.request(layer, list(range(m.num_experts)), 0).wait()
    return model, st


def ours_worker(store: str, batch: int, threads: int, act_quant: str = "none", dense_quant: str = "none") -> dict:
    """In a fresh process: every expert resident, a warm-up run, then the best decode rate of two."""
    from runtime.engine import Engine, SamplingParams
    model, st = _resident(store, threads, act_quant, dense_quant, batch)
    best = {"rate": 0.0}
    try:
        for rep, seed in enumerate((1000 + batch, batch, 2000 + batch)):
            eng = Engine(model, st, max_batch=batch, prefill_chunk=PROMPT, prefetch="none")
            for p in decode_speed.prompts(batch, model.cfg.vocab_size, seed).tolist():
                eng.add_request(p, SamplingParams(max_tokens=NEW, ignore_eos=True))
            started, n, t1 = set(), 0, None
            t0 = time.perf_counter()
            while eng.has_work():
                toks = [o for o in eng.step() if o.token is not None]
                if t1 is None:
                    started.update(o.request_id for o in toks)
                    if len(started) == batch:
                        t1 = time.perf_counter()
                else:
                    n += len(toks)
            rate = n / (time.perf_counter() - t1)
            if rep and rate > best["rate"]:
                best = {"rate": rate, "prefill_s": t1 - t0, "decode_tokens": n}
    finally:
        st.close()
    best["dense_bytes"] = dense_bytes(model)
    return best


def prefill_worker(store: str, threads: int, n: int) -> dict:
    """In a fresh process, at the CLI's defaults (the engine's prefill chunk, 8-bit activations): one n-token
    prompt at batch 1, every expert resident; prompt tokens/s = n / the time to the first token. A warm-up,
    then the best of two."""
    from runtime.engine import Engine, SamplingParams
    model, st = _resident(store, threads, *DEFAULTS)
    best = 0.0
    try:
        for rep in range(3):
            eng = Engine(model, st, max_batch=1, prefetch="none")
            g = torch.Generator().manual_seed(7 + rep)
            eng.add_request(torch.randint(0, model.cfg.vocab_size, (n,), generator=g).tolist(),
                            SamplingParams(max_tokens=1, ignore_eos=True))
            t0 = time.perf_counter()
            while eng.has_work():
                eng.step()
            if rep:
                best = max(best, n / (time.perf_counter() - t0))
    finally:
        st.close()
    return {"rate": best}


def run_prefill(bindir: str, items: list, reps: int, n: int) -> dict:
    """items as run_pairs; {(shape, fmt, threads): best prompt tokens/s per side and every run}, interleaved."""
    best = {}
    for rep in range(reps):
        for i, (shape, fmt, gguf, store) in enumerate(items):
            for t in THREADS:
                cur = best.setdefault((shape, fmt, t), {"llama": 0.0, "ours": 0.0, "llama_runs": [], "ours_runs": []})
                for side in (("llama", "ours") if (rep + i) % 2 == 0 else ("ours", "llama")):
                    if side == "llama":
                        r = llama_prefill(bindir, gguf, t, n)
                    else:
                        env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": str(t)}
                        out = sh([sys.executable, os.path.abspath(__file__), "--prefill-worker", store, str(t), str(n)],
                                 env=env)
                        r = json.loads([x for x in out.splitlines() if x.startswith("RESULT ")][-1][7:])["rate"]
                    cur[side] = max(cur[side], r)
                    cur[side + "_runs"].append(r)
                    log(f"rep {rep} {shape} {fmt} prefill pp{n} threads {t} {side}: {r:.1f} tok/s")
    return best


def prefill_section(pp: dict, n: int, shapes: list, formats: list) -> list:
    L = [f"\n## Prefill: one {n}-token prompt (pp{n})\n\n",
         f"llama.cpp `llama-bench -p {n} -n 0` (its default batch 2048 / ubatch 512); ours at the CLI's defaults "
         f"(prefill chunk {PREFILL_CHUNK}, 8-bit activations for 4-bit weights and bf16 ones for bf16 weights past the "
         f"GEMV's rows, prefix caching on), batch 1, every expert resident, prompt tokens / the time to the first "
         f"token.\n\n",
         "| shape | weights | threads | llama.cpp tok/s | tiered-moe tok/s | tiered-moe / llama.cpp |\n",
         "|---|---|---|---|---|---|\n"]
    for s in shapes:
        for f in formats:
            for t in THREADS:
                r = pp[(s, f, t)]
                L.append(f"| {s} | {FORMATS[f][0]} / {f} | {t} | {r['llama']:.1f} | {r['ours']:.1f} | "
                         f"{r['ours'] / r['llama']:.2f} |\n")
    return L + ["\n"]


def dense_bytes(model) -> int:
    """Bytes of the non-expert projections a decode token reads (every layer's attention, router, dense
    or shared MLP, and the head), as the model holds them (bf16, float32 or --dense-quant codes)."""
    from runtime.model.layers.dense import Linear
    from runtime.model.layers.mlp import DenseMLP
    seen = []
    for obj in [x for layer in model.layers for x in (layer.attn, layer.ffn)] + [model]:
        for v in vars(obj).values():
            if isinstance(v, DenseMLP):
                seen += [v.gate_up, v.down]
            elif isinstance(v, Linear):
                seen.append(v)
    n = sum(lin.nbytes for lin in seen)
    return n if model.head is not None else n + model.embed.nbytes      # tied: the head reads the embedding


def ours_rate(store: str, batch: int, threads: int, act_quant: str = "none", dense_quant: str = "none") -> float:
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": str(threads)}
    out = sh([sys.executable, os.path.abspath(__file__), "--worker", store, str(batch), str(threads), act_quant,
              dense_quant], env=env)
    line = [x for x in out.splitlines() if x.startswith("RESULT ")]
    r = json.loads(line[-1][len("RESULT "):])
    return r["rate"], r["dense_bytes"]


# -- bandwidth -------------------------------------------------------------------------------------
def bandwidth() -> dict:
    """GB/s of a 512 MB float32 array: copy (read + write bytes) and read-only sum, best of 5."""
    import numpy as np
    a = np.ones(512 * 2**20 // 4, np.float32)
    b = np.empty_like(a)
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)

    def best(fn):
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return min(ts)
    res = {"copy numpy 1 thr": 2 * a.nbytes / best(lambda: np.copyto(b, a)) / 1e9,
           "read numpy 1 thr": a.nbytes / best(lambda: np.add.reduce(a)) / 1e9}
    old = torch.get_num_threads()
    for t in THREADS:
        torch.set_num_threads(t)
        res[f"copy torch {t} thr"] = 2 * a.nbytes / best(lambda: tb.copy_(ta)) / 1e9
        res[f"read torch {t} thr"] = a.nbytes / best(lambda: ta.sum()) / 1e9
    torch.set_num_threads(old)
    return res


# -- the run and the report ------------------------------------------------------------------------
def run_pairs(bindir: str, items: list, reps: int) -> dict:
    """items: (shape, fmt, gguf, store). Interleaved reps: {(shape, fmt, b, t): best and every run per side}."""
    best, idx, build = {}, 0, None
    for rep in range(reps):
        for shape, fmt, gguf, store in items:
            for b in BATCHES:
                for t in THREADS:
                    key = (shape, fmt, b, t)
                    sides = ("ours",)
                    cur = best.setdefault(key, {"llama": 0.0, "llama_runs": [], **{x: 0.0 for x in sides},
                                                **{x + "_runs": [] for x in sides}})
                    order = ("llama",) + sides if (rep + idx) % 2 == 0 else sides + ("llama",)
                    for side in order:
                        if side == "llama":
                            r, bs = llama_rate(bindir, gguf, b, t)
                            build = bs or build
                        else:
                            r, cur[side + "_dense_bytes"] = ours_rate(store, b, t, *DEFAULTS)
                        cur[side] = max(cur[side], r)
                        cur[side + "_runs"].append(r)
                        log(f"rep {rep} {shape} {fmt} batch {b} threads {t} {side}: {r:.1f} tok/s")
                    idx += 1
    return {"best": best, "build": build}


def machine() -> str:
    info = {}
    for line in sh(["lscpu"]).splitlines():
        k, _, v = line.partition(":")
        info[k.strip()] = v.strip()
    caches = ", ".join(f"{k} {info[k]}" for k in ("L1d cache", "L2 cache", "L3 cache") if k in info)
    return (f"{info.get('Model name', platform.processor())}, {os.cpu_count()} cores ({platform.machine()}), "
            f"{caches}; torch {torch.__version__}")


def report_head(a, meta: dict, formats: list) -> list:
    return ["# Decode and prefill speed: tiered-moe vs llama.cpp, same checkpoint, same CPU\n\n",
         f"Command: `{meta['command']}`\n\n", f"Machine: {meta['machine']}. 1-minute load average at start / end "
         f"(other jobs may share the machine): {meta['load'][0]:.1f} / {meta['load'][1]:.1f}.\n\n",
         f"llama.cpp: vendor/llama.cpp of the llama-cpp-python {SDIST} sdist, build {meta['build']}, CPU only "
         f"(`{' '.join(CMAKE_FLAGS)}`).\n\n",
         f"Decode only: {PROMPT}-token prompts, {NEW} new tokens per sequence; llama.cpp batch 1 "
         f"`llama-bench -p 0 -n {NEW}`, batch 8 `llama-batched-bench -npp {PROMPT} -ntg {NEW} -npl 8` (S_TG); ours "
         f"every expert resident, tokens after every sequence's first token / the time since. Best of {a.reps} "
         f"interleaved reps per side (every run is in the .json). Pairs: "
         + "; ".join(f"{FORMATS[f][0]}{' (experts only, the rest bf16)' if f in EXPERTS_ONLY else ''} vs our "
                     f"{FORMATS[f][1] or 'bf16'} store"
                     + (f" (converted with --dense-quant {STORE_DENSE[f]})" if f in STORE_DENSE else "")
                     for f in formats) + ".\n\n"]


def report(a, best: dict, bw: dict, meta: dict, shapes: list, formats: list) -> list:
    L = report_head(a, meta, formats)
    for s in shapes:
        c = SHAPES[s]
        L += [f"## {s}: hidden {c['hidden_size']}, {c['num_hidden_layers']} layers ({moe_layers(c)} with experts) x "
              f"{n_experts(c)} experts top-{c['num_experts_per_tok']}, expert width {expert_width(c)}, "
              f"{attention_desc(c)}, vocab {c['vocab_size']}\n\n",
              "| weights | batch | threads | llama.cpp tok/s | tiered-moe tok/s (defaults) | tiered-moe / llama.cpp |\n",
              "|---|---|---|---|---|---|\n"]
        for f in formats:
            for b in BATCHES:
                for t in THREADS:
                    r = best[(s, f, b, t)]
                    L.append(f"| {FORMATS[f][0]} / {f} | {b} | {t} | {r['llama']:.1f} | {r['ours']:.1f} | "
                             f"{ours_best(r) / r['llama']:.2f} |\n")
        L.append("\nScaling (tiered-moe; llama.cpp in brackets):\n\n")
        for f in formats:
            for b in BATCHES:
                g = lambda side, t, f=f: (ours_best(best[(s, f, b, t)]) if side == "ours"  # noqa: E731
                                          else best[(s, f, b, t)][side])
                line = f"- {f} batch {b}: 2 threads / 1 thread {g('ours', 2) / g('ours', 1):.2f} " \
                       f"({g('llama', 2) / g('llama', 1):.2f})"
                if f != "bf16" and "bf16" in formats:
                    h = lambda side: max(g(side, t) for t in THREADS) / \
                        max(g(side, t, "bf16") for t in THREADS)  # noqa: E731
                    line += f"; {f} / bf16 at the best threads {h('ours'):.2f} ({h('llama'):.2f})"
                L.append(line + "\n")
        L.append("\n")
    return L + bandwidth_section(best, bw, meta, shapes, formats)


def bandwidth_section(best, bw, meta, shapes, formats) -> list:
    read = max(v for k, v in bw.items() if k.startswith("read"))
    L = ["## Memory bandwidth\n\n", "512 MB float32 array, best of 5 (copy counts read + write bytes): "
         + ", ".join(f"{k} {v:.1f} GB/s" for k, v in bw.items())
         + f". Reference below: the best read, {read:.1f} GB/s.\n\n",
         "Routed expert bytes a batch-1 token reads (layers x top_k x one expert) x decode tok/s at the best thread "
         "count. Ours: bytes of one expert's blob as stored (more where the runtime computes from widened or "
         "dequantized copies); llama.cpp: routed parameters x bits per weight (BF16 16, Q4_0 4.5, MXFP4 "
         "4.25). \"All weights\": the routed experts plus every other projection the token reads (attention, "
         "routers, the head) as each side holds them (ours: as the store records, --dense-quant auto; llama.cpp: "
         "the GGUF's tensor bytes, the token embedding excluded) - the bytes decode is "
         "bound by.\n\n",
         "| shape | weights | ours expert MB/token | ours tok/s | ours expert GB/s | of read BW | ours all weights GB/s "
         "| of read BW | llama.cpp expert MB/token | llama.cpp tok/s | llama.cpp expert GB/s | of read BW "
         "| llama.cpp all weights GB/s | of read BW |\n", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"]
    for s in shapes:
        c = SHAPES[s]
        for f in formats:
            per_tok = moe_layers(c) * c["num_experts_per_tok"]              # routed experts one token reads
            ob = per_tok * meta["blob_bytes"][f"{s}/{f}"]
            lb = per_tok * 3 * c["hidden_size"] * expert_width(c) * FORMATS[f][2] / 8
            r = max((best[(s, f, 1, t)] for t in THREADS), key=ours_best)       # our best run at batch 1
            o = ours_best(r)
            side = "ours_fast" if r.get("ours_fast", 0.0) > r["ours"] else "ours"
            oa = (ob + r.get(side + "_dense_bytes", 0)) * o / 1e9
            ll = max(best[(s, f, 1, t)]["llama"] for t in THREADS)
            la = (lb + meta["llama_dense_bytes"][f"{s}/{f}"]) * ll / 1e9
            L.append(f"| {s} | {FORMATS[f][0]} / {f} | {ob / 1e6:.2f} | {o:.1f} | {ob * o / 1e9:.2f} | "
                     f"{ob * o / 1e9 / read:.0%} | {oa:.2f} | {oa / read:.0%} | {lb / 1e6:.2f} | {ll:.1f} | "
                     f"{lb * ll / 1e9:.2f} | {lb * ll / 1e9 / read:.0%} | {la:.2f} | {la / read:.0%} |\n")
    return L


def plot(best: dict, shapes: list, formats: list, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib missing: no plot")
        return
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4), squeeze=False)
    for ax, s in zip(axes[0], shapes):
        keys = [(f, b, t) for f in formats for b in BATCHES for t in THREADS]
        ratios = [ours_best(best[(s, f, b, t)]) / best[(s, f, b, t)]["llama"] for f, b, t in keys]
        ax.bar(range(len(keys)), ratios, color=[f"C{formats.index(f)}" for f, _, _ in keys])
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(range(len(keys)), [f"{f}\nb{b} t{t}" for f, b, t in keys], fontsize=7)
        ax.set_title(f"{s}: tiered-moe (best setting) / llama.cpp decode tok/s")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        store, batch, threads = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
        aq = sys.argv[5] if len(sys.argv) > 5 else "none"
        dq = sys.argv[6] if len(sys.argv) > 6 else "none"
        print("RESULT " + json.dumps(ours_worker(store, batch, threads, aq, dq)), flush=True)
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--prefill-worker":
        print("RESULT " + json.dumps(prefill_worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))), flush=True)
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "tiered-moe-bench-vs-llama"))
    ap.add_argument("--llama-dir", default=None, help="an llama.cpp source tree (its build/ is used or built)")
    ap.add_argument("--cache", default=os.path.expanduser("~/.cache/tiered-moe/llama.cpp"))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--shapes", default="mid,wide")
    ap.add_argument("--formats", default="bf16,int4,mxfp4")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "vs_llama_cpp.md"))
    ap.add_argument("--prefill", type=int, default=512, help="prompt tokens of the prefill column (0: none)")
    ap.add_argument("--no-decode", action="store_true", help="the prefill column only")
    a = ap.parse_args()
    shapes, formats = a.shapes.split(","), a.formats.split(",")
    bad = [x for x in shapes if x not in SHAPES] + [x for x in formats if x not in FORMATS]
    if bad:
        ap.error(f"unknown shape/format {bad}; shapes {list(SHAPES)}, formats {list(FORMATS)}")
    meta = {"command": "python bench/vs_llama_cpp.py" + "".join(" " + shlex.quote(x) for x in sys.argv[1:]),
            "machine": f"{machine()}; tiered-moe's host kernels: the {kernels.isa()} build",
            "load": [os.getloadavg()[0]], "blob_bytes": {}, "llama_dense_bytes": {}}
    tree, bindir = llama_tree(a.llama_dir, a.cache)
    items = []
    for s in shapes:
        hf = os.path.join(a.workdir, f"{s}-hf")
        build_hf(SHAPES[s], hf)
        gg, st = ggufs(tree, bindir, hf, a.workdir, s, formats), stores(hf, a.workdir, s, formats)
        for f in formats:
            meta["blob_bytes"][f"{s}/{f}"] = Manifest.read(st[f]).blob_bytes
            meta["llama_dense_bytes"][f"{s}/{f}"] = gguf_dense_bytes(tree, gg[f])
            items.append((s, f, gg[f], st[f]))
    log("memory bandwidth")
    bw = bandwidth()
    res = run_pairs(bindir, items, a.reps) if not a.no_decode else {"best": {}, "build": None}
    pp = run_prefill(bindir, items, a.reps, a.prefill) if a.prefill else {}
    best = res["best"]
    meta["build"], meta["load"] = res["build"] or "?", meta["load"] + [os.getloadavg()[0]]
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        text = report(a, best, bw, meta, shapes, formats) if best else report_head(a, meta, formats)
        f.write("".join(text + (prefill_section(pp, a.prefill, shapes, formats) if pp else [])))
    stem = os.path.splitext(a.out)[0]
    with open(stem + ".json", "w") as f:
        json.dump({"meta": meta, "bandwidth_gbps": bw, "shapes": {s: SHAPES[s] for s in shapes},
                   "rows": [{"shape": s, "format": f, "llama_type": FORMATS[f][0], "batch": b, "threads": t, **v}
                            for (s, f, b, t), v in best.items()],
                   "prefill_rows": [{"shape": s, "format": f, "prompt": a.prefill, "threads": t, **v}
                                    for (s, f, t), v in pp.items()]}, f, indent=1)
    if best:
        plot(best, shapes, formats, stem + ".png")
    log(f"wrote {a.out}, {stem}.json, {stem}.png")


if __name__ == "__main__":
    main()
