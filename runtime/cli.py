"""The ``tiered-moe`` command.

Replay and trace commands only need ``cache_policy`` (numpy); nothing here imports torch, so
they start fast.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from cache_policy.prefetch import TransitionPrefetcher
from cache_policy.replay import ReplayConfig, replay
from cache_policy.synthetic import GEOMETRIES, SyntheticSpec, generate
from cache_policy.traces import format_stats, load_trace, trace_stats


class CliError(Exception):
    pass


def _batches(text: str) -> list:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise CliError(f"--batch: {text!r} is not a comma-separated list of integers (e.g. 1,8,64)") from None
    if not out or any(b < 1 for b in out):
        raise CliError(f"--batch: batch sizes must be positive integers, got {text!r}")
    return out


def _synthetic_trace(a):
    if a.geometry not in GEOMETRIES:
        raise CliError(f"--geometry: unknown {a.geometry!r}; choose one of {', '.join(GEOMETRIES)}")
    L, E, k = GEOMETRIES[a.geometry]
    spec = SyntheticSpec(num_layers=a.layers or L, num_experts=a.experts or E, top_k=a.top_k or k,
                         num_sequences=a.sequences, seq_len=a.seq_len, zipf_s=a.zipf,
                         persistence=a.persistence, cross_layer=a.cross_layer, seed=a.seed)
    return generate(spec)


def _fmt(x, spec=".3f"):
    return "-" if x is None else format(x, spec)


def format_table(results: list) -> str:
    cols = [
        ("batch", lambda r: str(r["batch"])),
        ("policy", lambda r: r["policy"]),
        ("scope", lambda r: r["scope"]),
        ("prefetch", lambda r: r["prefetch"]),
        ("cpu experts", lambda r: r["cpu_experts"]),
        ("dev slots", lambda r: f"{r['device_slots']}{'/layer' if r['scope'] == 'layer' else ''}"),
        ("dev %", lambda r: f"{100 * r['device_fraction']:.0f}"),
        ("dev hit", lambda r: _fmt(r["hit_rate"]["device"])),
        ("host hit", lambda r: _fmt(r["hit_rate"]["host"])),
        ("uniq/layer", lambda r: f"{r['unique_experts_per_layer_step']:.1f}"),
        ("waves", lambda r: str(r["waves"]["extra_waves"])),
        ("on host", lambda r: f"{r['host_compute']['share']:.2f}"),
        ("h2d MB/tok", lambda r: f"{r['bytes_per_token']['host_to_device'] / 1e6:.1f}"),
        ("disk MB/tok", lambda r: f"{r['bytes_per_token']['disk_to_host'] / 1e6:.1f}"),
        ("pf prec", lambda r: _fmt(r["prefetch_stats"]["precision"], ".2f")),
        ("pf recall", lambda r: _fmt(r["prefetch_stats"]["recall"], ".2f")),
        ("tok/s serial", lambda r: f"{r['projected']['tokens_per_s_serial']:.1f}"),
        ("tok/s overlap", lambda r: f"{r['projected']['tokens_per_s_overlap']:.1f}"),
        ("tok/s resident", lambda r: f"{r['projected']['tokens_per_s_all_resident']:.0f}"),
        ("wall s", lambda r: f"{r['wall_seconds']:.2f}"),
    ]
    rows = [[c[0] for c in cols]] + [[f(r) for _, f in cols] for r in results]
    w = [max(len(row[i]) for row in rows) for i in range(len(cols))]
    lines = ["  ".join(cell.rjust(w[i]) if i >= 5 else cell.ljust(w[i]) for i, cell in enumerate(row)) for row in rows]
    lines.insert(1, "  ".join("-" * x for x in w))
    return "\n".join(lines)


def _footer(results: list) -> str:
    r = results[0]
    return (f"trace: {r['trace']} ({r['tokens']:,} tokens)\n"
            f"expert: {r['expert_bytes'] / 1e6:.1f} MB - {r['expert_size_source']}\n"
            f"profile: {r['profile']} (h2d {r['projected']['h2d_GBps']:.1f} GB/s for one expert, "
            f"{r['projected']['h2d_ms_per_expert']:.3f} ms per copy); tokens/s are projections of expert "
            f"compute and transfers only (see cache_policy/cost_model.py)\n"
            f"dev hit = device hits / needed experts; host hit = host hits / device misses; on host = share of needed "
            f"experts computed on the host CPU without a transfer (--cpu-experts)")


def _progress_factory(enabled: bool, desc: str):
    if not enabled:
        return None
    from tqdm import tqdm
    bar = {"b": None}

    def cb(done, total):
        if bar["b"] is None:
            bar["b"] = tqdm(total=total, desc=desc, unit="group", leave=False, file=sys.stderr)
        bar["b"].n = done
        bar["b"].refresh()
        if done >= total:
            bar["b"].close()
            bar["b"] = None
    return cb


def cmd_replay(a) -> int:
    if bool(a.trace) == bool(a.synthetic):
        raise CliError("give exactly one of --trace FILE.npz or --synthetic")
    trace = load_trace(a.trace) if a.trace else _synthetic_trace(a)
    fit = load_trace(a.fit_trace) if a.fit_trace else None
    from cache_policy.layout import project
    layouts, hidden = _layouts(a, trace)
    results = []
    items = [(p, f, c) for p in a.policy.split(",") for f in a.prefetch.split(",") for c in a.cpu_experts.split(",")]
    for policy, prefetch, cpu in items:
        cfg = ReplayConfig(policy=policy, scope=a.scope, device_capacity=a.device_capacity,
                           host_capacity=a.host_capacity, prefetch=prefetch, prefetch_budget=a.prefetch_budget,
                           profile=a.profile, dtype=a.dtype, geometry=a.expert_geometry,
                           expert_bytes=a.expert_bytes, fit_trace=fit, transition_model=a.transition_model,
                           cpu_experts=cpu, prefetch_rule=a.prefetch_rule)
        prog = _progress_factory(not a.json and sys.stderr.isatty(), f"{policy}/{prefetch}/cpu-experts {cpu}")
        rs = replay(trace, cfg, _batches(a.batch), progress=prog)
        for r in rs:
            if layouts:
                r["layouts"] = [project(trace, cfg, r["batch"], lay, hidden=hidden) for lay in layouts]
        results.extend(rs)
        if a.json:
            for r in rs:
                print(json.dumps(r), flush=True)
    if not a.json:
        print(format_table(results))
        print()
        print(_footer(results))
        if layouts:
            print()
            print(format_layouts(results))
    return 0


def _layouts(a, trace=None, hidden: "int | None" = None) -> "tuple[list, int | None]":
    """--tensor-parallel / --pipeline-parallel (comma lists) -> the layouts to project and the hidden size
    their all-reduces carry (--hidden, else the geometry's model, else ``hidden``)."""
    from cache_policy import cost_model as cm
    from cache_policy.layout import Layout
    tps = _batches(getattr(a, "tensor_parallel", None) or "1")
    pps = _batches(getattr(a, "pipeline_parallel", None) or "1")
    layouts = [Layout(tp, pp) for pp in pps for tp in tps]
    if layouts == [Layout(1, 1)] and not getattr(a, "tensor_parallel", None):
        return [], None
    h = getattr(a, "hidden", None) or hidden
    names = [getattr(a, "expert_geometry", None), getattr(a, "geometry", None) if getattr(a, "synthetic", None) else None]
    if trace is not None and cm.geometry_for_model(trace.model)[1]:
        names.append(cm.geometry_for_model(trace.model)[0])
    for name in names:
        if h is None and name in cm.MODEL_HIDDEN:
            h = cm.MODEL_HIDDEN[name]
    if h is None:
        raise CliError("layout projections need the model's hidden size (what each all-reduce carries): give --hidden")
    return layouts, int(h)


def format_layouts(results: list) -> str:
    """One row per (policy, batch, layout): projected tokens/s and its ratio to one GPU of the same capacity."""
    lines = [f"{'policy':<14} {'batch':>5} {'layout':<9} {'GPUs':>4} {'dev hit':>7} {'MB/tok/GPU':>10} "
             f"{'all-reduce us':>13} {'tok/s':>9} {'x 1 GPU':>7}"]
    for r in results:
        base = next((x["tokens_per_s"] for x in r["layouts"] if x["gpus"] == 1), None)
        for x in r["layouts"]:
            lines.append(f"{r['policy']:<14} {r['batch']:>5} {x['layout']:<9} {x['gpus']:>4} {x['device_hit_rate']:>7.3f} "
                         f"{x['bytes_per_token_per_gpu'] / 1e6:>10.2f} {x['allreduce_us']:>13.1f} "
                         f"{x['tokens_per_s']:>9.1f} {(x['tokens_per_s'] / base if base else float('nan')):>7.2f}")
    return "\n".join(lines) + ("\n(device capacity is per GPU, in expert slices; layouts: cache_policy/layout.py; "
                               "multi-GPU figures: the profile's multi_gpu section)")


def cmd_trace_stats(a) -> int:
    s = trace_stats(load_trace(a.file))
    print(json.dumps(s) if a.json else format_stats(s))
    return 0


def cmd_prefetch_fit(a) -> int:
    tr = load_trace(a.trace)
    p = TransitionPrefetcher(tr.num_layers, tr.num_experts).fit(tr)
    p.save(a.out)
    print(f"wrote {a.out}: transition counts for {tr.num_layers} layers x {tr.num_experts} experts "
          f"from {tr.num_tokens:,} tokens of {tr.source}")
    return 0


def _default_workdir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tiered-moe", "demo")


def cmd_demo(a) -> int:
    """The main job on the embedded default: a synthetic checkpoint with real routing locality,
    converted into the tiers and decoded at low and high batch."""
    from .model.convert import convert
    from .model.synthetic import K3ShapeSpec, SyntheticModelSpec, build_checkpoint, build_k3_checkpoint
    from .regimes import format_rows, run_regimes
    from .store import Manifest
    k3 = a.shape == "k3"
    spec = K3ShapeSpec(seed=a.seed) if k3 else SyntheticModelSpec(seed=a.seed)
    sub = "k3" if k3 else ""
    hf, store = os.path.join(a.workdir, sub, "hf"), os.path.join(a.workdir, sub, "store")
    if not Manifest.current(store):
        print(f"building the synthetic checkpoint in {os.path.dirname(hf)} (first run, or a store of an older version) ...",
              file=sys.stderr if a.build_only else sys.stdout, flush=True)
        if k3:
            build_k3_checkpoint(hf, spec)
            convert(hf, store, progress=sys.stderr.isatty(), quantize="mxfp4")
        else:
            build_checkpoint(hf, spec)
            convert(hf, store, progress=sys.stderr.isatty())
    m = Manifest.read(store)
    if a.build_only:
        print(store)
        return 0
    if k3:
        print(f"model: K3-shaped synthetic (runtime/model/synthetic.py K3ShapeSpec): {spec.num_layers} layers, KDA:MLA 3:1, "
              f"{spec.num_experts} LatentMoE experts (latent {spec.latent_size} of hidden {spec.hidden_size}) top-{spec.top_k} "
              f"+ {spec.shared_experts} shared, Block Attention Residuals over blocks of {spec.attn_res_block_layers} layers; "
              f"experts MXFP4, {m.blob_bytes / 1e3:.1f} kB each")
        print(_k3_memory_table(store, a.high_batch) + "\n", flush=True)
    else:
        print(f"model: synthetic Mixtral-format MoE, {spec.num_layers} layers x {spec.num_experts} experts, top-{spec.top_k}, "
              f"hidden {spec.hidden_size}; router locality knobs skew={spec.skew}, topics={spec.topics}, "
              f"topic_strength={spec.topic_strength} (runtime/model/synthetic.py); {m.blob_bytes / 1e6:.2f} MB per expert")
    batches = [1, a.high_batch]
    configs = [("none", "none"), ("lru", "none"), ("lru", "freq")]
    print(f"device tier: {a.device_fraction:.0%} of experts ({'CPU memory standing in for HBM' if not __import__('torch').cuda.is_available() else 'CUDA'}); "
          f"host holds every expert; decoding {a.requests} requests x {a.max_tokens} tokens at batch {batches}\n", flush=True)
    rows = run_regimes(store, batches=batches, configs=configs, device_fraction=a.device_fraction, requests=a.requests,
                       prompt_len=8, max_tokens=a.max_tokens, profile="h200", geometry="kimi-k3", seed=a.seed,
                       out_prefix=os.path.join(os.path.dirname(hf), "regimes"), progress=sys.stderr.isatty())
    print(format_rows(rows))
    print(f"\nmeasured: this machine{' (the device tier is CPU memory, so a load is a memcpy and offloading costs little; measured tok/s mostly shows Python overhead)' if not __import__('torch').cuda.is_available() else ''}.\n"
          f"projected: the recorded routing replayed with Kimi K3-sized bf16 experts (66 MB) on the h200 profile.\n"
          f"table, JSON and plot: {os.path.join(os.path.dirname(hf), 'regimes')}.{{json,png}}\n")
    for b in batches:
        rs = {r["policy"] + ("+" + r["prefetch"] if r["prefetch"] != "none" else ""): r for r in rows if r["batch"] == b}
        best = max((v for k, v in rs.items() if k != "none"), key=lambda r: r["projected"]["tokens_per_s"])
        gain = best["projected"]["tokens_per_s"] / rs["none"]["projected"]["tokens_per_s"]
        verdict = "tiering pays" if gain >= 1.5 else "tiering barely pays" if gain >= 1.1 else "tiering stops paying"
        print(f"batch {b:>3}: {best['unique_experts_per_layer_step']:.1f} of {spec.num_experts} experts needed per layer per "
              f"step; best {best['policy']}{'+' + best['prefetch'] if best['prefetch'] != 'none' else ''} hits "
              f"{best['hit_rate']['device']:.0%} on the device -> {gain:.2f}x the projected tokens/s of loading on "
              f"demand ({verdict})")
    return 0


def _k3_memory_table(store: str, batch: int) -> str:
    """Device bytes the per-sequence caches of ``batch`` sequences take in the K3-shaped model (KDA
    layers: a fixed state; MLA layers: a latent per token) and in the same model with MLA in every
    layer, at growing context; the difference in MXFP4 expert slots the recurrent layers free."""
    import torch

    from .model import MoEConfig
    from .model.moe import kv_bytes_per_token, state_bytes_per_sequence
    from .store import Manifest
    cfg = MoEConfig.from_hf(store)
    full = MoEConfig.from_dict({**__import__("json").load(open(os.path.join(store, "config.json"))),
                                "layer_types": ["full_attention"] * cfg.num_layers})
    dt, stride = torch.bfloat16, Manifest.read(store).blob_stride
    tok, seq, full_tok = kv_bytes_per_token(cfg, dt), state_bytes_per_sequence(cfg, dt), kv_bytes_per_token(full, dt)
    lines = [f"cache of {batch} sequences (bf16 KV, float32 recurrent state; from the per-layer cache specs): "
             f"{len(cfg.linear_layers)} KDA layers {seq:,} B per sequence + {len(cfg.attention_layers)} MLA layers "
             f"{tok:,} B per token, against MLA in all {cfg.num_layers} layers {full_tok:,} B per token",
             f"{'context':>9} {'K3 shape':>12} {'all MLA':>12} {'freed':>12} {'= experts':>10}"]
    for n in (4096, 32768, 131072):
        ours, mla = batch * (n * tok + seq), batch * n * full_tok
        lines.append(f"{n:>9,} {ours / 2**20:>10.1f}Mi {mla / 2**20:>10.1f}Mi {(mla - ours) / 2**20:>10.1f}Mi "
                     f"{max(0, mla - ours) // stride:>10,}")
    return "\n".join(lines)


def cmd_regimes(a) -> int:
    from .regimes import format_rows, run_regimes
    if bool(a.model) == bool(a.synthetic):
        raise CliError("give exactly one of --model STORE_DIR or --synthetic GEOMETRY")
    batches = _batches(a.batch)
    configs = []
    for item in a.policies.split(","):
        p, _, pf = item.partition("+")
        configs.append((p, pf or "none"))
    if a.synthetic:
        # No model: replay a synthetic trace of that geometry (the same numbers, without measuring decode).
        if a.synthetic not in GEOMETRIES:
            raise CliError(f"--synthetic: unknown geometry {a.synthetic!r}; choose one of {', '.join(GEOMETRIES)}")
        L, E, k = GEOMETRIES[a.synthetic]
        tr = generate(SyntheticSpec(num_layers=L, num_experts=E, top_k=k, num_sequences=max(batches) * 2, seq_len=64,
                                    zipf_s=a.zipf, persistence=a.persistence, seed=a.seed))
        results = []
        for p, pf in configs:
            results += replay(tr, ReplayConfig(policy=p, prefetch=pf, device_capacity=str(a.device_fraction),
                                               profile=a.profile, geometry=a.expert_geometry), batches)
        print(format_table(results))
        print()
        print(_footer(results))
        if a.out:
            with open(a.out + ".json", "w") as f:
                json.dump(results, f, indent=1)
        return 0
    rows = run_regimes(a.model, batches=batches, configs=configs, device_fraction=a.device_fraction,
                       requests=a.requests, prompt_len=a.prompt_len, max_tokens=a.max_tokens, profile=a.profile,
                       geometry=a.expert_geometry, seed=a.seed, out_prefix=a.out, progress=sys.stderr.isatty(),
                       cache_bonus=a.cache_bonus, tensor_parallel=a.tensor_parallel,
                       pipeline_parallel=a.pipeline_parallel)
    print(format_rows(rows))
    if a.out:
        print(f"\nwrote {a.out}.json and {a.out}.png")
    return 0

def _budget(text, flag):
    if text is None:
        return None
    if flag == "--device-budget" and str(text).strip().lower() == "auto":
        return "auto"
    from cache_policy.keys import parse_bytes
    try:
        return parse_bytes(text)
    except ValueError:
        raise CliError(f"{flag}: cannot parse {text!r}: give bytes (200000) or a size such as 512MiB or 4GiB") from None


def cmd_plan(a) -> int:
    from .plan import format_plan, plan_layouts
    p = plan_layouts(a.model, gpus=a.gpus, context=a.context, batch=a.batch, profile=a.profile,
                     budget=_budget(a.gpu_memory, "--gpu-memory"), utilization=a.gpu_memory_utilization,
                     trace=a.trace, policy=a.policy, expert_format=a.expert_format)
    print(json.dumps(p, indent=1) if a.json else format_plan(p))
    return 0


def cmd_convert(a) -> int:
    from .model.convert import convert
    rep = convert(a.model, a.out, progress=sys.stderr.isatty(), quantize=a.quantize)
    from .store import Manifest
    m = Manifest.read(a.out)
    print(f"wrote {a.out}: {m.num_layers} MoE layers x {m.num_experts} experts, {m.blob_bytes:,} bytes per expert "
          f"({m.num_layers * m.num_experts * m.blob_stride / 2**20:.1f} MiB of expert files) + dense.safetensors; "
          f"experts {rep.expert_format} ({rep.source})")
    if rep.unread:
        print(f"not read: {len(rep.unread)} checkpoint tensors decoding does not need (a vision tower, multi-token-"
              f"prediction layers...), e.g. {', '.join(rep.unread[:3])}")
    if rep.mean_rel_error is not None:
        print(f"quantization error of expert outputs (||y_q - y|| / ||y||, 8 random inputs, sampled experts): "
              f"mean {rep.mean_rel_error:.4f}, max {rep.max_rel_error:.4f}")
    return 0


def _runtime_config(a, max_active="args"):
    """The command line's runtime configuration (runtime/config.py), validated once. ``max_active``:
    the value to configure (generate applies --max-active to its own batch: RuntimeConfig.engine)."""
    from .config import RuntimeConfig
    try:
        return RuntimeConfig(model=a.model, device_budget=_budget(a.device_budget, "--device-budget"),
                             kv_cache_budget=_budget(a.kv_cache_budget, "--kv-cache-budget") or 0,
                             host_budget=_budget(a.host_budget, "--host-budget"), policy=a.policy, scope=a.scope,
                             prefetch=a.prefetch, max_batch=a.max_batch, prefill_chunk=a.prefill_chunk,
                             threads=getattr(a, "threads", None), cache_bonus=a.cache_bonus, schedule=a.schedule,
                             max_active=a.max_active if max_active == "args" else max_active,
                             cpu_experts=a.cpu_experts, prefetch_rule=a.prefetch_rule,
                             prefix_caching=not getattr(a, "no_prefix_caching", False),
                             prefix_snapshots=getattr(a, "prefix_snapshots", None),
                             profile=a.profile, host_act_quant=getattr(a, "host_act_quant", "none"),
                             dense_quant=getattr(a, "dense_quant", "none"),
                             tensor_parallel=getattr(a, "tensor_parallel", 1),
                             pipeline_parallel=getattr(a, "pipeline_parallel", 1))
    except ValueError as e:
        raise CliError(str(e)) from None


def _resolve_model(a) -> None:
    """--model as a store: a checkpoint folder's cached conversion (runtime/model/store_cache.py)."""
    from .model.store_cache import resolve_model
    try:
        a.model = resolve_model(a.model, quantize=a.quantize, progress=True)
    except ValueError as e:
        raise CliError(str(e)) from None


def cmd_generate(a) -> int:
    from .engine import SamplingParams
    from .tokenizer import Tokenizer
    _resolve_model(a)
    tok = Tokenizer(a.model)
    if a.prompt_ids and a.prompt:
        raise CliError("give --prompt or --prompt-ids, not both")
    if a.prompt_ids:
        prompts = []
        for text in a.prompt_ids:
            try:
                prompts.append([int(x) for x in text.split(",")])
            except ValueError:
                raise CliError(f"--prompt-ids: {text!r} is not a comma-separated list of integers") from None
    elif a.prompt is not None:
        prompts = [tok.encode(p) for p in a.prompt]
    else:
        raise CliError("give --prompt TEXT (repeatable) or --prompt-ids 1,2,3")
    cfg = _runtime_config(a, max_active=None)
    group = None
    if cfg.tensor_parallel * cfg.pipeline_parallel > 1:          # ranks 1..N-1 start here (or under torchrun: they never return)
        from .parallel.group import Group
        group = Group(cfg)
        try:
            model, store = group.load(progress=sys.stderr.isatty())
        except BaseException:
            group.close()
            raise
    else:
        model, store = cfg.load(progress=sys.stderr.isatty())
    try:
        # generate knows its batch: no more sequences than prompts run at once
        kw = dict(max_batch=len(prompts), max_active=a.max_active)
        eng = group.make_engine(model, store, **kw) if group is not None else cfg.engine(model, store, **kw)
        params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                                seed=a.seed)
        ids = [eng.add_request(p, params) for p in prompts]
        eng.run()
        for i in ids:
            r = eng.done[i]
            print(tok.decode(r.output) if not a.json else json.dumps({"id": i, "tokens": r.output,
                                                                       "text": tok.decode(r.output),
                                                                       "finish_reason": r.finish_reason}))
        summ = eng.summary()
        if a.trace_out:
            eng.trace().save(a.trace_out)
        print(json.dumps(summ) if a.json else
              f"\n[{summ['generated_tokens']} tokens in {summ['seconds']:.2f} s, {summ['tokens_per_s']:.1f} tok/s; "
              f"device hit rate {summ['hit_rate_device']:.3f}; stalled {summ['stall_seconds']:.3f} s; "
              f"device tier: {'CPU memory standing in for HBM' if summ['device_is_stand_in'] else store.device}]",
              file=sys.stderr if not a.json else sys.stdout)
    finally:
        store.close()
        if group is not None:
            group.close()
    return 0


