"""Paths shared by the tests (import as `helpers`; conftest modules are not imported by name)."""
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.environ.get("TIERED_MOE_SHARED", os.path.join(os.path.dirname(ROOT), "shared"))
TRACES = os.path.join(SHARED, "traces")


def shared_trace(name: str) -> str:
    path = os.path.join(TRACES, name)
    if not os.path.exists(path):
        pytest.fail(f"shared trace {path} is missing: the project expects ../shared/traces beside the checkout "
                    f"(or TIERED_MOE_SHARED pointing at shared/)")
    return path
