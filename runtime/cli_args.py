"""The ``tiered-moe`` command line: one function per subcommand's arguments. Every choice list is
read from its registry (policies, prefetchers, scopes, schedules, prefetch rules, formats, profiles),
so a registered entry appears here with no edit."""
from __future__ import annotations

import argparse
import os

from cache_policy import cost_model as cm
from cache_policy.keys import PREFILL_CHUNK, SCHEDULES, SCOPES, parse_bytes
from cache_policy.policies import POLICIES, live_policies
from cache_policy.prefetch import LIVE_PREFETCHERS, PREFETCHERS
from cache_policy.replay import PREFETCH_RULES
from cache_policy.speculation import SPEC_RULES
from cache_policy.synthetic import GEOMETRIES


class CliError(Exception):
    """A command line value that cannot be used: the command exits 2 with its message."""


def parse_batches(text: str) -> list:
    """--batch (and layout lists): comma-separated positive integers."""
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise CliError(f"--batch: {text!r} is not a comma-separated list of integers (e.g. 1,8,64)") from None
    if not out or any(b < 1 for b in out):
        raise CliError(f"--batch: batch sizes must be positive integers, got {text!r}")
    return out


def parse_budget(text, flag):
    """A byte budget flag: bytes or a size (512MiB, 4GiB); --device-budget and --host-budget also take auto."""
    if text is None:
        return None
    if flag in ("--device-budget", "--host-budget") and str(text).strip().lower() == "auto":
        return "auto"
    try:
        return parse_bytes(text)
    except ValueError:
        raise CliError(f"{flag}: cannot parse {text!r}: give bytes (200000) or a size such as 512MiB or 4GiB") from None


def _add_synthetic_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("synthetic trace (with --synthetic)")
    g.add_argument("--geometry", default="small", help=f"layers x experts x top-k preset: {', '.join(GEOMETRIES)} (default small)")
    g.add_argument("--layers", type=int, help="override the preset's MoE layer count")
    g.add_argument("--experts", type=int, help="override the preset's routed experts per layer")
    g.add_argument("--top-k", type=int, help="override the preset's experts per token")
    g.add_argument("--sequences", type=int, default=64)
    g.add_argument("--seq-len", type=int, default=64)
    g.add_argument("--zipf", type=float, default=0.0, help="popularity skew s (0 = uniform)")
    g.add_argument("--persistence", type=float, default=0.0, help="chance a slot re-uses the previous token's expert")
    g.add_argument("--cross-layer", type=float, default=0.0, help="chance a slot follows a fixed path from the previous layer")
    g.add_argument("--seed", type=int, default=0)


class _QuantizeChoices:
    """``convert --quantize`` names from the format registry, read when argparse asks (formats import
    torch; replay and trace commands must not)."""

    def _names(self):
        from .quant import quantize_choices   # here, not at the top: the registry imports torch
        return list(quantize_choices())

    def __contains__(self, x):
        return x in self._names()

    def __iter__(self):
        return iter(self._names())

    def __str__(self):
        return ", ".join(self._names())


def _default_workdir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tiered-moe", "demo")


def _add_cache_bonus(p) -> None:
    p.add_argument("--cache-bonus", type=float, default=0.0,
                   help="cache-aware routing: add this to the router logits of experts resident on the device "
                        "(0 = off, the default; > 0 changes outputs: see bench/results/exp_cache_routing.md)")


def _add_schedule(p) -> None:
    p.add_argument("--schedule", default="fcfs", help=f"{' or '.join(SCHEDULES)} (fcfs: first come first served; "
                                                       "expert-aware: each step runs the --max-batch active requests "
                                                       "whose recent experts overlap most)")
    p.add_argument("--max-active", type=int, default=None,
                   help="requests holding a KV slot at once (expert-aware default: 4 x --max-batch)")


