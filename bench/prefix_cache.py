"""Prefix caching on a chat workload (issue 21): 32 chat requests that share a ~1,000-token system prompt,
each with its own question, sent by 8 concurrent clients with the official openai package to a live server
(engine process + HTTP front-end) - once with prefix caching, once without (--no-prefix-caching), interleaved,
best of --repeats by wall time. Reported: prefill tokens computed (the engine's prompt tokens minus the
prefix-cache hits, from /metrics), time to first token (client side, p50 / p95), wall time, and whether the
two runs' texts are identical (greedy).

Checkpoint: a synthetic MoE of realistic shape built here (hidden 512, 32 experts, 8 layers, top-2), every
expert resident (what this measures is prefill, not the expert cache). ``--model k3``: a Kimi-K3-shaped hybrid
(Kimi Delta Attention and MLA 3:1, hidden 512, 32 LatentMoE experts, top-4) - per-sequence recurrent state, reused
through the prefix cache's state snapshots; written to prefix_cache_k3.md.

Usage: python bench/prefix_cache.py [--quick] [--model moe|k3] [--repeats 3] [--outdir bench/results]
"""
import concurrent.futures as cf
import os
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
import exp_common as ec  # noqa: E402


def metric(url: str, name: str) -> float:
    for line in urllib.request.urlopen(url + "/metrics").read().decode().splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def build(workdir: str, quick: bool, model: str = "moe") -> str:
    from runtime.model.convert import convert
    from runtime.model.synthetic import K3ShapeSpec, SyntheticModelSpec, build_checkpoint, build_k3_checkpoint
    hf, store = os.path.join(workdir, model, "hf"), os.path.join(workdir, model, "store")
    if not os.path.exists(os.path.join(store, "manifest.json")):
        if model == "k3":
            build_k3_checkpoint(hf, K3ShapeSpec(hidden_size=256 if quick else 512, latent_size=128 if quick else 256,
                                                num_layers=4 if quick else 8, num_experts=32, top_k=4,
                                                kda_heads=4, kda_head_dim=64, mla_heads=4))
        else:
            build_checkpoint(hf, SyntheticModelSpec(hidden_size=256 if quick else 512,
                                                    intermediate_size=256 if quick else 512,
                                                    num_layers=2 if quick else 8, num_experts=32, num_heads=8,
                                                    num_kv_heads=2))
        convert(hf, store)
    return store


def workload(tok, n: int, system_tokens: int) -> "tuple[str, list]":
    words = "policy tier expert cache prefetch routing layer token batch latency memory bandwidth".split()
    text, i = "", 0
    while len(tok.encode(text)) < system_tokens:
        text += words[i % len(words)] + " "
        i += 1
    return text, [f"question {q}: which {words[q % len(words)]} matters most for {words[(3 * q) % len(words)]}?"
                  for q in range(n)]


def run(store: str, caching: bool, system: str, questions: list, max_tokens: int) -> dict:
    import openai
    from runtime.serve.api import Server
    from runtime.serve.engine_proc import EngineConfig
    srv = Server(EngineConfig(model=store, max_batch=8, prefix_caching=caching), port=0).start()
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=600)

        def one(q: str) -> "tuple[float, str]":
            t0 = time.perf_counter()
            first, text = None, ""
            for ch in c.chat.completions.create(model=srv.model_name, stream=True, temperature=0, max_tokens=max_tokens,
                                                messages=[{"role": "system", "content": system},
                                                          {"role": "user", "content": q}]):
                if ch.choices and ch.choices[0].delta.content:
                    first = first or time.perf_counter() - t0
                    text += ch.choices[0].delta.content
            return first or float("nan"), text
        t0 = time.perf_counter()
        with cf.ThreadPoolExecutor(8) as pool:
            res = list(pool.map(one, questions))
        wall = time.perf_counter() - t0
        prompt = metric(srv.url, "tiered_moe_prompt_tokens_total")
        hits = metric(srv.url, "tiered_moe_prefix_cache_hits_total")
        return {"wall_s": wall, "ttft": [r[0] for r in res], "texts": [r[1] for r in res], "prompt_tokens": prompt,
                "prefix_hits": hits, "prefill_computed": prompt - hits}
    finally:
        srv.close()


def main(argv=None) -> None:
    ap = ec.parser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--model", choices=("moe", "k3"), default="moe",
                    help="moe: full attention; k3: a Kimi-K3-shaped KDA + MLA hybrid (per-sequence state)")
    a = ap.parse_args(argv)
    cmd = ("python bench/prefix_cache.py" + (" --quick" if a.quick else "") + f" --repeats {a.repeats}"
           + (f" --model {a.model}" if a.model != "moe" else ""))
    name = "prefix_cache" + ("_k3" if a.model == "k3" else "")
    rep = ec.Report(name, a.outdir, cmd, "Prefix caching: a chat workload with a shared system prompt"
                    + (" (a KDA + MLA hybrid: the state through snapshots)" if a.model == "k3" else ""))
    workdir = a.workdir or tempfile.mkdtemp(prefix="tiered-moe-pc-")
    store = build(workdir, a.quick, a.model)
    from runtime.tokenizer import Tokenizer
    n, sys_tokens, max_tokens = (8, 200, 4) if a.quick else (32, 1000, 16)
    system, questions = workload(Tokenizer(store), n, sys_tokens)
    best: dict = {}
    for _ in range(a.repeats):
        for caching in (False, True):         # interleaved
            r = run(store, caching, system, questions, max_tokens)
            if caching not in best or r["wall_s"] < best[caching]["wall_s"]:
                best[caching] = r
    off, on = best[False], best[True]
    same = off["texts"] == on["texts"]
    pct = lambda xs, p: sorted(xs)[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]   # noqa: E731
    rows = []
    for name, r in (("off", off), ("on", on)):
        rows.append([name, int(r["prompt_tokens"]), int(r["prefix_hits"]), int(r["prefill_computed"]),
                     pct(r["ttft"], 50), pct(r["ttft"], 95), r["wall_s"]])
    saved = 1 - on["prefill_computed"] / off["prefill_computed"]
    rep.data.update({"off": {k: v for k, v in off.items() if k != "texts"},
                     "on": {k: v for k, v in on.items() if k != "texts"}, "same_texts": same, "prefill_saved": saved,
                     "requests": n, "system_prompt_tokens": len(Tokenizer(store).encode(system))})
    rep.add(f"{n} chat requests, 8 concurrent clients (streaming, greedy, {max_tokens} tokens each), a system prompt of "
            f"{rep.data['system_prompt_tokens']} tokens shared by all; best of {a.repeats} by wall time.", "")
    rep.table(["prefix caching", "prompt tokens", "served from the cache", "prefill computed", "TTFT p50 s",
               "TTFT p95 s", "wall s"], rows)
    rep.add(f"Prefill tokens computed: {saved:.1%} fewer with the cache (goal >= 90%); TTFT p50 "
            f"{pct(off['ttft'], 50) / pct(on['ttft'], 50):.2f}x lower; outputs identical: {'yes' if same else 'NO'}.", "")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, 2, figsize=(9, 3.4))
    ax[0].bar(["off", "on"], [off["prefill_computed"], on["prefill_computed"]], color=["#999", "#3a7"])
    ax[0].set_title("prefill tokens computed", fontsize=10)
    ax[1].boxplot([off["ttft"], on["ttft"]], tick_labels=["off", "on"])
    ax[1].set_title("time to first token (s)", fontsize=10)
    rep.finish(fig, "prefill tokens and TTFT with and without prefix caching")


if __name__ == "__main__":
    main()
