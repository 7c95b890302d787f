"""A model bigger than the memory it is given, on a CPU-only machine (issue 29): ours and llama.cpp's mmap.

Writes a synthetic Mixtral-format checkpoint layer by layer in bf16 (``--shape``: ``small``, hidden 1024, 8 layers x
128 experts, top-8, moe intermediate 768: 4.6 GB; ``large``, issue 29's Qwen3-MoE-sized hidden 2048 with the same
experts: 10 GB; never whole in memory), converts it to int4 experts (1.3 / 3.0 GB store), then decodes at batch 1 in
fresh children, interleaved over ``--rounds``, each under a memory limit set with the kernel's cgroup memory
controller (v2 ``memory.max`` or v1 ``memory.limit_in_bytes``; page cache counted) and optionally a read-bandwidth
limit on the store's disk (v2 ``io.max`` rbps, v1 ``blkio.throttle.read_bps_device``). ``--runs`` picks from:

- ``default``: no budget flag (on a machine without a GPU, one memory sized by ``--host-budget auto``), with no
  limit, under each limit, and under each limit with the disk throttled;
- ``fast``: the default with ``--dense-quant int4`` (our best: the dense projections 4-bit too, as llama.cpp's
  Q4_0 file has them; 8-bit activations are the default since issue 30);
- ``lookahead``: the default with ``--prefetch lookahead`` (layer m+1's predicted experts read from disk while
  layer m computes), under each limit, with and without the throttle;
- ``misses``: ``--host-budget`` of ``--misses-budget`` (most expert uses read from disk), with no limit and with
  the throttle: the disk's read rate during decode against its O_DIRECT rate measured just before in the same
  cgroup (host_tier.disk_read_rate, as ``plan --gpus 0`` measures it);
- ``stand-in``: ``--device-budget auto`` (a device stand-in tier in the same RAM: the CPU default before issue
  29), with no limit and under each limit.

Reports decode tok/s (best round), the ratio to the unlimited default, expert uses served from disk, MB read
per generated token, the read rate during decode, the child's peak RSS and the cgroup's peak usage, and whether
the kernel killed it. ``--llama``: llama.cpp's ``llama-bench`` on the same weights (a stock Q4_0 GGUF from its
own converter; built from the llama-cpp-python sdist as bench/vs_llama_cpp.py does, which needs a C compiler,
cmake and the ``sentencepiece`` and ``tokenizers`` packages), its default and ``--repack 0``, with no limit, under
each limit and under each limit with the throttle. Needs root (it makes cgroups).

Usage: python bench/bigger_than_memory.py [--shape small|large] [--workdir DIR] [--limits 1536MiB,1GiB]
       [--throttle-mbps 150] [--rounds 2] [--runs default,fast,...] [--llama] [--out FILE.md]
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MiB = 2 ** 20

from exp_common import write_markdown  # noqa: E402 (bench/: results files)


class Cgroup:
    """A memory (+ read bandwidth) limited cgroup for children: v2 where the unified hierarchy has the memory
    controller, else v1's memory and blkio hierarchies, made under this process's own cgroups."""

    def __init__(self, name: str, memory: "int | None", read_bps: "int | None", dev: str) -> None:
        self.dirs, self.memory = [], memory
        own = {}
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, ctl, path = line.strip().split(":", 2)
                for c in (ctl.split(",") if ctl else [""]):
                    own[c] = path
        root = "/sys/fs/cgroup"
        v2 = os.path.exists(f"{root}/cgroup.controllers") and "memory" in open(f"{root}/cgroup.controllers").read()
        if v2:
            d = f"{root}{own['']}/{name}".replace("//", "/")
            os.makedirs(d, exist_ok=True)
            self._write(d, "memory.max", str(memory) if memory else "max")
            self._write(d, "memory.swap.max", "0", optional=True)
            if read_bps:
                self._write(d, "io.max", f"{dev} rbps={read_bps}")
            self.dirs, self.peak_file, self.v = [d], f"{d}/memory.peak", 2
        else:
            m = f"{root}/memory{own.get('memory', '/')}/{name}".replace("//", "/")
            os.makedirs(m, exist_ok=True)
            self._write(m, "memory.limit_in_bytes", str(memory) if memory else "-1")
            self._write(m, "memory.memsw.limit_in_bytes", str(memory) if memory else "-1", optional=True)
            self._write(m, "memory.max_usage_in_bytes", "0")
            self.dirs, self.peak_file, self.v = [m], f"{m}/memory.max_usage_in_bytes", 1
            b = f"{root}/blkio{own.get('blkio', '/')}/{name}".replace("//", "/")
            os.makedirs(b, exist_ok=True)
            self._write(b, "blkio.throttle.read_bps_device", f"{dev} {read_bps or 0}")
            self.dirs.append(b)

    @staticmethod
    def _write(d: str, name: str, value: str, optional: bool = False) -> None:
        try:
            with open(f"{d}/{name}", "w") as f:
                f.write(value)
        except OSError:
            if not optional:
                raise

    def join(self) -> None:          # in the child, before exec
        for d in self.dirs:
            with open(f"{d}/cgroup.procs", "w") as f:
                f.write(str(os.getpid()))

    def reset_peak(self) -> None:
        if self.v == 1:
            self._write(self.dirs[0], "memory.max_usage_in_bytes", "0")

    def peak(self) -> "int | None":
        try:
            return int(open(self.peak_file).read().split()[0])
        except (OSError, ValueError):
            return None

    def close(self) -> None:
        for d in self.dirs:
            try:
                os.rmdir(d)
            except OSError:
                pass


def disk_of(path: str) -> str:
    """major:minor of the whole disk holding ``path`` (a partition's parent) for the throttle files."""
    st = os.stat(path).st_dev
    sysdir = os.path.realpath(f"/sys/dev/block/{os.major(st)}:{os.minor(st)}")
    if os.path.exists(os.path.join(sysdir, "partition")):
        sysdir = os.path.dirname(sysdir)
    return open(os.path.join(sysdir, "dev")).read().strip()


def evict(paths: list) -> None:
    """Drop the files' clean pages from the page cache (posix_fadvise DONTNEED): a run then faults its weights in
    itself, charged to its own cgroup, instead of finding them cached - and charged - elsewhere."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def files_dir(files: list) -> str:
    return os.path.dirname(files[0])


def store_files(store: str) -> list:
    return [os.path.join(store, f) for f in os.listdir(store) if os.path.isfile(os.path.join(store, f))]


def run_child(cmd: list, cg: "Cgroup | None") -> dict:
    """Run cmd (in ``cg``): its summary line, the cgroup's peak and how it ended (the kernel's SIGKILL: 137
    through the wrapper)."""
    if cg is not None:
        cg.reset_peak()
    t0 = time.time()
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=cg.join if cg is not None else None)
    out, err = p.communicate()
    res = {"rc": p.returncode, "seconds": time.time() - t0, "peak_cgroup": cg.peak() if cg is not None else None,
           "killed": p.returncode in (-9, 137), "err": err[-1500:], "out": out}
    lines = [x for x in out.strip().splitlines() if x.startswith("{")]
    res["summary"] = json.loads(lines[-1]) if p.returncode == 0 and lines else None
    return res


def rss_wrapper(cmd: list) -> list:
    """cmd run under a small Python wrapper that prints its peak RSS (ru_maxrss of that child alone) to stderr:
    the wrapper itself stays outside any accounting that matters (a few MiB, in the same cgroup)."""
    code = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
            "sys.stderr.write('\\nPEAK_RSS %d\\n' % (resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)); "
            "sys.exit(r.returncode if r.returncode >= 0 else 128 - r.returncode)")
    return [sys.executable, "-c", code, *cmd]


DEFAULT = "default (one memory, --host-budget auto)"
MISSES = "misses dominate: --host-budget {} (most expert uses read from disk)"
LOOKAHEAD = ("default + --prefetch lookahead (reads layer m+1's predicted experts while layer m computes)",
             ["--prefetch", "lookahead"])
FAST = ("default + --dense-quant int4 (our best: attention and head quantized too, as in llama.cpp's Q4_0 file)",
        ["--dense-quant", "int4"])
STAND_IN = ("--device-budget auto (device stand-in tier: the CPU default before)", ["--device-budget", "auto"])


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", default=None, help="checkpoints, stores and GGUFs (cached between runs; default: "
                                                    "tiered-moe-bench-btm-SHAPE in the temp dir)")
    ap.add_argument("--limits", default="1536MiB,1GiB", help="memory limits (cgroup), comma-separated")
    ap.add_argument("--throttle-mbps", type=float, default=150.0, help="disk read limit of the throttled runs (0: none)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "bigger_than_memory.md"))
    ap.add_argument("--llama", action="store_true", help="llama.cpp on the same weights under the same limits too")
    ap.add_argument("--llama-cache", default=os.path.expanduser("~/.cache/tiered-moe/llama.cpp"))
    ap.add_argument("--shape", choices=sorted(SHAPES), default="small", help="the checkpoint (see the module doc)")
    ap.add_argument("--runs", default=",".join(RUNS), help=f"our runs, comma-separated, of {', '.join(RUNS)}")
    ap.add_argument("--misses-budget", default="32MiB", help="--host-budget of the 'misses' runs")
    a = ap.parse_args()
    a.runs = [r for r in a.runs.split(",") if r]
    bad = sorted(set(a.runs) - set(RUNS))
    if bad:
        ap.error(f"--runs: {', '.join(bad)} not among {', '.join(RUNS)}")
    if a.workdir is None:
        a.workdir = os.path.join(tempfile.gettempdir(), f"tiered-moe-bench-btm-{a.shape}")
    return a


# --shape -> the synthetic checkpoint's sizes (SyntheticModelSpec fields) and its description
SHAPES = {
    "small": (dict(hidden_size=1024, intermediate_size=768, num_layers=8, num_experts=128, top_k=8, vocab_size=512,
                   num_heads=8, num_kv_heads=2), "hidden 1024, 8 layers x 128 experts, top-8, moe intermediate 768"),
    # issue 29's Qwen3-MoE-sized model (10 GB in bf16): its hidden size, layers, experts and top-k, 16 heads of 128
    "large": (dict(hidden_size=2048, intermediate_size=768, num_layers=8, num_experts=128, top_k=8, vocab_size=512,
                   num_heads=16, num_kv_heads=4), "hidden 2048, 8 layers x 128 experts, top-8, moe intermediate 768 "
                                                  "(issue 29's Qwen3-MoE-sized model)"),
}
RUNS = ("default", "fast", "lookahead", "misses", "stand-in")


def model(workdir: str, shape: str = "small"):
    """(spec, hf dir, store dir): the checkpoint written layer by layer in bf16 and its int4 store (cached)."""
    import torch
    from runtime.model.synthetic import SyntheticModelSpec, build_checkpoint
    spec = SyntheticModelSpec(**SHAPES[shape][0])
    hf, store = os.path.join(workdir, "hf"), os.path.join(workdir, "store")
    if not os.path.exists(os.path.join(hf, "config.json")):
        print(f"writing the {shape} checkpoint into {hf} (layer by layer)", flush=True)
        build_checkpoint(hf, spec, dtype=torch.bfloat16, shard_by_layer=True)
    if not os.path.exists(os.path.join(store, "manifest.json")):
        shutil.rmtree(store, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "runtime.cli", "convert", "--model", hf, "--out", store, "--quantize",
                        "int4"], cwd=ROOT, check=True)
    return spec, hf, store


def configs_for(limits: list, throttle: float, runs: list, misses_budget: str) -> list:
    """(name, memory limit, disk MB/s, extra flags) of every run, in the order of a round."""
    misses = (MISSES.format(misses_budget), ["--host-budget", misses_budget])
    want = {"default": (DEFAULT, []), "fast": FAST, "lookahead": LOOKAHEAD, "stand-in": STAND_IN, "misses": misses}
    out = [(want[r][0], None, None, want[r][1]) for r in ("default", "fast", "stand-in", "misses") if r in runs]
    if "misses" in runs and throttle:
        out.append((misses[0], None, throttle, misses[1]))
    for lim in limits:
        out += [(want[r][0], lim, None, want[r][1]) for r in ("default", "fast", "lookahead") if r in runs]
        if throttle:
            out += [(want[r][0], lim, throttle, want[r][1]) for r in ("default", "lookahead") if r in runs]
        if "stand-in" in runs:
            out.append((STAND_IN[0], lim, None, STAND_IN[1]))
    return out


RATE_PROBE = ("import json, sys; from runtime.store import Manifest; from runtime.store.host_tier import disk_read_rate; "
              "print(json.dumps(disk_read_rate(sys.argv[1], Manifest.read(sys.argv[1]), seconds=2.0)))")


def run_rounds(configs: list, gen: list, dev: str, rounds: int, files: list) -> dict:
    """Every config once per round, interleaved; index -> its results."""
    results = {i: [] for i in range(len(configs))}
    for r in range(rounds):
        for i, (name, lim, mbps, extra) in enumerate(configs):
            cg = Cgroup(f"tmbench{i}", lim, int(mbps * 1e6) if mbps else None, dev) if (lim or mbps) else None
            try:
                probe = None
                if name.startswith("misses"):     # the disk's O_DIRECT rate just before, in the same cgroup
                    evict(files)
                    probe = run_child([sys.executable, "-c", RATE_PROBE, files_dir(files)], cg)
                evict(files)
                res = run_child(rss_wrapper(gen + extra), cg)
                if probe is not None and probe["rc"] == 0:
                    res["disk_Bps"] = json.loads(probe["out"].strip().splitlines()[-1])[0]
            finally:
                if cg is not None:
                    cg.close()
            peak = [int(x.split()[1]) for x in res["err"].splitlines() if x.startswith("PEAK_RSS")]
            res["peak_rss"] = peak[-1] if peak else None
            results[i].append(res)
            print(f"round {r + 1}: {name} limit={lim} throttle={mbps}: rc {res['rc']} "
                  f"{(res['summary'] or {}).get('decode_tokens_per_s', 0):.1f} tok/s", flush=True)
    return results


def our_rows(configs: list, results: dict) -> "tuple[list, float]":
    """Table rows of our runs (best round each) and the reference tok/s (the first row's)."""
    rows, ref = [], None
    for i, (name, lim, mbps, _) in enumerate(configs):
        ok = [x for x in results[i] if x["summary"] is not None]
        if not ok:
            errs = [x for x in results[i][-1]["err"].strip().splitlines() if x and not x.startswith("PEAK_RSS")]
            why = "killed by the kernel (out of memory)" if any(x["killed"] for x in results[i]) else \
                (errs[-1][:240] if errs else "failed")
            rows.append(f"| {name} | {_lim(lim)} | {_mbps(mbps)} | - | - | - | - | - | - | {why} |")
            ref = ref or 0.0
            continue
        s = max(ok, key=lambda x: x["summary"]["decode_tokens_per_s"])["summary"]
        tps = s["decode_tokens_per_s"]
        ref = ref or tps
        need = sum(s["hits"].values()) or 1
        best = max(ok, key=lambda x: x["summary"]["decode_tokens_per_s"])
        read = s["bytes"]["disk_to_host"]
        rate = s["decode_bytes"]["disk_to_host"] / max(1e-9, s["decode_seconds"]) / 1e6
        disk = f" of {best['disk_Bps'] / 1e6:.0f} ({rate / (best['disk_Bps'] / 1e6):.0%})" if best.get("disk_Bps") else ""
        each = "/".join(f"{x['summary']['decode_tokens_per_s']:.1f}" for x in ok)
        rows.append(f"| {name} | {_lim(lim)} | {_mbps(mbps)} | {tps:.1f} ({each}) | {tps / ref:.2f}x | "
                    f"{s['hits']['disk'] / need:.3f} | {read / max(1, s['generated_tokens']) / 1e6:.2f} | {rate:.0f}{disk} | "
                    f"{max(x['peak_rss'] or 0 for x in ok) / MiB:.0f} / "
                    f"{(max(x['peak_cgroup'] or 0 for x in ok) / MiB) if lim else 0:.0f} | "
                    f"{sum(x['killed'] for x in results[i])} of {len(results[i])} runs killed |")
    return rows, ref


def main():
    a = parse_args()
    sys.path.insert(0, ROOT)
    sys.path.insert(0, HERE)
    from runtime.cli_args import parse_bytes
    from runtime.store import Manifest
    os.makedirs(a.workdir, exist_ok=True)
    spec, hf, store = model(a.workdir, a.shape)
    m = Manifest.read(store)
    experts = m.num_layers * m.num_experts * m.blob_stride
    dev = disk_of(store)
    gen = [sys.executable, "-m", "runtime.cli", "generate", "--model", store, "--max-tokens", str(a.max_tokens),
           "--json", "--prompt-ids", ",".join(str((61 * i) % 512) for i in range(1, 17))]
    limits = [parse_bytes(x) for x in a.limits.split(",") if x]
    configs = configs_for(limits, a.throttle_mbps, a.runs, a.misses_budget)
    rows, ref = our_rows(configs, run_rounds(configs, gen, dev, a.rounds, store_files(store)))
    if a.llama:
        try:
            rows += llama_rows(a, hf, spec.vocab_size, dev, limits, ref)
        except Exception as e:  # noqa: BLE001 - our rows are kept; the table says why llama.cpp has none
            rows.append(f"| llama.cpp | - | - | - | - | - | - | - | - | could not run: {str(e).splitlines()[0][:200]} |")
    write_markdown(a.out, [
        "# A model bigger than the memory it is given (CPU only)",
        "",
        f"Command: `python bench/bigger_than_memory.py {' '.join(sys.argv[1:])}` ({os.cpu_count()} cores). Model: "
        f"synthetic Mixtral-format, {SHAPES[a.shape][1]}; written in "
        f"bf16 layer by layer, int4 experts ({m.blob_stride / MiB:.2f} MiB each, {experts / MiB:.0f} MiB in all). One "
        f"prompt of 16 tokens, {a.max_tokens} generated, batch 1, best of {a.rounds} interleaved rounds. Limits: "
        f"the cgroup memory controller (page cache counted); throttle: the cgroup's read bandwidth limit on {dev}.",
        "",
        "| run | memory limit | disk limit | decode tok/s best (each round) | vs the default with no limit | expert uses from disk | "
        "MB read / token | read MB/s during decode (of the disk's O_DIRECT rate) | peak RSS / cgroup peak MiB | ended |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *rows,
    ])


def llama_rows(a, hf: str, vocab: int, dev: str, limits: list, ref: float) -> list:
    """llama.cpp on the same weights (stock Q4_0 GGUF through its own converter and quantizer, bench/vs_llama_cpp.py's
    build from the llama-cpp-python sdist), batch-1 decode of ``--max-tokens`` by llama-bench with 2 threads, with no
    limit and under each limit (the same cgroups): its default (mmap, CPU repack) and ``--repack 0`` (the weights
    stay in the page cache, mmap'd). Rows of the results table."""
    import vs_llama_cpp as V
    tree, bindir = V.llama_tree(None, a.llama_cache)
    cfg = json.load(open(os.path.join(hf, "tokenizer_config.json"))) if os.path.exists(
        os.path.join(hf, "tokenizer_config.json")) else {}
    if cfg.get("tokenizer_class") != "Qwen2Tokenizer":      # the converter reads a Qwen2-style BPE: give it one
        V.build_tokenizer(hf, vocab)
    gguf = V.ggufs(tree, bindir, hf, a.workdir, f"btm-{a.shape}" if a.shape != "small" else "btm", ["int4"])["int4"]
    size = os.path.getsize(gguf)
    rows = []
    runs = [(lim, None) for lim in [None] + limits] + [(lim, a.throttle_mbps) for lim in limits if a.throttle_mbps]
    for lim, mbps in runs:
        for name, extra in (("llama.cpp default (mmap + CPU repack)", []), ("llama.cpp --repack 0 (mmap only)",
                                                                           ["--repack", "0"])):
            cg = Cgroup("tmllama", lim, int(mbps * 1e6) if mbps else None, dev) if lim else None
            try:
                evict([gguf])
                res = run_child(rss_wrapper([os.path.join(bindir, "llama-bench"), "-m", gguf, "-p", "0", "-n",
                                             str(a.max_tokens), "-t", "2", "-r", "2", "-o", "json", *extra]), cg)
            finally:
                if cg is not None:
                    cg.close()
            peak = [int(x.split()[1]) for x in res["err"].splitlines() if x.startswith("PEAK_RSS")]
            if res["rc"] != 0:
                errs = [x for x in res["err"].strip().splitlines() if x and not x.startswith("PEAK_RSS")]
                why = "killed by the kernel (out of memory)" if res["killed"] else (errs[-1][:200] if errs else "failed")
                rows.append(f"| {name} ({size / MiB:.0f} MiB Q4_0 GGUF) | {_lim(lim)} | {_mbps(mbps)} | - | - | - | - | - | - | "
                            f"{why} |")
                continue
            got = [r for r in json.loads(res["out"]) if r.get("n_gen") == a.max_tokens]
            tps = float(got[0]["avg_ts"]) if got else 0.0
            rows.append(f"| {name} ({size / MiB:.0f} MiB Q4_0 GGUF) | {_lim(lim)} | {_mbps(mbps)} | {tps:.1f} | "
                        f"{tps / ref if ref else 0:.2f}x "
                        f"| - | - | - | "
                        f"{(peak[-1] if peak else 0) / MiB:.0f} / {(res['peak_cgroup'] or 0) / MiB:.0f} | ran |")
            print(rows[-1], flush=True)
    return rows


def _lim(lim):
    return f"{lim / MiB:.0f} MiB" if lim else "none"


def _mbps(v):
    return f"{v:.0f} MB/s" if v else "none"


if __name__ == "__main__":
    main()