def _add_tier_args(p) -> None:
    p.add_argument("--device-budget", help="device memory for dense weights + KV cache + experts, e.g. 4GiB, per rank; "
                                           "auto: the device's memory at 90%% split as 'tiered-moe plan' does "
                                           "(default: everything fits)")
    p.add_argument("--kv-cache-budget", default="0B",
                   help="memory of the KV cache, preallocated in blocks of 16 tokens; requests are admitted by free "
                        "blocks and preempted (recomputed later) when out (default 0: --max-batch sequences of 1024 "
                        "tokens, at least one whole context up to 8192)")
    p.add_argument("--host-budget", help="bytes of experts in host memory (default: all experts). On a machine without "
                                         "a GPU it is the one budget: every expert computes from host memory, the "
                                         "rest stay on disk; auto: the memory available (or the cgroup limit's "
                                         "room) less dense weights, KV cache and a margin of 256 MiB + 10%%")
    p.add_argument("--policy", default="reuse", help=f"one of {', '.join(live_policies())} (default reuse: predicted "
                                                     "reuse, no collapse in a global pool at high batch)")
    p.add_argument("--scope", default="global", help=" or ".join(SCOPES))
    p.add_argument("--prefetch", default="none", help=", ".join(LIVE_PREFETCHERS))
    _add_hybrid_args(p)


def _add_hybrid_args(p, live: bool = True) -> None:
    p.add_argument("--cpu-experts", default="0",
                   help="where experts not on the device are computed: 0 = moved to the device (default); N = every "
                        "expert of the first N MoE layers stays on the host and is computed there (llama.cpp's "
                        "--n-cpu-moe); auto = per expert per step, the cost model decides between moving it and "
                        "computing it on the host CPU from host memory (without CUDA: always the host, no copy)")
    p.add_argument("--prefetch-rule", default="cost",
                   help=f"{' or '.join(PREFETCH_RULES)}; cost (default): prefetch an expert only when p(needed) x time saved exceeds the link time it "
                        "takes from demand loads; always: every prediction up to the budget")
    if live:
        p.add_argument("--host-act-quant", default="q8", choices=["none", "q8"],
                       help="quantized (mxfp4, int4, int8) experts and --dense-quant weights computed on the CPU: q8 "
                            "(default, as llama.cpp's default) = activations rounded to 8 bits per 32 values and "
                            "integer dot products (~1%% output error); none = float32 activations, exact to float32 "
                            "rounding (slower). bf16 weights (experts and dense): q8 also rounds the rows of "
                            "prefill-size products to bf16 for a bf16 matmul (llama.cpp's way for BF16 weights); "
                            "decode's few rows stay float32 either way")
        p.add_argument("--dense-quant", default="auto", choices=["auto", "none", "int8", "int4"],
                       help="non-expert projections (attention, dense MLPs, shared experts, the head) quantized at load "
                            "for the CPU kernels: int8 (group 32, as llama.cpp's Q8_0) or int4 (group 32; the head "
                            "int8), a quarter or an eighth of their float32 bytes; none: as the checkpoint has them; "
                            "auto (default): what 'convert --dense-quant' recorded in the store, else none")
        p.add_argument("--profile", default=None, help="hardware profile of those decisions (default: cpu without "
                                                       "CUDA, h200 with it), or a profile JSON file")


def _add_layout_args(p) -> None:
    p.add_argument("--tensor-parallel", default=None, metavar="N[,N...]",
                   help="also project these tensor-parallel layouts (GPUs each holding a slice of every expert; "
                        "capacity is then per GPU, in slices): cache_policy/layout.py")
    p.add_argument("--pipeline-parallel", default=None, metavar="M[,M...]",
                   help="... with these pipeline stages (contiguous MoE layer ranges, micro-batches)")
    p.add_argument("--hidden", type=int, default=None,
                   help="the model's hidden size, for the all-reduce cost (default: the geometry's model)")


def _add_engine_args(p, max_batch: int) -> None:
    p.add_argument("--max-batch", type=int, default=max_batch, help="sequences per step")
    p.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="N ranks (processes on torch.distributed: NCCL with a GPU each, else gloo), each holding its "
                        "slice of every expert (split along the intermediate axis) and of the attention heads; one "
                        "all-reduce per sublayer. Started by this command, or by torchrun (one process per rank). "
                        "Budgets are per rank")
    p.add_argument("--pipeline-parallel", type=int, default=1, metavar="M",
                   help="M stages of consecutive layers (x --tensor-parallel ranks each), hidden states handed from "
                        "stage to stage, micro-batches so stages overlap at batch > 1; across nodes with torchrun "
                        "(README: multi-node)")
    p.add_argument("--prefill-chunk", type=int, default=PREFILL_CHUNK,
                   help=f"prompt tokens per sequence per step (default {PREFILL_CHUNK}, llama.cpp's ubatch)")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="do not reuse the KV blocks of prompt prefixes seen before (on by default, as in vLLM; "
                        "models with per-sequence state - linear attention, sliding windows, DeepSeek-V4 - also "
                        "keep that state at block boundaries: --prefix-snapshots)")
    p.add_argument("--prefix-snapshots", type=int, default=None, metavar="N",
                   help="models with per-sequence state: how many snapshots of it the prefix cache keeps (each the "
                        "size of one sequence's state, out of the KV cache budget; default: --max-active; 0: no "
                        "prefix reuse for them)")
    _add_threads(p)
    _add_cache_bonus(p)
    _add_schedule(p)


