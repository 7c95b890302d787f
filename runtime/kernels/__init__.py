"""Host (CPU) kernels: ``moe_cpu.c``, loaded with ctypes. A wheel carries them compiled (setup.py builds
every instruction set of this architecture into ``prebuilt/`` when the wheel is made: a machine or
container with no compiler runs them); where none was shipped for this source (a source checkout, another
architecture) they are compiled on first use with the machine's C compiler and kept in a cache folder
keyed by the source, the compiler flags and the CPU's features (as torch's and triton's JIT extensions
are). ``source()`` says which ran.

Why our own C rather than a library (bench/host_kernels.py measures the candidates): torch's CPU
kernels take float32 or bf16 matrices one matmul at a time (its bf16 matmul is slower than our bf16
kernel even on an AVX512-BF16 CPU, and int4 only in its own repacked layout, without MXFP4 or FP8),
torchao's CPU MoE extension and kt-kernel pin their own torch builds, and ggml-python builds one
graph per call. What the runtime needs is one call per MoE layer over the experts' stored bytes,
as they sit in the tier slabs, with the codes decoded in registers, and a decode layer in two calls
(runtime/model/layers/fused.py): about a thousand lines of C.

``TIERED_MOE_KERNEL_PREBUILT=0`` ignores the shipped builds (compiles here). ``TIERED_MOE_HOST_KERNELS=0``
turns the kernels off (the dequantize-then-matmul reference path runs instead); with neither a shipped
build nor a compiler, or on a CPU without AVX2 + FMA + F16C, they are off and ``unavailable()`` says why.

Instruction sets: AVX2 + FMA + F16C is the base build; on a CPU with AVX-512 (F, BW, VL, DQ) every
loop runs 16 floats wide, and with AVX512-VNNI the 8-bit-activation path (``--host-act-quant q8``)
multiplies 64 nibble codes by 64 activation bytes in one instruction, as llama.cpp does on such CPUs.
``TIERED_MOE_HOST_ISA=avx2`` forces the base build (tests run both where the CPU has both);
``isa()`` names the one loaded.

The C trusts nothing it is handed: every entry point checks its sizes, and every index it follows (an
expert's rows, a gathered token, a combine's row, a position, a cache slot) against the capacities
the caller passes in its argument struct, before any work, and returns a negative code; the ctypes
wrappers here raise ``KernelError`` naming the entry point and the code. Callers fill a fresh argument
struct per call (from a template, ``Structure.from_buffer_copy``) and take their scratch from a
per-thread pool (``scratch``), so two threads calling one layer do not share either.

``TIERED_MOE_KERNEL_CFLAGS`` adds compiler flags to a build made here (cached apart; shipped builds are not
used then), e.g. ``-DPFH=_MM_HINT_NTA`` for bench/prefetch_hint.py's A/B.

``TIERED_MOE_KERNEL_SANITIZE=1`` builds (and caches apart) an AddressSanitizer + UBSan library for
tests/kernels_sanitize.sh; python must then run with ``LD_PRELOAD=$(gcc -print-file-name=libasan.so)``,
as an instrumented library cannot load into an uninstrumented process otherwise."""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import sys
import threading

from .build import (FLAGS, ISAS, NEEDS, PREBUILT_DIR, SANITIZE_FLAGS, SRC, compile_to,  # noqa: F401 (re-exported)
                    prebuilt_name, source_bytes, source_key)

ABI_VERSION = 6          # moe_cpu.c tm_version(): a library of another ABI is refused, not called
ISA_NAMES = {1: "avx2", 2: "avx512", 3: "avx512-vnni", 4: "neon"}

# Formats and scale dtypes as the C enums number them.
FMT_CODES = {"fp32": 0, "bf16": 1, "fp16": 2, "mxfp4": 3, "int4": 4, "fp8_e4m3": 5, "int8": 6}
SCALE_CODES = {"float32": 0, "bfloat16": 1, "float16": 2}
# Error codes as moe_cpu.c's TM_E_* enum numbers them (tm_strerror gives the text).
E_LAYOUT, E_GROUP, E_FP8, E_ARG, E_NULL, E_ROWS, E_TOK, E_BACK, E_SCRATCH, E_POS, E_SLOT, E_NOMEM = \
    -1, -2, -3, -5, -6, -7, -8, -9, -10, -11, -12, -13


class KernelError(RuntimeError):
    """A host kernel refused its arguments: ``entry`` (the C function) and ``code`` (an E_* value)."""

    def __init__(self, entry: str, code: int, why: str) -> None:
        super().__init__(f"{entry} refused its arguments (code {code}: {why})")
        self.entry, self.code = entry, code


