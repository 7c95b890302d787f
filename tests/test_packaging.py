"""The package as `pip install .` ships it, used from site-packages only.

The wheel is built from a copy of this tree (what a fresh clone holds: no stale build/ to leak
modules into it), installed NON-editable into a fresh venv (torch pinned to the version these tests
run with, which pip takes from a local wheel where the machine has one; the wheel's other
dependencies from the index), and run from an empty temporary directory with no PYTHONPATH, so
nothing can resolve to the source tree. Checked there: every module of the source packages imports
from site-packages (walked with pkgutil over the installed packages and compared with the source
tree), every non-.py file in the source packages is installed, and the console script runs
`demo --help`, `replay` on a shipped hardware profile, and `convert` + `generate` on a tiny
synthetic checkpoint.
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
from importlib.metadata import version

import pytest
from helpers import ROOT

pytestmark = pytest.mark.slow

PACKAGES = ("runtime", "cache_policy")
SKIP_DIRS = {".git", ".venv", "build", "dist", "__pycache__", ".pytest_cache", ".hypothesis", "tmp"}


def run(args, timeout=600, **kw):
    r = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=timeout, **kw)
    if r.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, args[:5]))} ... exited {r.returncode}:\n"
                             f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r


def tree_files() -> list:
    """The tree's files as a clone with these changes holds them: git's tracked and untracked
    non-ignored files; without git, everything but the usual build and cache folders."""
    try:
        out = subprocess.run(["git", "-C", ROOT, "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             capture_output=True, check=True, timeout=60).stdout.decode()
        return [f for f in out.split("\0") if f]
    except (OSError, subprocess.SubprocessError):
        files = []
        for d, dirs, names in os.walk(ROOT):
            dirs[:] = [x for x in dirs if x not in SKIP_DIRS and not x.endswith(".egg-info")]
            files += [os.path.relpath(os.path.join(d, n), ROOT) for n in names if not n.endswith((".pyc", ".whl"))]
        return files


def source_contents(src: str):
    """Module names of every .py file under the packages, and every other file they hold."""
    modules, data = set(), set()
    for top in PACKAGES:
        for d, dirs, names in os.walk(os.path.join(src, top)):
            dirs[:] = [x for x in dirs if x != "__pycache__"]
            for n in names:
                rel = os.path.relpath(os.path.join(d, n), src)
                if n.endswith(".py"):
                    parts = rel[:-3].split(os.sep)
                    modules.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
                elif not n.endswith(".pyc"):
                    data.add(rel.replace(os.sep, "/"))
    return modules, data


def clean_env(**extra) -> dict:
    """No PYTHONPATH (nothing but the venv's own paths); bytecode written, so that torch is compiled
    once for the several processes below, not in each."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONDONTWRITEBYTECODE")}
    env.update(PYTHONNOUSERSITE="1", **extra)
    return env


def scratch_dir():
    """A tmpfs where there is one with room (the venv is ~1 GB in ~20k files: installing and
    removing it on a slow virtual disk takes minutes), else the default temporary directory."""
    try:
        if os.access("/dev/shm", os.W_OK) and shutil.disk_usage("/dev/shm").free > 4 << 30:
            return "/dev/shm"
    except OSError:
        pass
    return None


def build_isolation() -> list:
    """Build with this interpreter's setuptools where it can make wheels itself (>= 70.1, which
    also meets build-system.requires): no isolated build environment fetched from the index."""
    try:
        return ["--no-build-isolation"] if tuple(map(int, version("setuptools").split(".")[:2])) >= (70, 1) else []
    except Exception:
        return []


