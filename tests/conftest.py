import pytest

from helpers import shared_trace


@pytest.fixture(scope="session")
def deepseek_trace():
    from cache_policy.traces import load_trace
    return load_trace(shared_trace("deepseek-v2-lite-train.npz"))


@pytest.fixture(scope="session")
def flame_trace():
    from cache_policy.traces import load_trace
    return load_trace(shared_trace("flame-moe-290m.npz"))