class MoEArgs(ctypes.Structure):
    _fields_ = [("fmt", ctypes.c_int32), ("sfmt", ctypes.c_int32), ("group", ctypes.c_int32),
                ("bo", ctypes.c_int32), ("bi", ctypes.c_int32), ("bias_fmt", ctypes.c_int32),
                ("act", ctypes.c_int32), ("limit", ctypes.c_float), ("alpha", ctypes.c_float),
                ("H_in", ctypes.c_int32), ("I", ctypes.c_int32), ("H_out", ctypes.c_int32),
                ("n_exp", ctypes.c_int32), ("nthreads", ctypes.c_int32),
                ("row0", ctypes.c_void_p), ("rows", ctypes.c_void_p), ("ptrs", ctypes.c_void_p),
                ("x", ctypes.c_void_p), ("y", ctypes.c_void_p), ("h", ctypes.c_void_p),
                ("q8", ctypes.c_int32), ("xq", ctypes.c_void_p), ("xd", ctypes.c_void_p),
                ("tok", ctypes.c_void_p), ("xin", ctypes.c_void_p), ("back", ctypes.c_void_p),
                ("wts", ctypes.c_void_p), ("out", ctypes.c_void_p), ("T", ctypes.c_int64), ("k", ctypes.c_int64),
                ("out_add", ctypes.c_int32),
                # capacities the C checks the indices against: rows of x / y (and tok), of the scratch
                # h / xq / xd, and of xin
                ("n_rows", ctypes.c_int64), ("scratch_rows", ctypes.c_int64), ("n_in", ctypes.c_int64)]


class LinArgs(ctypes.Structure):
    """tm_lin_t: one quantized dense matrix (runtime/model/layers/dense.py)."""
    _fields_ = [("fmt", ctypes.c_int32), ("sfmt", ctypes.c_int32), ("group", ctypes.c_int32), ("q8", ctypes.c_int32),
                ("nthreads", ctypes.c_int32), ("n", ctypes.c_int64), ("K", ctypes.c_int64), ("N", ctypes.c_int64),
                ("x", ctypes.c_void_p), ("y", ctypes.c_void_p), ("W", ctypes.c_void_p), ("S", ctypes.c_void_p),
                ("bias", ctypes.c_void_p), ("xq", ctypes.c_void_p), ("xd", ctypes.c_void_p),
                ("xq_rows", ctypes.c_int64)]        # rows the q8 scratch xq / xd holds


_lock = threading.Lock()
_state: dict = {}
_tls = threading.local()


def scratch(name: str, numel: int, dtype=None) -> int:
    """The address of this thread's scratch buffer ``name`` of at least ``numel`` elements (grown, never
    shrunk): a kernel's working rows, used only inside one call, so one per thread serves every layer
    and two threads never share one. (Hot: every kernel call; a dict hit and a compare.)"""
    try:
        t, cap, ptr = _tls.bufs[name]
        if cap >= numel:
            return ptr
    except AttributeError:
        _tls.bufs = {}
    except KeyError:
        pass
    import torch
    t = torch.empty(max(int(numel), 1), dtype=dtype or torch.float32)
    _tls.bufs[name] = (t, t.numel(), t.data_ptr())
    return t.data_ptr()