@pytest.fixture(scope="module")
def installed():
    """(src copy, venv, empty work dir): the wheel of this tree installed into a fresh venv.
    Removed afterwards (the venv holds a full torch)."""
    tmp = os.path.realpath(tempfile.mkdtemp(prefix="tiered-moe-packaging-", dir=scratch_dir()))
    assert not tmp.startswith(os.path.realpath(ROOT) + os.sep), "the temporary directory is inside the source tree"
    try:
        src = os.path.join(tmp, "src")
        for f in tree_files():
            if os.path.isfile(os.path.join(ROOT, f)):     # deleted but still in the index: skip
                os.makedirs(os.path.dirname(os.path.join(src, f)), exist_ok=True)
                shutil.copy2(os.path.join(ROOT, f), os.path.join(src, f))
        dist = os.path.join(tmp, "dist")
        run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *build_isolation(), "-w", dist, src], cwd=tmp)
        wheels = [os.path.join(dist, w) for w in os.listdir(dist) if w.endswith(".whl")]
        assert len(wheels) == 1, wheels
        venv = os.path.join(tmp, "venv")
        # This interpreter's pip installs into the venv where it can (pip >= 22.3: --python), which
        # spares the venv its own pip. --no-compile: byte-compiling all of torch would double the
        # install; the checks below compile only what they import, once (clean_env).
        own_pip = tuple(map(int, version("pip").split(".")[:2])) < (22, 3)
        run([sys.executable, "-m", "venv", *([] if own_pip else ["--without-pip"]), venv], cwd=tmp)
        pip = [os.path.join(venv, "bin", "python"), "-m", "pip"] if own_pip else \
            [sys.executable, "-m", "pip", "--python", os.path.join(venv, "bin", "python")]
        run([*pip, "install", "-q", "--no-compile", f"torch=={version('torch')}", wheels[0]], cwd=tmp,
            env=clean_env(), timeout=1200)
        work = os.path.join(tmp, "work")
        os.mkdir(work)
        yield src, venv, work
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


WALK = r"""
import importlib, json, os, pkgutil, sys, sysconfig, traceback
root, packages = os.path.realpath(sys.argv[1]), sys.argv[2:]
site = os.path.realpath(sysconfig.get_paths()["purelib"])
on_path = [p for p in sys.path if (os.path.realpath(p or ".") + os.sep).startswith(root + os.sep)]
errors, modules = {}, {}
def failed(name):
    errors[name] = traceback.format_exc()
for top in packages:
    try:
        pkg = importlib.import_module(top)
    except Exception:
        failed(top)
        continue
    names = [top] + [m.name for m in pkgutil.walk_packages(pkg.__path__, top + ".", onerror=failed)]
    for name in names:
        try:
            modules[name] = os.path.realpath(importlib.import_module(name).__file__)
        except Exception:
            failed(name)
files = []
for top in packages:
    for d, dirs, fs in os.walk(os.path.join(site, top)):
        dirs[:] = [x for x in dirs if x != "__pycache__"]
        files += [os.path.relpath(os.path.join(d, f), site).replace(os.sep, "/") for f in fs]
print(json.dumps({"site": site, "on_path": on_path, "modules": modules, "errors": errors, "files": files}))
"""


def test_every_module_and_data_file_is_installed_and_imports_from_site_packages(installed):
    src, venv, work = installed
    r = run([os.path.join(venv, "bin", "python"), "-c", WALK, ROOT, *PACKAGES], cwd=work, env=clean_env())
    got = json.loads(r.stdout.splitlines()[-1])
    assert got["on_path"] == [], f"the source tree is on sys.path: {got['on_path']}"
    assert not got["errors"], "modules that fail to import from the installed wheel:\n" + "\n".join(
        f"{k}:\n{v}" for k, v in got["errors"].items())
    site = got["site"]
    outside = {m: f for m, f in got["modules"].items() if not f.startswith(site + os.sep)}
    assert not outside, f"imported from outside site-packages ({site}): {outside}"
    modules, data = source_contents(src)
    missing = sorted(modules - set(got["modules"]))
    assert not missing, f"modules of the source tree the wheel lacks (pyproject's package discovery): {missing}"
    assert set(got["modules"]) == modules, sorted(set(got["modules"]) - modules)
    missing = sorted(data - set(got["files"]))
    assert not missing, f"non-.py files of the packages the wheel lacks (pyproject's package-data): {missing}"