def cmd_serve(a) -> int:
    import signal
    import threading
    from .serve.api import Server
    from .serve.client import EngineError
    key = a.api_key
    if a.api_key_file:
        if key is not None:
            raise CliError("give --api-key or --api-key-file, not both")
        try:
            with open(a.api_key_file) as f:
                key = f.readline().strip()
        except OSError as e:
            raise CliError(f"--api-key-file {a.api_key_file!r}: {e.strerror}") from None
        if not key:
            raise CliError(f"--api-key-file {a.api_key_file!r}: the first line is empty")
    elif key is None and "TIERED_MOE_API_KEY" in os.environ:
        key = os.environ["TIERED_MOE_API_KEY"].strip()
        if not key:
            raise CliError("TIERED_MOE_API_KEY is set but empty: set a key, or unset it to serve without one")
    if key is not None and not key:
        raise CliError("--api-key is empty")
    given = a.model
    _resolve_model(a)
    if a.model != given and a.served_model_name is None:     # a checkpoint folder: clients see its name
        a.served_model_name = os.path.basename(os.path.abspath(given).rstrip(os.sep))
    if key is None and a.host not in ("127.0.0.1", "localhost", "::1") and not a.host.startswith("127."):
        print(f"tiered-moe: WARNING: binding {a.host} without an API key: anyone who can reach this address can use "
              f"the model (set TIERED_MOE_API_KEY or --api-key-file)", file=sys.stderr)
    cfg = _runtime_config(a)
    stop = threading.Event()

    class _Stopped(BaseException):
        pass

    def on_signal(signum, frame):
        # while the engine loads (minutes for a real model) a signal unwinds Server(): the engine client kills
        # the engine and removes its sockets' folder; once serving, it ends the wait below
        if srv_ready.is_set():
            stop.set()
        else:
            raise _Stopped()
    srv_ready = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    srv = None
    try:
        srv = Server(cfg, host=a.host, port=a.port, api_key=key, served_model_name=a.served_model_name,
                     startup_timeout=a.startup_timeout, timeout=a.timeout, heartbeat_timeout=a.heartbeat_timeout,
                     allowed_hosts=a.allowed_host)
        srv_ready.set()
    except EngineError as e:
        raise CliError(str(e)) from None
    except _Stopped:
        if srv is not None:
            srv.close()
        print("tiered-moe: stopped while the engine was starting", file=sys.stderr)
        return 0
    srv.start()
    print(f"tiered-moe: serving {srv.model_name!r} at {srv.url}/v1 (metrics at {srv.url}/metrics; chat template: "
          f"{srv.chat.source}); Ctrl-C stops", file=sys.stderr, flush=True)
    try:
        stop.wait()
    finally:
        srv.close()
    print("tiered-moe: stopped", file=sys.stderr)
    return 0


def _apply_threads(a) -> None:
    n = getattr(a, "threads", None)
    if n is None:
        return
    if n < 1:
        raise CliError(f"--threads must be at least 1, got {n}")
    import torch
    torch.set_num_threads(n)


def build_parser() -> argparse.ArgumentParser:
    from .cli_args import build_parser as build
    return build({"demo": cmd_demo, "regimes": cmd_regimes, "replay": cmd_replay, "convert": cmd_convert,
                  "generate": cmd_generate, "serve": cmd_serve, "plan": cmd_plan, "trace stats": cmd_trace_stats,
                  "prefetch fit": cmd_prefetch_fit})


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        _apply_threads(args)
        return args.func(args)
    except (ValueError, CliError) as e:
        print(f"tiered-moe: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
