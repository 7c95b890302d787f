#!/usr/bin/env bash
# The aarch64 kernel test (tests/runtime/test_kernels_aarch64.py) cross-compiles moe_cpu.c and runs it under
# user-mode emulation: Debian's gcc-aarch64-linux-gnu (with the arm64 C library) and qemu-user. Installs them
# when missing (as root, or through sudo); does nothing when both are there.
set -euo pipefail
if command -v aarch64-linux-gnu-gcc >/dev/null && command -v qemu-aarch64 >/dev/null; then exit 0; fi
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
PKGS="gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user"
$SUDO apt-get install -y -q --no-install-recommends $PKGS >/dev/null 2>&1 \
    || { $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q --no-install-recommends $PKGS >/dev/null; }
command -v aarch64-linux-gnu-gcc >/dev/null && command -v qemu-aarch64 >/dev/null
