import os

import pytest

from helpers import shared_trace


def pytest_sessionstart(session):
    """TIERED_MOE_REQUIRE_HOST_KERNELS=1 (CI: gcc and an AVX2 CPU are there): host kernels that do not load
    stop the run, saying why, rather than every kernel test module skipping on its own."""
    if os.environ.get("TIERED_MOE_REQUIRE_HOST_KERNELS") == "1":
        from runtime import kernels
        if kernels.lib() is None:
            pytest.exit(f"TIERED_MOE_REQUIRE_HOST_KERNELS=1 but the host kernels are unavailable: "
                        f"{kernels.unavailable()}", returncode=1)


IMAGE_TEST = "tests/docker/test_image.py"


def pytest_collection_modifyitems(session, config, items):
    """The container test, when selected, runs last, and its image starts building now on a background thread
    (tests/imagebuild.py: mostly downloads and unpacking) while the rest of the suite runs."""
    image = [it for it in items if it.nodeid.startswith(IMAGE_TEST)]
    if image and not config.option.collectonly:
        items[:] = [it for it in items if not it.nodeid.startswith(IMAGE_TEST)] + image
        import imagebuild
        imagebuild.build()


def pytest_sessionfinish(session, exitstatus):
    import sys
    if "imagebuild" in sys.modules:
        sys.modules["imagebuild"].close()


@pytest.fixture(scope="session")
def deepseek_trace():
    from cache_policy.traces import load_trace
    return load_trace(shared_trace("deepseek-v2-lite-train.npz"))


@pytest.fixture(scope="session")
def flame_trace():
    from cache_policy.traces import load_trace
    return load_trace(shared_trace("flame-moe-290m.npz"))


@pytest.fixture(scope="session")
def tiny_store(tmp_path_factory):
    """A tiny synthetic checkpoint (with tokenizer and chat template) and its converted store."""
    from runtime.model.convert import convert
    from runtime.model.synthetic import build_checkpoint
    from servehelp import SPEC
    d = tmp_path_factory.mktemp("serve")
    build_checkpoint(str(d / "hf"), SPEC)
    convert(str(d / "hf"), str(d / "tiny"))
    return str(d / "hf"), str(d / "tiny")


@pytest.fixture(scope="session")
def server(tiny_store):
    """A live server with an API key; a device tier of 4 of the 16 experts, so the cache really
    misses and evicts."""
    from runtime.serve.api import Server
    from runtime.serve.engine_proc import EngineConfig
    from runtime.store import Manifest
    from servehelp import KEY
    stride = Manifest.read(tiny_store[1]).blob_stride
    srv = Server(EngineConfig(model=tiny_store[1], expert_budget=4 * stride, max_batch=8, policy="lru"),
                 port=0, api_key=KEY).start()
    yield srv
    srv.close()
