"""Compiling ``moe_cpu.c``: the flags of each instruction-set build and the names of the builds a wheel
ships. Standard library only, and importable by its path alone: setup.py loads this file (not the
``runtime`` package, which needs torch) to compile every build into the wheel at install time.

Where the kernels come from, at run time (runtime/kernels/__init__.py): a build shipped in the installed
package (``prebuilt/``, made by setup.py's build_py when the wheel was built: no compiler needed on the
machine that runs it) when one was made from this very source for this CPU's architecture and widest
instruction set; otherwise one compiled on first use with the machine's C compiler into a cache folder."""
from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import tempfile

SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "moe_cpu.c")
PREBUILT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "prebuilt")
FLAGS = ["-O3", "-std=gnu11", "-fPIC", "-shared", "-pthread", "-mavx2", "-mfma", "-mf16c"]
NEEDS = ("avx2", "fma", "f16c")
# TIERED_MOE_KERNEL_SANITIZE=1: -O1 and frame pointers for readable reports; no recovery, so the first
# UB report aborts the run (tests/kernels_sanitize.sh fails on it).
SANITIZE_FLAGS = ["-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined", "-fno-sanitize-recover=all"]
# Wider builds: (name, /proc/cpuinfo flags it needs, compiler flags), widest first.
ISAS = (("avx512-vnni", ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"),
         ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni"]),
        ("avx512", ("avx512f", "avx512bw", "avx512vl", "avx512dq"), ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]),
        ("avx2", (), []))
# The machines moe_cpu.c has code for (its intrinsics are x86's).
ARCHES = ("x86_64",)


def source_key(src: str = SRC) -> str:
    """16 hex digits of the source's sha256: a shipped build is used only with the source it was made from."""
    with open(src, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


def prebuilt_name(isa: str, key: str, machine: "str | None" = None) -> str:
    return f"moe_cpu-{key}-{machine or platform.machine()}-{isa}.so"


def compile_to(cc: str, extra: list, out: str, src: str = SRC) -> None:
    """``cc`` FLAGS + ``extra`` on ``src`` into ``out``, atomically (a concurrent build leaves one complete file);
    RuntimeError with the compiler's message when it fails."""
    d = os.path.dirname(os.path.abspath(out))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=d)
    os.close(fd)
    try:
        p = subprocess.run([cc, *FLAGS, *extra, src, "-o", tmp, "-lm"], capture_output=True, text=True)
        if p.returncode:
            raise RuntimeError(f"{cc} failed on {src}:\n{p.stderr[-2000:]}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def build_prebuilt(out_dir: str, cc: str, src: str = SRC, machine: "str | None" = None) -> "tuple[list, list]":
    """Every instruction-set build of ``src`` for this machine's architecture into ``out_dir`` (setup.py, at
    wheel build): the CPU that builds need not run them. -> (file names made, [(isa, why) not made])."""
    machine = machine or platform.machine()
    if machine not in ARCHES:
        return [], [("*", f"moe_cpu.c has no code for {machine} (only {', '.join(ARCHES)})")]
    key, made, failed = source_key(src), [], []
    for isa, _, extra in ISAS:
        name = prebuilt_name(isa, key, machine)
        try:
            compile_to(cc, extra, os.path.join(out_dir, name), src)
            made.append(name)
        except (OSError, RuntimeError) as e:      # an older compiler without a wide ISA's flags
            failed.append((isa, str(e).splitlines()[0]))
    return made, failed
