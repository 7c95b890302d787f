"""The ``tiered-moe`` command.

Replay and trace commands only need ``cache_policy`` (numpy); nothing here imports torch, so
they start fast. The commands that load a model live in runtime/cli_model.py, imported when one runs;
the arguments and their parsing in runtime/cli_args.py.
"""
from __future__ import annotations

import argparse
import json
import sys

from cache_policy import cost_model as cm
from cache_policy.layout import Layout, project
from cache_policy.prefetch import TransitionPrefetcher
from cache_policy.replay import ReplayConfig, replay
from cache_policy.spec_replay import SpecConfig, format_spec_table, speculative_replay
from cache_policy.speculation import Acceptance, DraftCost
from cache_policy.synthetic import GEOMETRIES, SyntheticSpec, generate
from cache_policy.traces import format_stats, load_trace, trace_stats

from .cli_args import CliError, parse_batches
from .cli_args import build_parser as build_args


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
        ("pf stall ms/tok", lambda r: f"{r['projected']['prefetch_stall_ms_per_token']:.2f}"
                                      f" ({r['projected']['prefetch_stall_ms_per_token_after_combine']:.2f})"),
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
            f"experts computed on the host CPU without a transfer (--cpu-experts); pf stall = link time of "
            f"prefetches no compute hides, issued when the layer before routes (in brackets: issued only after its "
            f"experts are combined)")


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
    if a.speculative:
        return _replay_speculative(a, trace, fit)
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
        rs = replay(trace, cfg, parse_batches(a.batch), progress=prog)
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


def _replay_speculative(a, trace, fit) -> int:
    """replay --speculative: one row per policy, CPU-experts choice and batch (cache_policy/spec_replay.py)."""
    spec = SpecConfig(acceptance=Acceptance.parse(a.acceptance), k_max=a.num_speculative_tokens, rule=a.spec_rule,
                      draft=DraftCost.parse(a.draft_cost), seed=a.spec_seed,
                      rejected=a.rejected_routing)
    results = []
    for policy in a.policy.split(","):
        for cpu in a.cpu_experts.split(","):
            cfg = ReplayConfig(policy=policy, scope=a.scope, device_capacity=a.device_capacity,
                               host_capacity=a.host_capacity, prefetch=a.prefetch, profile=a.profile, dtype=a.dtype,
                               geometry=a.expert_geometry, expert_bytes=a.expert_bytes, fit_trace=fit, cpu_experts=cpu)
            for b in parse_batches(a.batch):
                r = speculative_replay(trace, cfg, b, spec)
                results.append(r)
                if a.json:
                    print(json.dumps(r), flush=True)
    if not a.json:
        print(format_spec_table(results))
        r = results[0]
        print(f"\ntrace: {r['trace']} ({r['tokens']:,} tokens); expert: {r['expert_bytes'] / 1e6:.1f} MB - "
              f"{r['expert_size_source']}; profile: {r['profile']}; acceptance {a.acceptance}, draft {spec.draft}, "
              f"rejected drafts routed as: {spec.rejected}\n"
              f"tokens/s are cost-model projections of expert compute and transfers (attention left out); "
              f"cache_policy/spec_replay.py says how verify steps and rejected drafts are priced")
    return 0


def _layouts(a, trace=None, hidden: "int | None" = None) -> "tuple[list, int | None]":
    """--tensor-parallel / --pipeline-parallel (comma lists) -> the layouts to project and the hidden size
    their all-reduces carry (--hidden, else the geometry's model, else ``hidden``)."""
    tps = parse_batches(getattr(a, "tensor_parallel", None) or "1")
    pps = parse_batches(getattr(a, "pipeline_parallel", None) or "1")
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


def cmd_regimes(a) -> int:
    if bool(a.model) == bool(a.synthetic):
        raise CliError("give exactly one of --model STORE_DIR or --synthetic GEOMETRY")
    batches = parse_batches(a.batch)
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
    return _cli_model().run_regimes_on_model(a, batches, configs)


def _apply_threads(a) -> None:
    n = getattr(a, "threads", None)
    if n is None:
        return
    if n < 1:
        raise CliError(f"--threads must be at least 1, got {n}")
    import torch
    torch.set_num_threads(n)


def _cli_model():
    """runtime/cli_model.py, the commands that load a model: imported when one runs (it imports torch, which
    the replay and trace commands never do: tests/runtime/test_cli.py)."""
    from . import cli_model
    return cli_model


def _model_command(name: str):
    def run(a) -> int:
        return getattr(_cli_model(), name)(a)
    run.__name__ = name
    return run


# The model commands' helpers under the names they had here (tests use them): looked up when asked for.
_MODEL_NAMES = ("cmd_demo", "_k3_memory_table", "cmd_plan", "cmd_convert", "_runtime_config", "_resolve_model",
                "cmd_generate", "cmd_serve")


def __getattr__(name: str):
    if name in _MODEL_NAMES:
        return getattr(_cli_model(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def build_parser() -> argparse.ArgumentParser:
    return build_args({"demo": _model_command("cmd_demo"), "regimes": cmd_regimes, "replay": cmd_replay,
                       "convert": _model_command("cmd_convert"), "generate": _model_command("cmd_generate"),
                       "serve": _model_command("cmd_serve"), "plan": _model_command("cmd_plan"),
                       "trace stats": cmd_trace_stats, "prefetch fit": cmd_prefetch_fit})


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
