"""Shared by the serving and docker tests (import as `servehelp`)."""
import os
import shutil
import subprocess

import pytest

from runtime.model.synthetic import SyntheticModelSpec

SPEC = SyntheticModelSpec(num_layers=2, num_experts=8, hidden_size=64, intermediate_size=64, num_heads=2,
                          num_kv_heads=1)
KEY = "test-key-123"


def require_tool(name: str) -> str:
    """CI installs Prometheus (.ci/run) and sets TIERED_MOE_REQUIRE_PROMETHEUS=1: there a missing tool fails."""
    path = shutil.which(name)
    if path is None:
        if os.environ.get("TIERED_MOE_REQUIRE_PROMETHEUS") == "1":
            pytest.fail(f"{name} is not on PATH (Debian package 'prometheus'; .ci/run installs it)")
        pytest.skip(f"{name} is not installed (Debian package 'prometheus')")
    return path


def promtool(*args) -> subprocess.CompletedProcess:
    return subprocess.run([require_tool("promtool"), *args], capture_output=True, text=True, timeout=60)
