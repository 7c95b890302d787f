"""Builds the host kernels into the wheel (pyproject.toml holds everything else).

``build_py`` compiles runtime/kernels/moe_cpu.c once per instruction set of this architecture (AVX2,
AVX-512, AVX512-VNNI on x86-64) into runtime/kernels/prebuilt/, so that an installed wheel - a container, a
machine without a compiler - runs them; the runtime picks the widest its CPU runs and uses a build only
with the source it was made from. Without a C compiler the wheel is built without them (a warning says so)
and the kernels are compiled on first use where a compiler exists. An editable install builds nothing: the
source tree compiles on first use, so an edited moe_cpu.c takes effect. The wheel is tagged for this
platform (py3-none-linux_x86_64) since it carries machine code."""
import importlib.util
import os
import shutil
import sys

from setuptools import setup
from setuptools.command.build_py import build_py

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:                  # setuptools < 70.1: the wheel package's
    from wheel.bdist_wheel import bdist_wheel

HERE = os.path.dirname(os.path.abspath(__file__))


def _kernel_build():
    """runtime/kernels/build.py by its path (the runtime package itself imports torch)."""
    spec = importlib.util.spec_from_file_location("_tm_kernel_build",
                                                  os.path.join(HERE, "runtime", "kernels", "build.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class BuildPyWithKernels(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False) or os.environ.get("TIERED_MOE_BUILD_KERNELS", "1") == "0":
            return
        kb = _kernel_build()
        cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
        out = os.path.join(self.build_lib, "runtime", "kernels", "prebuilt")
        if not cc:
            print("tiered-moe: WARNING: no C compiler (gcc or cc): the wheel carries no host kernels; they are "
                  "compiled on first use where a compiler exists, else CPU experts run the slow reference path",
                  file=sys.stderr)
            return
        made, failed = kb.build_prebuilt(out, cc, os.path.join(HERE, "runtime", "kernels", "moe_cpu.c"))
        for isa, why in failed:
            print(f"tiered-moe: WARNING: host kernels for {isa} not built: {why}", file=sys.stderr)
        if made:
            print(f"tiered-moe: host kernels built into the wheel: {', '.join(made)}", file=sys.stderr)


class PlatformWheel(bdist_wheel):
    """Machine code inside: a platform tag, any Python 3 (the kernels are loaded with ctypes, no CPython ABI)."""

    def finalize_options(self):
        super().finalize_options()
        self.root_is_pure = False

    def get_tag(self):
        _, _, plat = super().get_tag()
        return "py3", "none", plat


setup(cmdclass={"build_py": BuildPyWithKernels, "bdist_wheel": PlatformWheel})