def _add_threads(p) -> None:
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for tensor ops (like llama.cpp's -t; default: torch's choice). On small "
                        "models 1 is often fastest: see bench/results/decode_speed.md")



def _demo(sub, commands: dict) -> None:
    d = sub.add_parser("demo", help="the main job on an embedded default: a synthetic checkpoint at low and high batch")
    d.add_argument("--workdir", default=_default_workdir(), help="where the checkpoint, store and results go")
    d.add_argument("--device-fraction", type=float, default=0.25)
    d.add_argument("--high-batch", type=int, default=32)
    d.add_argument("--requests", type=int, default=32)
    d.add_argument("--max-tokens", type=int, default=24)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--build-only", action="store_true", help="build the checkpoint and store, print the store path, stop")
    d.add_argument("--shape", choices=("mixtral", "k3"), default="mixtral",
                   help="mixtral: the default synthetic Mixtral-format model; k3: a scaled-down Kimi K3 shape (KDA:MLA 3:1, "
                        "LatentMoE, 128 experts top-16, two shared experts, Block Attention Residuals, MXFP4 experts)")
    _add_threads(d)
    d.set_defaults(func=commands['demo'])


def _regimes(sub, commands: dict) -> None:
    rg = sub.add_parser("regimes", help="low-batch vs high-batch: hit rates, bytes, measured and projected tokens/s")
    rg.add_argument("--model", help="store directory written by 'tiered-moe convert'")
    rg.add_argument("--synthetic", help=f"no model: replay a synthetic trace of a geometry ({', '.join(GEOMETRIES)})")
    rg.add_argument("--batch", default="1,4,16,64")
    rg.add_argument("--policies", default="none,lru,lru+freq", help="comma-separated policy[+prefetch] items")
    rg.add_argument("--device-fraction", type=float, default=0.25)
    rg.add_argument("--requests", type=int, default=16)
    rg.add_argument("--prompt-len", type=int, default=8)
    rg.add_argument("--max-tokens", type=int, default=24)
    rg.add_argument("--profile", default="h200")
    rg.add_argument("--expert-geometry", default=None, help="project with this expert size instead of the model's")
    rg.add_argument("--zipf", type=float, default=1.0)
    rg.add_argument("--persistence", type=float, default=0.5)
    rg.add_argument("--seed", type=int, default=0)
    rg.add_argument("--out", default=None, help="path prefix for .json and .png")
    rg.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                    help="run the live model on N tensor-parallel ranks (the device fraction is per rank, in "
                         "slices) and project that layout from the recorded routing")
    rg.add_argument("--pipeline-parallel", type=int, default=1, metavar="M", help="... and M pipeline stages")
    _add_threads(rg)
    _add_cache_bonus(rg)
    rg.set_defaults(func=commands['regimes'])


