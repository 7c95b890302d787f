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
BASE_FLAGS = ["-O3", "-std=gnu11", "-fPIC", "-shared", "-pthread"]
# TIERED_MOE_KERNEL_SANITIZE=1: -O1 and frame pointers for readable reports; no recovery, so the first
# UB report aborts the run (tests/kernels_sanitize.sh fails on it).
SANITIZE_FLAGS = ["-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined", "-fno-sanitize-recover=all"]
# The machines moe_cpu.c has code for: machine -> (flags of every build, CPU features every build needs,
# builds widest first as (name, CPU features it adds, compiler flags it adds)). x86_64: AVX2 + FMA + F16C
# always, AVX-512 and AVX512-VNNI wider. aarch64: the AVX2 path on NEON (neon_x86.h), armv8-a's Advanced
# SIMD, which every 64-bit ARM core has (/proc/cpuinfo names it asimd).
ARCH = {
    "x86_64": (["-mavx2", "-mfma", "-mf16c"], ("avx2", "fma", "f16c"),
               (("avx512-vnni", ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"),
                 ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni"]),
                ("avx512", ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
                 ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]),
                ("avx2", (), []))),
    "aarch64": (["-march=armv8-a"], ("asimd",), (("neon", (), []),)),
}
ARCHES = tuple(ARCH)


def machine_name(machine: "str | None" = None) -> str:
    """platform.machine() as ARCH names it (macOS and some kernels say arm64 / amd64)."""
    m = machine or platform.machine()
    return {"arm64": "aarch64", "amd64": "x86_64", "AMD64": "x86_64"}.get(m, m)


def flags_for(machine: "str | None" = None) -> list:
    """The flags every build for ``machine`` (default: this one) compiles with; [] where there is no code for it."""
    arch = ARCH.get(machine_name(machine))
    return BASE_FLAGS + arch[0] if arch else []


def isas_for(machine: "str | None" = None) -> tuple:
    arch = ARCH.get(machine_name(machine))
    return arch[2] if arch else ()


FLAGS = flags_for()
NEEDS = ARCH.get(machine_name(), ((), (), ()))[1]
ISAS = isas_for()


def source_bytes(src: str = SRC) -> bytes:
    """``src`` and the headers beside it that it includes (neon_x86.h): what a build is made from."""
    d = os.path.dirname(os.path.abspath(src))
    out = b""
    for path in [src] + sorted(os.path.join(d, f) for f in os.listdir(d) if f.endswith(".h")):
        with open(path, "rb") as f:
            out += f.read()
    return out


def source_key(src: str = SRC) -> str:
    """16 hex digits of the sources' sha256: a shipped build is used only with the source it was made from."""
    return hashlib.sha256(source_bytes(src)).hexdigest()[:16]


def prebuilt_name(isa: str, key: str, machine: "str | None" = None) -> str:
    return f"moe_cpu-{key}-{machine_name(machine)}-{isa}.so"


def compile_to(cc: str, extra: list, out: str, src: str = SRC, machine: "str | None" = None) -> None:
    """``cc`` with ``machine``'s flags (default this one's: FLAGS) + ``extra`` on ``src`` into ``out``, atomically
    (a concurrent build leaves one complete file); RuntimeError with the compiler's message when it fails.
    ``machine``: another architecture's build with its cross compiler ``cc`` (aarch64-linux-gnu-gcc)."""
    d = os.path.dirname(os.path.abspath(out))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=d)
    os.close(fd)
    try:
        p = subprocess.run([cc, *flags_for(machine), *extra, src, "-o", tmp, "-lm"], capture_output=True, text=True)
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
    machine = machine_name(machine)
    if machine not in ARCHES:
        return [], [("*", f"moe_cpu.c has no code for {machine} (only {', '.join(ARCHES)})")]
    key, made, failed = source_key(src), [], []
    for isa, _, extra in isas_for(machine):
        name = prebuilt_name(isa, key, machine)
        try:
            compile_to(cc, extra, os.path.join(out_dir, name), src, machine)
            made.append(name)
        except (OSError, RuntimeError) as e:      # an older compiler without a wide ISA's flags
            failed.append((isa, str(e).splitlines()[0]))
    return made, failed
