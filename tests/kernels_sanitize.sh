#!/usr/bin/env bash
# The host kernels' tests on an AddressSanitizer + UndefinedBehaviorSanitizer build of moe_cpu.c (CI, after
# the pytest run; a few minutes). runtime/kernels builds that library apart from the normal one under
# TIERED_MOE_KERNEL_SANITIZE=1; python itself is not instrumented, so the ASan runtime is preloaded.
# Any report aborts python (no recovery, halt_on_error), which fails pytest and this script; a library
# that does not load fails the run too (TIERED_MOE_REQUIRE_HOST_KERNELS=1), and test_sanitized_build
# checks the library really is the instrumented one.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
CC=${CC:-gcc}
asan=$("$CC" -print-file-name=libasan.so)
if [ ! -e "$asan" ]; then
  echo "kernels_sanitize.sh: $CC has no libasan.so (Debian: libasan of the gcc version)" >&2
  exit 1
fi
cache=$(mktemp -d)
trap 'rm -rf "$cache"' EXIT
# detect_leaks=0: CPython keeps its objects to exit by design. abort_on_error: a report ends the process
# at once (exit status from SIGABRT), wherever pytest is.
export TIERED_MOE_KERNEL_SANITIZE=1 TIERED_MOE_REQUIRE_HOST_KERNELS=1 TIERED_MOE_KERNEL_CACHE="$cache" CC
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:halt_on_error=1
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
# --capture=sys: the sanitizer writes its report to file descriptor 2, which pytest must not swallow when
# the process dies.
LD_PRELOAD="$asan" "$PY" -m pytest -q -p no:cacheprovider --capture=sys \
  tests/runtime/test_kernel_abi.py tests/runtime/test_host_kernels.py tests/runtime/test_gdn_block.py tests/runtime/test_mlp_block.py "$@"
# The fused decode end to end (tm_decode_layers over every layer kind's block, the experts' residency tables, the
# step buffers as they grow): one architecture per attention kind
LD_PRELOAD="$asan" "$PY" -m pytest -q -p no:cacheprovider --capture=sys tests/runtime/model/test_fused_decode.py \
  -k "qwen3_moe or deepseek_v3 or qwen3_next or gpt_oss or kimi_linear" "$@"