def _replay(sub, commands: dict) -> None:
    r = sub.add_parser("replay", help="replay a routing trace through tier placement")
    r.add_argument("--trace", help="routing trace .npz (layout: cache_policy/traces.py)")
    r.add_argument("--synthetic", action="store_true", help="generate a trace instead (knobs below)")
    r.add_argument("--policy", default="reuse", help=f"one or more, comma-separated: {', '.join(POLICIES)} "
                                                     "(registered ones included)")
    r.add_argument("--scope", default="global", help="layer (C slots per layer) or global (C slots in total)")
    r.add_argument("--device-capacity", default="0.1", help="fraction of all experts (0.1), count (166) or size (24GiB)")
    r.add_argument("--host-capacity", default=None, help="as --device-capacity; default: the host holds every expert")
    r.add_argument("--prefetch", default="none", help=f"one or more, comma-separated: {', '.join(p for p in PREFETCHERS if p != 'lookahead')}")
    r.add_argument("--prefetch-budget", type=int, default=None, help="experts prefetched per layer per step (default top-k)")
    r.add_argument("--batch", default="1", help="comma-separated batch sizes, e.g. 1,8,64")
    r.add_argument("--profile", default="h200", help=f"hardware profile: {', '.join(cm.list_profiles())} or a JSON path")
    r.add_argument("--dtype", default="bf16", help=f"expert weight dtype: {', '.join(cm.DTYPE_BITS)}")
    r.add_argument("--expert-geometry", default=None, help=f"expert size preset: {', '.join(cm.EXPERT_GEOMETRY)} (default: from the trace's model)")
    r.add_argument("--expert-bytes", type=int, default=None, help="bytes of one expert (overrides geometry and dtype)")
    r.add_argument("--fit-trace", default=None, help="training trace for static's profile, transition's fit and reuse's statistics "
                                                   "(reuse without it learns online)")
    r.add_argument("--transition-model", default=None, help="transition prefetcher saved by 'tiered-moe prefetch fit'")
    r.add_argument("--json", action="store_true", help="one JSON object per line, per batch size")
    _add_layout_args(r)
    _add_hybrid_args(r, live=False)
    _add_synthetic_args(r)
    _add_speculative_args(r)
    r.set_defaults(func=commands['replay'])


def _add_speculative_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative decoding (with --speculative; cache_policy/spec_replay.py)")
    g.add_argument("--speculative", action="store_true",
                   help="project tokens/s with speculative decoding: each step verifies k drafts per request, "
                        "k chosen by --spec-rule; prints the same batch without speculation beside it")
    g.add_argument("--num-speculative-tokens", type=int, default=4, metavar="K",
                   help="the most drafts per request and step (default 4)")
    g.add_argument("--spec-rule", default="cost", help=f"{', '.join(SPEC_RULES)}: cost picks k in 0..K per step by the "
                                                       "expected tokens it gains at the going tokens/s; ratio by the step's "
                                                       "own tokens/s; fixed drafts K every step (default cost)")
    g.add_argument("--acceptance", default="0.85", help="acceptance rate of a draft (0.85), or by position (0.9,0.8,0.7)")
    g.add_argument("--draft-cost", default="mtp", help="mtp[:FRACTION of a layer per draft] (default mtp:1), ngram (free), "
                                                     "model:FRACTION of a step per draft")
    g.add_argument("--spec-seed", type=int, default=0, help="seed of the acceptance draws")
    g.add_argument("--rejected-routing", default="next",
                   help="routing a rejected draft is priced with: next (the trace's token there; the next step finds "
                        "its experts loaded: optimistic) or other (an unrelated token's: pessimistic); default next")


def _add_live_speculative_args(p: argparse.ArgumentParser) -> None:
    """generate / serve: speculative decoding in the engine (runtime/engine/speculative.py); vLLM's names."""
    g = p.add_argument_group("speculative decoding (runtime/engine/speculative.py)")
    g.add_argument("--speculative", default=None, metavar="METHOD",
                   help="draft tokens and verify them in one step: ngram (prompt lookup over prompt + output), mtp "
                        "(the checkpoint's multi-token-prediction layers), draft (--draft-model); greedy outputs are "
                        "those of plain decoding, sampled ones keep their distribution (default off)")
    g.add_argument("--num-speculative-tokens", type=int, default=4, metavar="K",
                   help="the most drafts per request and step, 1..16 (default 4)")
    g.add_argument("--spec-rule", default="cost", help=f"{', '.join(SPEC_RULES)}: how many of the K drafts a step "
                                                       "verifies (cost: by the expected tokens against the experts the "
                                                       "verify step moves; fixed: K every step); default cost")
    g.add_argument("--prompt-lookup-min", type=int, default=1, metavar="N",
                   help="ngram: the shortest suffix matched (default 1)")
    g.add_argument("--prompt-lookup-max", type=int, default=4, metavar="N",
                   help="ngram: the longest suffix matched (default 4)")
    g.add_argument("--draft-model", default=None, metavar="PATH",
                   help="--speculative draft: a store of a smaller model with the same tokenizer")