def test_console_script_demo_help_replay_convert_generate(installed):
    src, venv, work = installed
    exe, env = os.path.join(venv, "bin", "tiered-moe"), clean_env(XDG_CACHE_HOME=os.path.join(work, "cache"))
    r = run([exe, "demo", "--help"], cwd=work, env=env)
    assert "--build-only" in r.stdout
    # replay reads a shipped hardware profile (package data)
    r = run([exe, "replay", "--synthetic", "--sequences", "2", "--seq-len", "4", "--profile", "cpu", "--json"],
            cwd=work, env=env)
    assert json.loads(r.stdout.splitlines()[0])["batch"] == 1
    hf, store = os.path.join(work, "hf"), os.path.join(work, "store")
    run([os.path.join(venv, "bin", "python"), "-c",
         "import sys; from runtime.model.synthetic import SyntheticModelSpec, build_checkpoint; "
         "build_checkpoint(sys.argv[1], SyntheticModelSpec(num_layers=2, num_experts=8, hidden_size=32, "
         "intermediate_size=32, vocab_size=64, topics=4))", hf], cwd=work, env=env)
    run([exe, "convert", "--model", hf, "--out", store], cwd=work, env=env)
    r = run([exe, "generate", "--model", store, "--prompt-ids", "1,2,3", "--max-tokens", "5",
             "--device-budget", "200KiB", "--json"], cwd=work, env=env)
    out = [json.loads(x) for x in r.stdout.splitlines()]
    assert len(out[0]["tokens"]) == 5 and out[1]["generated_tokens"] == 5
    # The host kernels ship compiled in the wheel (setup.py's build_py: every x86-64 instruction set, named by the
    # source they were made from): with no compiler on PATH and no CC, the widest this CPU runs loads from
    # site-packages, nothing is compiled into the user's cache, and the model's decode layers run fused on them.
    # (A machine without AVX2 + FMA + F16C runs the reference path: nothing to check there.)
    probe = ("import json, sys; from runtime import kernels; from runtime.model import load_model; "
             "m, st = load_model(sys.argv[1], device='cpu', host_budget='auto'); "
             "print(json.dumps({'src': kernels.SRC, 'ok': kernels.lib() is not None, 'why': kernels.unavailable(), "
             "'source': kernels.source(), 'isa': kernels.isa(), 'fused': sum(f is not None for f in m.fused), "
             "'layers': len(m.layers)})); st.close()")
    bare = os.path.join(venv, "bin")                 # PATH: the venv's scripts alone, no gcc / cc
    assert not [c for c in ("gcc", "cc", "clang") if shutil.which(c, path=bare)]
    no_cc = {k: v for k, v in clean_env(XDG_CACHE_HOME=os.path.join(work, "cache-bare"), PATH=bare).items() if k != "CC"}
    r = run([os.path.join(bare, "python"), "-c", probe, store], cwd=work, env=no_cc)
    got = json.loads(r.stdout.splitlines()[-1])
    if not all(f in open("/proc/cpuinfo").read() for f in ("avx2", "fma", "f16c")):
        assert not got["ok"]
        return
    assert "site-packages" in got["src"] and got["ok"], got
    assert got["source"].startswith("prebuilt (") and "site-packages" in got["source"], got
    assert got["fused"] == got["layers"] > 0, got
    assert not os.path.exists(os.path.join(work, "cache-bare", "tiered-moe", "kernels"))
    # the shipped builds: one per x86-64 instruction set, of the wheel's own source
    import hashlib
    kdir = os.path.join(src, "runtime", "kernels")        # moe_cpu.c and the headers it includes, as build.py
    key = hashlib.sha256(b"".join(open(os.path.join(kdir, f), "rb").read() for f in
                                  ["moe_cpu.c"] + sorted(f for f in os.listdir(kdir) if f.endswith(".h")))).hexdigest()[:16]
    shipped = sorted(os.listdir(os.path.dirname(got["source"][len("prebuilt ("):-1])))
    assert shipped == sorted(f"moe_cpu-{key}-x86_64-{isa}.so" for isa in ("avx2", "avx512", "avx512-vnni")), shipped
    # Told not to use them (TIERED_MOE_KERNEL_PREBUILT=0), with a compiler: built from the wheel's own source,
    # into the user's cache.
    r = run([os.path.join(venv, "bin", "python"), "-c", probe, store], cwd=work,
            env={**env, "TIERED_MOE_KERNEL_PREBUILT": "0"})
    got = json.loads(r.stdout.splitlines()[-1])
    assert got["ok"] and got["source"].startswith("compiled here ("), got
    assert any(f.endswith(".so") for f in os.listdir(os.path.join(work, "cache", "tiered-moe", "kernels")))
