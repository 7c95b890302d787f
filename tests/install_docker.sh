#!/usr/bin/env bash
# The container test builds and runs the server image: Debian's docker.io (dockerd) and
# debootstrap (a base image from Debian's packages, since no image registry is reachable here).
# Installs them when missing (as root, or through sudo). Never fails: without them the test
# skips and says why.
set -uo pipefail
if command -v dockerd >/dev/null && command -v debootstrap >/dev/null; then exit 0; fi
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get install -y -q docker.io debootstrap >/dev/null 2>&1 \
  || { $SUDO apt-get update -q >/dev/null 2>&1 && $SUDO apt-get install -y -q docker.io debootstrap >/dev/null 2>&1; } \
  || echo "install_docker.sh: could not install docker.io and debootstrap; the container test will skip"
exit 0
