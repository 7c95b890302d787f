"""The aarch64 build of the host kernels (moe_cpu.c on neon_x86.h), cross-compiled here and run under
qemu-aarch64, against the same references as the x86 builds: tests/runtime/kernels_driver.c calls the quantized
and bf16 linears, RMSNorm, the grouped expert call (int4 with each scale dtype and group, MXFP4, int8, bf16;
float and 8-bit activations; one to eight rows), GQA decode over a paged cache (RoPE, scattered slots, sinks) and
a linear-attention layer's decode (Gated DeltaNet and KDA, tm_gdn_block) on inputs from a fixed generator, and writes each output beside
a float64 reference computed from the formats' definitions. The same driver runs every x86 build this CPU runs
on the same inputs, so the two machines are also compared output for output.

Needs aarch64-linux-gnu-gcc and qemu-aarch64 (tests/install_aarch64.sh; CI installs them and sets
TIERED_MOE_REQUIRE_AARCH64=1, so their absence fails instead of skipping)."""
import os
import shutil
import subprocess

import numpy as np
import pytest

from runtime import kernels
from runtime.kernels import build

HERE = os.path.dirname(os.path.abspath(__file__))
DRIVER = os.path.join(HERE, "kernels_driver.c")
CROSS, QEMU, SYSROOT = "aarch64-linux-gnu-gcc", "qemu-aarch64", "/usr/aarch64-linux-gnu"
N_CASES = 100         # kernels_driver.c main(): 72 linear_q, 5 linear_bf16, 2 rms_norm, 2 gqa_decode, 2 x 2 gdn_block, mlp_block
#                       (x and the state), 7 moe (+ activations)


def _tools():
    missing = [t for t in (CROSS, QEMU, "gcc") if not shutil.which(t)]
    if missing:
        if os.environ.get("TIERED_MOE_REQUIRE_AARCH64") == "1":
            pytest.fail(f"TIERED_MOE_REQUIRE_AARCH64=1 but {', '.join(missing)} missing (tests/install_aarch64.sh)")
        pytest.skip(f"{', '.join(missing)} missing (tests/install_aarch64.sh installs them)")


def read_records(path: str) -> dict:
    """kernels_driver.c's records: name -> (outputs, reference or None)."""
    b, i, out = open(path, "rb").read(), 0, {}
    while i < len(b):
        name = b[i:i + 48].split(b"\0")[0].decode()
        n = int(np.frombuffer(b, np.int64, 1, i + 48)[0])
        y = np.frombuffer(b, np.float32, n, i + 56)
        i += 56 + 4 * n
        nr = int(np.frombuffer(b, np.int64, 1, i)[0])
        out[name] = (y, np.frombuffer(b, np.float32, nr, i + 8) if nr else None)
        i += 8 + 4 * nr
    return out


def run_driver(cc: str, lib: str, tmp, tag: str, emulate: bool) -> "tuple[str, dict]":
    exe, rec = str(tmp / f"driver-{tag}"), str(tmp / f"out-{tag}.bin")
    subprocess.run([cc, "-O2", "-Wall", "-Werror", "-I", os.path.dirname(build.SRC), DRIVER, "-o", exe, "-ldl", "-lm"],
                   check=True, capture_output=True, text=True)
    cmd = ([QEMU, "-L", SYSROOT] if emulate else []) + [exe, lib, rec]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    return p.stdout, read_records(rec)


def check_against_reference(recs: dict, what: str) -> None:
    assert len(recs) == N_CASES, f"{what}: {len(recs)} cases"
    for name, (y, ref) in recs.items():
        scale = float(np.abs(ref).max())
        assert scale > 0.1, f"{what} {name}: a reference of zeros checks nothing"
        err = float(np.abs(y.astype(np.float64) - ref).max()) / scale
        assert err < 2e-6, f"{what} {name}: {err:.2e} of the largest reference value off"


def test_the_aarch64_build_matches_the_references_and_the_x86_builds(tmp_path):
    _tools()
    # The aarch64 build as a wheel built on an ARM machine carries it (build_prebuilt, named by the source).
    made, failed = build.build_prebuilt(str(tmp_path), CROSS, machine="aarch64")
    assert not failed and made == [build.prebuilt_name("neon", build.source_key(), "aarch64")], (made, failed)
    arm_out, arm = run_driver(CROSS, str(tmp_path / made[0]), tmp_path, "aarch64", emulate=True)
    assert f"abi {kernels.ABI_VERSION} isa 4" in arm_out           # tm_isa: 4 = neon
    check_against_reference(arm, "aarch64")
    flags = kernels._cpu_flags()
    isas = [(isa, extra) for isa, needs, extra in build.ISAS if all(f in flags for f in needs)]
    if not all(f in flags for f in build.NEEDS) or not isas:
        pytest.skip("this CPU runs no x86 build of the kernels")
    for isa, extra in isas:
        lib = str(tmp_path / f"x86-{isa}.so")
        build.compile_to("gcc", extra, lib)
        _, x86 = run_driver("gcc", lib, tmp_path, isa, emulate=False)
        check_against_reference(x86, isa)
        if isa == "avx2":       # the same code path, instruction for instruction: equal but for scalar tails
            for name, (y, ref) in x86.items():
                d = float(np.abs(arm[name][0] - y).max()) / float(np.abs(ref).max())
                assert d < 1e-6, f"{name}: aarch64 and avx2 differ by {d:.2e}"
