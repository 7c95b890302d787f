import json
import os
import sys

import pytest
from helpers import ROOT

pytestmark = pytest.mark.slow


def test_spec_live_quick(tmp_path):
    """bench/spec_live.py end to end on the quick model: every fixture runs live, and each projection is the cost
    model's formula recomputed here from the step times the run stored (E[tokens](k) at the measured acceptance over
    T0 + V(k) - F(1) + D(k), summed over the live run's draft lengths)."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import spec_live
    spec_live.main(["--quick", "--rounds", "1", "--outdir", str(tmp_path / "out"), "--workdir", str(tmp_path)])
    d = json.loads((tmp_path / "out" / "spec_live.json").read_text())
    rnd = d["rounds"][0]
    F = {int(c): v for c, v in rnd["F_s"].items()}
    fx = rnd["fixtures"]
    assert set(fx) == {"plain", "copy", "copy @ 0.6", "copy, cost rule", "1-layer draft", "1-layer draft, cost rule"}
    assert fx["copy"]["acceptance"] > 0.95           # a copy of the target: q = p (sampled), kept up to rounding
    assert fx["copy"]["rejections"] <= 1 and any(fx["copy"]["ks"])
    assert fx["copy @ 0.6"]["kept"] + fx["copy @ 0.6"]["rejections"] > 0
    assert fx["1-layer draft"]["times"] == "small" and fx["copy @ 0.6"]["times"] == "copy @ 0.6"
    for name in ("copy", "copy @ 0.6", "copy, cost rule", "1-layer draft", "1-layer draft, cost rule"):
        f = fx[name]
        a = min(1.0, f["acceptance"])
        D = {int(k): v for k, v in rnd["D_s"][f["times"]].items()}
        V = {int(k): v for k, v in rnd["V_s"][f["times"]].items()}
        tokens = sum((k + 1 if a >= 1 else (1 - a ** (k + 1)) / (1 - a)) if k else 1 for k in f["ks"])
        secs = sum(rnd["T0_s"] + ((V[k] - F[1] + D[k]) if k else 0.0) for k in f["ks"])
        assert f["projected"]["tokens_per_s"] == pytest.approx(tokens / secs, rel=1e-9)
        assert f["ratio"] == pytest.approx(f["live_tokens_per_s"] / (tokens / secs), rel=1e-9)
    md = (tmp_path / "out" / "spec_live.md").read_text()
    assert "live / projected" in md and md.count("\n| copy") == 3 and md.count("\n| 1-layer draft") == 2
