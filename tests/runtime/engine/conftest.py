import pytest

from runtime.model.synthetic import SyntheticModelSpec

SPEC = SyntheticModelSpec(num_layers=2, num_experts=8, hidden_size=64, intermediate_size=64, num_heads=2, num_kv_heads=1)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A tiny synthetic checkpoint converted to a store (one per test module)."""
    from runtime.model.convert import convert
    from runtime.model.synthetic import build_checkpoint
    d = tmp_path_factory.mktemp("engine")
    build_checkpoint(str(d / "hf"), SPEC)
    convert(str(d / "hf"), str(d / "s"))
    return str(d / "s")
