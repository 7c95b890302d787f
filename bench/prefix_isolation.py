"""The prefix cache's timing side channel (issue 32, finding 3), measured as an attacker would: per trial a victim
sends a new ~1,000-character prefix; then the attacker times its own request with that prefix (a probe) and with a
fresh prefix of the same length, through a live server and the official openai client (streaming; time to the
first chunk). Three ways to serve: everyone shares the cache (the channel: probes are fast), the two clients send
different ``cache_salt``, the two use different API keys under ``--prefix-cache-isolation api-key``. Reported per
way: TTFT medians, ``cached_tokens`` of the probes, and how many trials a threshold halfway between the medians tells
apart (probe faster than it, fresh slower: 50% is a coin).

Checkpoint: bench/prefix_cache.py's synthetic MoE (hidden 512, 32 experts, 8 layers; --quick: smaller).

Usage: python bench/prefix_isolation.py [--quick] [--trials 10] [--outdir bench/results]
"""
import os
import random
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
import exp_common as ec  # noqa: E402
from prefix_cache import build  # noqa: E402

WAYS = (("shared cache", "none", None, None), ("different cache_salt", "none", "victim-salt", "attacker-salt"),
        ("API keys isolated", "api-key", None, None))


def ttft(c, model: str, text: str, salt) -> "tuple[float, int]":
    """(seconds to the first streamed chunk with text, usage's cached_tokens) of one chat request."""
    t0 = time.perf_counter()
    first, cached = None, None
    for ch in c.chat.completions.create(model=model, stream=True, temperature=0, max_tokens=2,
                                        stream_options={"include_usage": True},
                                        messages=[{"role": "user", "content": text}],
                                        extra_body={"cache_salt": salt} if salt else None):
        if ch.choices and ch.choices[0].delta.content and first is None:
            first = time.perf_counter() - t0
        if ch.usage is not None:
            cached = ch.usage.prompt_tokens_details.cached_tokens
    return (first if first is not None else time.perf_counter() - t0), cached


def way(store: str, isolation: str, victim_salt, attacker_salt, trials: int, chars: int) -> dict:
    import openai
    from runtime.serve.api import Server
    from runtime.serve.engine_proc import EngineConfig
    keys = ["victim-key", "attacker-key"]
    srv = Server(EngineConfig(model=store, max_batch=4), port=0, api_key=keys, prefix_cache_isolation=isolation).start()
    try:
        victim, attacker = (openai.OpenAI(base_url=srv.url + "/v1", api_key=k, max_retries=0, timeout=600) for k in keys)
        rng = random.Random(1)
        words = "policy tier expert cache prefetch routing layer token batch latency memory bandwidth".split()

        def text() -> str:
            return " ".join(rng.choice(words) for _ in range(chars // 7))[:chars]
        ttft(attacker, srv.model_name, text(), attacker_salt)          # warm-up
        probe, fresh, cached = [], [], []
        for _ in range(trials):
            secret = text()
            ttft(victim, srv.model_name, secret + " question one?", victim_salt)
            t, c = ttft(attacker, srv.model_name, secret + " question two?", attacker_salt)
            probe.append(t)
            cached.append(c)
            fresh.append(ttft(attacker, srv.model_name, text() + " question two?", attacker_salt)[0])
        cut = (statistics.median(probe) + statistics.median(fresh)) / 2
        told = sum(p < cut for p in probe) + sum(f >= cut for f in fresh)
        return {"probe": probe, "fresh": fresh, "cached_tokens": cached, "told_apart": told / (2 * trials)}
    finally:
        srv.close()


def main(argv=None) -> None:
    ap = ec.parser()
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--workdir", default=None)
    a = ap.parse_args(argv)
    cmd = "python bench/prefix_isolation.py" + (" --quick" if a.quick else "") + f" --trials {a.trials}"
    rep = ec.Report("prefix_isolation", a.outdir, cmd, "The prefix cache's timing side channel, and closing it")
    store = build(a.workdir or tempfile.mkdtemp(prefix="tiered-moe-pi-"), a.quick)
    chars = 300 if a.quick else 1000
    rows, plt = [], ec.pyplot()
    fig, ax = plt.subplots(1, len(WAYS), figsize=(11, 3.4), sharey=True)
    for i, (name, isolation, vs, at) in enumerate(WAYS):
        r = way(store, isolation, vs, at, a.trials, chars)
        rep.data[name] = r
        rows.append([name, statistics.median(r["probe"]), statistics.median(r["fresh"]),
                     f"{min(r['cached_tokens'])}-{max(r['cached_tokens'])}", f"{r['told_apart']:.0%}"])
        ax[i].boxplot([r["probe"], r["fresh"]], tick_labels=["another's prefix", "fresh"])
        ax[i].set_title(name, fontsize=10)
    ax[0].set_ylabel("time to first token (s)")
    rep.add(f"{a.trials} trials per way, a {chars}-character prefix each (chat, streaming, greedy, 2 tokens).", "")
    rep.table(["served", "TTFT p50: another's prefix", "TTFT p50: fresh", "cached_tokens of the probe",
               "trials told apart"], rows)
    rep.add("Told apart: by a threshold halfway between the two medians (50% is a coin toss). A probe's "
            "cached_tokens under isolation come from the attacker's own earlier requests (one 16-token block: the chat "
            "template's opening and a first word alike), never from the victim's.", "")
    rep.finish(fig, "time to first token of a prefix another client sent vs a fresh one")


if __name__ == "__main__":
    main()
