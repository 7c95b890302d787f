import json
import os
import sys

import pytest
from helpers import ROOT

pytestmark = pytest.mark.slow


def test_prefix_isolation_quick(tmp_path):
    """bench/prefix_isolation.py end to end: with a shared cache every probe reuses the victim's whole blocks; with
    different salts or isolated keys at most one block (the attacker's own earlier requests: the chat template's
    opening) - the victim's prefix never."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import prefix_isolation
    prefix_isolation.main(["--quick", "--trials", "3", "--outdir", str(tmp_path / "out"), "--workdir", str(tmp_path)])
    d = json.loads((tmp_path / "out" / "prefix_isolation.json").read_text())
    shared = d["shared cache"]["cached_tokens"]
    assert len(shared) == 3 and min(shared) >= 256
    for way in ("different cache_salt", "API keys isolated"):
        assert max(d[way]["cached_tokens"]) <= 16, (way, d[way]["cached_tokens"])
    assert (tmp_path / "out" / "prefix_isolation.md").read_text().count("\n| ") == 4
