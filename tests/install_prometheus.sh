#!/usr/bin/env bash
# The metrics tests run a real Prometheus and promtool: Debian's package `prometheus`.
# Installs it when missing (as root, or through sudo); does nothing when both tools are there.
set -euo pipefail
if command -v prometheus >/dev/null && command -v promtool >/dev/null; then exit 0; fi
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get install -y -q prometheus >/dev/null 2>&1 || { $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q prometheus >/dev/null; }
command -v promtool >/dev/null
