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


@pytest.fixture(scope="session")
def deepseek_trace():
    from cache_policy.traces import load_trace
    return load_trace(shared_trace("deepseek-v2-lite-train.npz"))


@pytest.fixture(scope="session")
def flame_trace():
    from cache_policy.traces import load_trace
    return load_trace(shared_trace("flame-moe-290m.npz"))