def spec_options(a) -> "dict | None":
    """The command line's speculative-decoding options (generate / serve) as RuntimeConfig's dict (validated there:
    runtime/engine/speculative.py SpecOptions); None when --speculative is not given."""
    if getattr(a, "speculative", None) is None:
        if getattr(a, "draft_model", None) is not None:
            raise CliError("--draft-model is for --speculative draft")
        return None
    return dict(method=a.speculative, num_speculative_tokens=a.num_speculative_tokens, rule=a.spec_rule,
                draft_model=a.draft_model, ngram_min=a.prompt_lookup_min, ngram_max=a.prompt_lookup_max)


def _convert(sub, commands: dict) -> None:
    c = sub.add_parser("convert", help="convert a Hugging Face MoE checkpoint into the tiered store layout")
    c.add_argument("--model", required=True, help="HF model directory (config.json + *.safetensors)")
    c.add_argument("--out", required=True, help="store directory to write")
    c.add_argument("--quantize", choices=_QuantizeChoices(), default=None, metavar="FORMAT",
                   help="quantize the experts of a float checkpoint to FORMAT: %(choices)s (shipped quantized "
                        "checkpoints are read as they are)")
    c.add_argument("--dense-quant", choices=["none", "int8", "int4"], default=None,
                   help="record in the store that its non-expert projections run quantized (int8 or int4, group 32; "
                        "the head int8) - what generate / serve then do by default (--dense-quant auto), as "
                        "llama.cpp's Q4_0 quantizes attention too; the store keeps them as the checkpoint has them "
                        "(quantized at load), so --dense-quant none still runs them exact. Default: not recorded (none)")
    c.set_defaults(func=commands['convert'])


def _add_model_arg(p) -> None:
    p.add_argument("--model", required=True, help="a store written by 'tiered-moe convert', or a Hugging Face checkpoint "
                                                  "folder: converted on first use into $TIERED_MOE_CACHE (default "
                                                  "~/.cache/tiered-moe/stores), reused until its files change")
    p.add_argument("--quantize", choices=_QuantizeChoices(), default=None, metavar="FORMAT",
                   help="with a checkpoint folder: its experts as FORMAT (%(choices)s) in the converted store")


def _generate(sub, commands: dict) -> None:
    g = sub.add_parser("generate", help="generate text from a converted store")
    _add_model_arg(g)
    g.add_argument("--prompt", action="append", help="prompt text (repeat for several, decoded as a batch)")
    g.add_argument("--prompt-ids", action="append", help="prompt as comma-separated token ids (repeat for several)")
    _add_tier_args(g)
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--trace-out", help="write the routing trace (.npz) of this run")
    g.add_argument("--json", action="store_true")
    _add_engine_args(g, max_batch=16)
    _add_live_speculative_args(g)
    g.set_defaults(func=commands['generate'])


def _serve(sub, commands: dict) -> None:
    sv = sub.add_parser("serve", help="OpenAI-compatible server: HTTP front-end + engine process over ZeroMQ")
    _add_model_arg(sv)
    sv.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only)")
    sv.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    sv.add_argument("--api-key", action="append", default=None, metavar="KEY",
                    help="require 'Authorization: Bearer KEY' on /v1 requests; repeatable: any of the keys is taken "
                         "(visible in ps: prefer TIERED_MOE_API_KEY or --api-key-file)")
    sv.add_argument("--api-key-file", default=None, help="read the API keys from this file (one per line; blank lines "
                                                          "are skipped)")
    sv.add_argument("--prefix-cache-isolation", choices=("none", "api-key"), default="none",
                    help="api-key: requests share prefix-cache blocks only with requests sent with the same API key "
                         "(and the same cache_salt), so no client can time what another sent; none: only a "
                         "request's cache_salt keeps it apart (default)")
    sv.add_argument("--shutdown-grace", type=float, default=10.0, metavar="SECONDS",
                    help="on SIGTERM / Ctrl-C, seconds open requests may finish (no new ones are taken); those "
                         "still open then end with an error (default 10)")
    sv.add_argument("--timeout", type=float, default=60.0, help="seconds a client socket may stay silent (read or write)")
    sv.add_argument("--heartbeat-timeout", type=float, default=60.0,
                    help="seconds without a message from the engine before it is killed and restarted")
    sv.add_argument("--served-model-name", default=None, help="model id clients use (default: the store's name)")
    sv.add_argument("--reasoning-parser", choices=("auto", "none", "gpt_oss", "deepseek_r1", "qwen3"), default="auto",
                    help="how a reasoning model's thinking is split from its reply into reasoning_content (vLLM's "
                         "option): auto (default) picks the family by what its chat template writes (<think> ... "
                         "</think>: qwen3 / deepseek_r1; harmony channels: gpt_oss); none leaves it in the content")
    sv.add_argument("--allowed-host", action="append", default=None, metavar="NAME",
                    help="a name the Host header may carry (repeatable). Default: a keyless server on a loopback "
                         "address answers only to localhost / 127.0.0.1 / ::1 (DNS rebinding protection); with an "
                         "API key or a public address, any")
    _add_tier_args(sv)
    sv.add_argument("--startup-timeout", type=float, default=300.0, help="seconds to wait for the engine to load")
    _add_engine_args(sv, max_batch=32)
    _add_live_speculative_args(sv)
    sv.set_defaults(func=commands['serve'])


