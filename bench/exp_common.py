"""Shared by the experiment scripts (bench/exp_*.py): inputs, parallel runs, report files."""
import json
import os
import platform
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
SHARED = os.environ.get("TIERED_MOE_SHARED", os.path.join(os.path.dirname(ROOT), "shared"))
RESULTS = os.path.join(HERE, "results")

from cache_policy.traces import Trace, load_trace  # noqa: E402


def shared_trace(name: str) -> Trace:
    path = os.path.join(SHARED, "traces", name)
    if not os.path.exists(path):
        raise SystemExit(f"{path} is missing: the experiments read ../shared/traces (or TIERED_MOE_SHARED)")
    return load_trace(path)


def subset(tr: Trace, *, sequences: "int | None" = None, max_len: "int | None" = None, start: int = 0) -> Trace:
    """Sequences [start, start + sequences) of a trace, each cut to its first ``max_len`` tokens."""
    offs = tr.seq_offsets
    stop = tr.num_sequences if sequences is None else min(tr.num_sequences, start + sequences)
    parts, wparts, lens = [], [], []
    for s in range(start, stop):
        a, b = int(offs[s]), int(offs[s + 1])
        if max_len:
            b = min(b, a + max_len)
        parts.append(tr.ids[a:b])
        if tr.weights is not None:
            wparts.append(tr.weights[a:b])
        lens.append(b - a)
    return Trace(ids=np.concatenate(parts), seq_offsets=np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
                 num_experts=tr.num_experts, weights=np.concatenate(wparts) if wparts else None, model=tr.model,
                 layer_numbers=tr.layer_numbers, source=f"{tr.source} sequences {start}..{stop - 1}"
                 + (f", first {max_len} tokens each" if max_len else ""))


def parser(*, jobs: bool = False, workdir: bool = False, device_fraction: bool = False):
    """The flags every experiment takes: --quick, --outdir (and --jobs / --workdir / --device-fraction)."""
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="a small version of the experiment (seconds)")
    ap.add_argument("--outdir", default=RESULTS, help="where the .md, .json and .png go")
    if jobs:
        ap.add_argument("--jobs", type=int, default=2, help="processes for the replays")
    if workdir:
        from exp_live_common import DEFAULT_WORKDIR
        ap.add_argument("--workdir", default=DEFAULT_WORKDIR, help="where the live demo model is built")
    if device_fraction:
        ap.add_argument("--device-fraction", type=float, default=0.25, help="device tier, fraction of experts")
    return ap


def pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def pmap(fn, jobs, n_jobs: int = 2, desc: str = "runs"):
    """fn over jobs in n_jobs processes, with a progress bar; results in job order."""
    from tqdm import tqdm
    if n_jobs <= 1:
        return [fn(j) for j in tqdm(jobs, desc=desc, unit="run", file=sys.stderr)]
    import multiprocessing as mp
    with mp.get_context("fork").Pool(n_jobs) as pool:
        return list(tqdm(pool.imap(fn, jobs), total=len(jobs), desc=desc, unit="run", file=sys.stderr))


def machine() -> str:
    import torch
    return (f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, torch {torch.__version__}, "
            f"{'CUDA' if torch.cuda.is_available() else 'no GPU'}")


class Report:
    """Collects markdown, writes <name>.md + <name>.json (+ PNGs written by the caller) in outdir."""

    def __init__(self, name: str, outdir: str, command: str, title: str, started: "float | None" = None) -> None:
        os.makedirs(outdir, exist_ok=True)
        self.name, self.outdir, self.t0 = name, outdir, started or time.time()
        self.lines = [f"# {title}", "", f"Command: `{command}`", "", f"Machine: {machine()}.", ""]
        self.data: dict = {"command": command}

    def path(self, suffix: str) -> str:
        return os.path.join(self.outdir, f"{self.name}{suffix}")

    def add(self, *lines: str) -> None:
        self.lines.extend(lines)

    def table(self, header: list, rows: list) -> None:
        self.lines.append("| " + " | ".join(header) + " |")
        self.lines.append("|" + "---|" * len(header))
        for r in rows:
            self.lines.append("| " + " | ".join(_fmt(x) for x in r) + " |")
        self.lines.append("")

    def figure(self, fig, suffix: str, caption: str) -> str:
        path = self.path(suffix)
        fig.savefig(path, dpi=110)
        import matplotlib.pyplot as plt
        plt.close(fig)
        self.lines += [f"![{caption}]({os.path.basename(path)})", ""]
        return path

    def finish(self, fig, caption: str) -> "Report":
        """The report's plot (<name>.png) and files; what every experiment ends with."""
        fig.tight_layout()
        self.figure(fig, ".png", caption)
        self.write()
        return self

    def write(self) -> str:
        self.add(f"Run time: {time.time() - self.t0:.0f} s.", "")
        with open(self.path(".md"), "w") as f:
            f.write("\n".join(self.lines))
        with open(self.path(".json"), "w") as f:
            json.dump(self.data, f, indent=1, default=float)
        print(f"wrote {self.path('.md')}", file=sys.stderr)
        return self.path(".md")


def _fmt(x) -> str:
    if isinstance(x, float):
        return f"{x:.3f}" if abs(x) < 1000 else f"{x:,.0f}"
    return str(x)


def generate_rate(p, what: str) -> float:
    """Decode tokens/s of a finished ``tiered-moe generate --json`` process (subprocess.run's result, text
    mode): its last JSON line's ``decode_tokens_per_s``; raises with the stderr tail if it failed."""
    if p.returncode:
        raise RuntimeError(f"{what}: generate failed:\n{p.stderr[-2000:]}")
    return json.loads([x for x in p.stdout.splitlines() if x.startswith("{")][-1])["decode_tokens_per_s"]


def write_markdown(out: str, lines: list) -> str:
    """A results file: ``lines`` joined, written to ``out`` (its folder made) and printed; the text."""
    text = "\n".join(lines)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        f.write(text + "\n")
    print(text)
    return text
