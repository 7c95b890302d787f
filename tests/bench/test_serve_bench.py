import os
import sys

import pytest
from helpers import ROOT

pytestmark = pytest.mark.slow


def test_serve_bench_quick(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import serve_bench
    rows = serve_bench.main(["--quick", "--out", str(tmp_path / "sb"), "--workdir", str(tmp_path / "w")])
    assert [r["concurrency"] for r in rows] == [1, 4]
    for r in rows:
        assert r["errors"] == 0 and r["requests"] == r["concurrency"]
        # What the clients counted equals what the server's Prometheus counter says it generated.
        assert r["generated_tokens"] == r["concurrency"] * 8 == r["server_generated_tokens"]
        assert 0 <= r["device_hit_rate"] <= 1 and r["ttft_p50_s"] > 0
    assert (tmp_path / "sb.md").read_text().count("\n| ") == 3