def _plan(sub, commands: dict) -> None:
    pl = sub.add_parser("plan", help="per GPU: dense weights, KV and state for a context x batch, expert slots left, "
                                     "host DRAM; the layout to run and its projected tokens/s")
    pl.add_argument("--model", required=True, help="store directory written by 'tiered-moe convert'")
    pl.add_argument("--gpus", type=int, required=True, help="GPUs to plan for (tensor-parallel x pipeline stages); 0: "
                                                           "this machine's CPU, one memory (--host-budget auto)")
    pl.add_argument("--host-memory", default=None, help="with --gpus 0: the memory to plan for, beyond what the "
                                                        "runtime itself takes (Python and torch, ~0.4 GB) (default: "
                                                        "what this machine has available now, a cgroup limit "
                                                        "included)")
    pl.add_argument("--dense-quant", default="auto", choices=["auto", "none", "int8", "int4"],
                    help="with --gpus 0: the dense weights counted as generate --dense-quant keeps them (auto: as the "
                         "store records)")
    pl.add_argument("--context", type=int, required=True, help="tokens of context per sequence")
    pl.add_argument("--batch", type=int, required=True, help="sequences at once")
    pl.add_argument("--profile", default="h200", help="hardware profile with a multi_gpu section (default h200)")
    pl.add_argument("--gpu-memory", default=None, help="memory of one GPU (default: the profile's)")
    pl.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                    help="share of a GPU's memory the plan fills (vLLM's knob; default 0.9)")
    pl.add_argument("--trace", default=None, help="routing trace .npz for the projection (default: the store's own "
                                                  "routing-trace.npz, else a synthetic one of its shape)")
    pl.add_argument("--policy", default="lru", help="eviction policy of the projection (default lru)")
    pl.add_argument("--expert-format", default=None,
                    help="with a Hugging Face config directory instead of a store: the experts' format (default: "
                         "the checkpoint's shipped one, else bf16)")
    pl.add_argument("--json", action="store_true")
    pl.set_defaults(func=commands["plan"])


def _trace(sub, commands: dict) -> None:
    t = sub.add_parser("trace", help="routing trace tools")
    tsub = t.add_subparsers(dest="trace_cmd", required=True)
    ts = tsub.add_parser("stats", help="tokens, sequences, skew and reuse distances of a trace")
    ts.add_argument("file")
    ts.add_argument("--json", action="store_true")
    ts.set_defaults(func=commands['trace stats'])


def _prefetch(sub, commands: dict) -> None:
    pf = sub.add_parser("prefetch", help="prefetcher tools")
    psub = pf.add_subparsers(dest="prefetch_cmd", required=True)
    fit = psub.add_parser("fit", help="fit a transition prefetcher on a training trace and save it")
    fit.add_argument("--trace", required=True)
    fit.add_argument("--out", required=True)
    fit.set_defaults(func=commands['prefetch fit'])


def build_parser(commands: dict) -> argparse.ArgumentParser:
    """``commands``: subcommand name (``"trace stats"`` for nested ones) -> the function it runs."""
    p = argparse.ArgumentParser(prog="tiered-moe", description="Tiered expert-offloading for MoE models.")
    sub = p.add_subparsers(dest="cmd", required=True)
    for add in (_demo, _regimes, _replay, _convert, _generate, _serve, _plan, _trace, _prefetch):
        add(sub, commands)
    return p
