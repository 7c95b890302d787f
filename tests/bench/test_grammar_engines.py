"""bench/grammar_engines.py --quick: it runs, llguidance's generations are valid JSON of the schema, the bench's own
validity verdicts agree with an independent check, and engines that are not installed are skipped with a reason
(CI installs only the project's dependencies: llguidance, not xgrammar or outlines-core)."""
import json
import os
import subprocess
import sys
import time

import pytest

from helpers import ROOT

sys.path.insert(0, os.path.join(ROOT, "bench"))

pytestmark = pytest.mark.slow


def test_validator():
    import grammar_engines as ge
    flat = ge.SCHEMAS["flat"]
    assert ge.check_output('{"name":"ab","age":3,"role":"user"}', flat) == []
    assert ge.check_output('{"name":"ab","age":3.5,"role":"user"}', flat)            # not an integer
    assert ge.check_output('{"name":"' + "x" * 21 + '","age":3,"role":"user"}', flat)  # maxLength 20
    assert ge.check_output('{"name":"ab","age":3,"role":"root"}', flat)               # not in the enum
    assert ge.check_output('{"name":"ab","age":3}', flat)                             # required
    assert ge.check_output('{"name":"ab","age":3,"role":"user","x":1}', flat)         # additionalProperties
    assert ge.check_output('{"name":"a\x01","age":3,"role":"user"}', flat)            # raw control char: not JSON
    assert ge.check_output('{"name":"ab","age":NaN,"role":"user"}', flat)
    nested = ge.SCHEMAS["nested"]
    item = {"sku": "a", "qty": 1, "tags": ["t"]}
    assert ge.check_output(json.dumps({"id": 1, "items": [item] * 5}), nested) == []
    assert ge.check_output(json.dumps({"id": 1, "items": [item] * 6}), nested)         # maxItems 5
    assert ge.check_output(json.dumps({"id": 1, "items": [{**item, "tags": ["123456789"]}]}), nested)
    assert ge.check_output("[]", ge.SCHEMAS["json_object"])
    assert ge.check_output('{"a":[1,{"b":null}]}', ge.SCHEMAS["json_object"]) == []


def test_quick(tmp_path):
    import grammar_engines as ge
    out = tmp_path / "out.json"
    t0 = time.time()
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "grammar_engines.py"), "--quick",
                        "--outdir", str(tmp_path), "--json", str(out), "--workdir", str(tmp_path / "tok")],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    assert time.time() - t0 < 120      # --quick is meant for seconds (< 30 s on a 2-core machine, alone)
    d = json.loads(out.read_text())
    md = (tmp_path / "grammar_engines.md").read_text()
    assert "Command: `python bench/grammar_engines.py --quick" in md and "## Conclusion" in md
    by_engine = {r["engine"]: r for r in d["results"]}
    # Every engine: run, or not importable and skipped with its reason in the report.
    for name in ge.MODULE:
        if ge.importable(name) is not None:
            assert name in d["skipped"] and name not in by_engine
            assert f"{name}: " in md.split("Skipped (not importable here):")[1].split("\n")[0]
        else:
            assert name in by_engine, (name, d["skipped"].get(name))
    llg = by_engine["llguidance"]
    assert llg["status"] == "ok", llg
    assert llg["outputs"] and llg["summary"]["steps"] > 0 and llg["summary"]["step"]["mean"] > 0
    for r in d["results"]:
        assert r["status"] == "ok", r
        schema = ge.SCHEMAS[r["schema"]]
        for o in r["outputs"]:
            # An independent check of what the bench concluded about each output.
            try:
                v = json.loads(o["text"])
                ok = o["ended"] and ge.validate(v, schema) == []
            except ValueError:
                ok = False
            assert ok == (not o["errors"]), (r["engine"], o)
            if r["engine"].startswith("llguidance"):     # the engine the server uses: always valid
                assert ok, o
    # The runtime's own conversion and the in-place variant see the same masks: the same tokens.
    if "llguidance-inplace" in by_engine:
        assert by_engine["llguidance-inplace"]["tokens"] == llg["tokens"]
        assert by_engine["llguidance-inplace"]["agreement"]["identical"] == \
            by_engine["llguidance-inplace"]["agreement"]["compared"]