def _cpu_flags() -> set:
    """The CPU's feature names as /proc/cpuinfo lists them (x86: ``flags``, aarch64: ``Features``)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cache_dir() -> str:
    d = os.environ.get("TIERED_MOE_KERNEL_CACHE")
    if d:
        return d
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tiered-moe", "kernels")


def pick_isa(flags: set, want: "str | None" = None) -> list:
    """[(name, extra compiler flags)] of the builds this CPU runs, widest first (the first one that
    compiles is loaded), or only ``want`` (TIERED_MOE_HOST_ISA); a ``want`` the CPU lacks or that is
    unknown raises ValueError."""
    names = [n for n, _, _ in ISAS]
    if want and want not in names:
        raise ValueError(f"TIERED_MOE_HOST_ISA={want!r} is not one of {', '.join(names)}")
    out = [(name, extra) for name, needs, extra in ISAS
           if all(f in flags for f in needs) and (not want or want == name)]
    if not out:
        raise ValueError(f"TIERED_MOE_HOST_ISA={want}: this CPU lacks "
                         f"{', '.join(f for f in dict((n, x) for n, x, _ in ISAS)[want] if f not in flags)}")
    return out


def _sanitize() -> bool:
    return os.environ.get("TIERED_MOE_KERNEL_SANITIZE", "0") == "1"


def _build(cc: str, flags: set, extra: list) -> str:
    """Compile moe_cpu.c unless a build of this source, these flags and this CPU is cached; the path."""
    src = source_bytes()
    # after FLAGS: its -O1 wins; TIERED_MOE_KERNEL_CFLAGS: extra flags for an A/B (bench/prefetch_hint.py)
    extra = extra + _extra_cflags() + (SANITIZE_FLAGS if _sanitize() else [])
    key = hashlib.sha256(src + " ".join([cc] + FLAGS + extra + sorted(flags & set(NEEDS))).encode()).hexdigest()[:16]
    path = os.path.join(cache_dir(), f"moe_cpu-{key}.so")
    if not os.path.exists(path):
        compile_to(cc, extra, path)
    return path


def _extra_cflags() -> list:
    return os.environ.get("TIERED_MOE_KERNEL_CFLAGS", "").split()


def _prebuilt(isa: str) -> "str | None":
    """The build of ``isa`` the installed package ships for this source and architecture, if any (none with
    extra compiler flags asked for: the shipped builds were made without them)."""
    if _sanitize() or _extra_cflags() or os.environ.get("TIERED_MOE_KERNEL_PREBUILT", "1") == "0":
        return None
    path = os.path.join(PREBUILT_DIR, prebuilt_name(isa, _state.setdefault("key", source_key())))
    return path if os.path.exists(path) else None


def _load():
    if os.environ.get("TIERED_MOE_HOST_KERNELS", "1") == "0":
        return None, "turned off by TIERED_MOE_HOST_KERNELS=0"
    if sys.platform != "linux":
        return None, f"built on Linux only (this is {sys.platform})"
    flags = _cpu_flags()
    missing = [f for f in NEEDS if f not in flags]
    if missing:
        return None, f"the CPU lacks {', '.join(missing)}"
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if _sanitize() and "libasan" not in os.environ.get("LD_PRELOAD", ""):
        # loading it anyway would abort the process ("ASan runtime does not come first")
        return None, ("TIERED_MOE_KERNEL_SANITIZE=1 needs the ASan runtime preloaded: "
                      "LD_PRELOAD=$(gcc -print-file-name=libasan.so)")
    try:
        builds = pick_isa(flags, os.environ.get("TIERED_MOE_HOST_ISA") or None)
    except ValueError as e:
        return None, str(e)
    errors = []
    # The widest build this CPU runs: shipped in the package, else compiled here (an older compiler without
    # a wide ISA's flags: the next one down).
    for isa, extra in builds:
        path = _prebuilt(isa)
        try:
            if path is None:
                if not cc:
                    continue
                path = _build(cc, flags, extra)
                _state["source"] = f"compiled here ({path})"
            else:
                _state["source"] = f"prebuilt ({path})"
            lib = ctypes.CDLL(path)
            break
        except (OSError, RuntimeError) as e:
            errors.append(f"{isa}: {e}")
    else:
        _state.pop("source", None)
        if not cc and not errors:
            return None, (f"no build for this CPU ({'/'.join(i for i, _ in builds)}) ships in this install "
                          f"({PREBUILT_DIR}: a wheel built where a C compiler was carries them) and no C compiler "
                          f"(gcc or cc) on PATH to build one")
        return None, "\n".join(errors)
    lib.tm_version.restype = ctypes.c_int
    if lib.tm_version() != ABI_VERSION:
        return None, f"kernel library of ABI {lib.tm_version()}, this runtime speaks {ABI_VERSION}"
    lib.tm_isa.restype = ctypes.c_int
    lib.tm_set_spin_us.argtypes = [ctypes.c_int64]
    lib.tm_set_spin_us(int(os.environ.get("TIERED_MOE_SPIN_US", "2000")))     # decode's (spin_for)
    lib.tm_q8_ldd.argtypes = [ctypes.c_int64]
    lib.tm_q8_ldd.restype = ctypes.c_int64
    if ISA_NAMES[lib.tm_isa()] != isa:   # the compiler ignored a flag: say so rather than mislabel
        return None, f"{cc} built {ISA_NAMES[lib.tm_isa()]} code for the {isa} flags"
    _declare(lib)
    # Every caller raises on a refusal, named (tm_attn_block's caller, layers/fused.py, checks its code
    # itself to name the layer).
    for entry in ("tm_moe", "tm_linear_bf16", "tm_linear_q", "tm_rms_norm", "tm_gqa_decode"):
        getattr(lib, entry).errcheck = _refused(lib, entry)
    return lib, None


def _declare(lib) -> None:
    """The entry points' C signatures (moe_cpu.h) for ctypes."""
    lib.tm_strerror.argtypes = [ctypes.c_int]
    lib.tm_strerror.restype = ctypes.c_char_p
    lib.tm_moe.argtypes = [ctypes.POINTER(MoEArgs)]
    lib.tm_moe.restype = ctypes.c_int
    lib.tm_linear_bf16.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                                   ctypes.c_void_p, ctypes.c_int32]
    lib.tm_linear_bf16.restype = ctypes.c_int
    lib.tm_linear_q.argtypes = [ctypes.POINTER(LinArgs)]
    lib.tm_linear_q.restype = ctypes.c_int
    lib.tm_attn_block.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.tm_attn_block.restype = ctypes.c_int
    lib.tm_mla_block.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    lib.tm_mla_block.restype = ctypes.c_int
    lib.tm_gdn_block.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    lib.tm_gdn_block.restype = ctypes.c_int
    lib.tm_mlp_block.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.tm_mlp_block.restype = ctypes.c_int
    lib.tm_decode_layers.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
    lib.tm_decode_layers.restype = ctypes.c_int
    lib.tm_rms_norm.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                                ctypes.c_float, ctypes.c_void_p]
    lib.tm_rms_norm.restype = ctypes.c_int
    P, I64 = ctypes.c_void_p, ctypes.c_int64
    lib.tm_gqa_decode.argtypes = [P, I64, P, I64, P, P, I64, P, P, I64, P, P, I64, P, I64, I64, I64, I64, ctypes.c_float,
                                  P, P, P, ctypes.c_int32]          # ... scale, sinks (or None), out, scratch, threads
    lib.tm_gqa_decode.restype = ctypes.c_int


def _refused(lib, entry: str):
    def check(rc, func, args):
        if rc:
            raise KernelError(entry, rc, lib.tm_strerror(rc).decode())
        return rc
    return check


def lib():
    """The loaded kernel library, or None (then ``unavailable()`` says why). Called on hot paths
    (every norm and attention layer of a step): the lock only until the first load."""
    if "lib" in _state:
        return _state["lib"]
    with _lock:
        if "lib" not in _state:
            _state["lib"], _state["why"] = _load()
    return _state["lib"]


def isa() -> "str | None":
    """The instruction set of the loaded kernels (avx2, avx512, avx512-vnni), or None when off."""
    lb = lib()
    return None if lb is None else ISA_NAMES[lb.tm_isa()]


def source() -> "str | None":
    """Where the loaded kernels came from: "prebuilt (PATH)" (shipped in the installed package) or
    "compiled here (PATH)" (on first use); None when they are off."""
    lib()
    return _state.get("source") if _state.get("lib") is not None else None


def unavailable() -> "str | None":
    lib()
    return _state["why"]


def warn_once() -> None:
    """One line on stderr when the kernels are off for a reason other than the user's own switch:
    CPU experts then run the (much slower) reference path, which a user should know."""
    why = unavailable()
    if why and "TIERED_MOE_HOST_KERNELS=0" not in why and not _state.get("warned"):
        _state["warned"] = True
        print(f"tiered-moe: host kernels off ({why.splitlines()[0]}); CPU experts use the slower reference path",
              file=sys.stderr)


def set_threads(n: int) -> None:
    """Threads the kernels use: the model's forward sets torch's configured count (it runs small
    torch ops on fewer; the kernels split even one token's experts)."""
    _state["threads"] = max(1, int(n))


def threads() -> int:
    return _state.get("threads", 1)


def spin_for(decode: bool) -> None:
    """The pool's workers spin between jobs (TIERED_MOE_SPIN_US, 2 ms) in a decode step - its kernels come tens of
    microseconds apart -, and sleep at once after each job in a prefill, whose torch ops thread over the same
    cores with OpenMP: a worker spinning there leaves every parallel torch op waiting for its slower half (the
    Qwen3-Next-shaped bf16 pp512 ran no faster at 2 threads than at 1). Calls the library only on a change."""
    want = int(os.environ.get("TIERED_MOE_SPIN_US", "2000")) if decode else 0
    if _state.get("spin_us") != want:
        handle = lib()
        if handle is not None:
            handle.tm_set_spin_us(want)
            _state["spin_us"] = want


def reset() -> None:
    """Forget the loaded state (tests: after changing TIERED_MOE_HOST_KERNELS)."""
    with _lock:
        _state.clear()
