"""docker/: everything that can be checked without a Docker daemon."""
import json
import os
import re
import shlex
import subprocess
import sys

import pytest
import yaml
from helpers import ROOT

from servehelp import promtool

D = os.path.join(ROOT, "docker")


def test_prometheus_config_passes_promtool():
    r = promtool("check", "config", os.path.join(D, "prometheus.yml"))
    assert r.returncode == 0, r.stdout + r.stderr


def test_compose_file():
    c = yaml.safe_load(open(os.path.join(D, "compose.yaml")))
    assert set(c["services"]) == {"tiered-moe", "prometheus", "grafana"}
    srv = c["services"]["tiered-moe"]
    assert os.path.exists(os.path.join(D, srv["build"]["context"], srv["build"]["dockerfile"]))
    for name, s in c["services"].items():
        for port in s.get("ports", []):
            assert port.startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"
        for v in s.get("volumes", []):
            src = v.split(":")[0]
            if src.startswith("."):
                assert os.path.exists(os.path.join(D, src)), f"{name}: {src} does not exist"
            else:
                assert src in c["volumes"], f"{name}: named volume {src} is not declared"
    # The scrape target is the server's service name and port.
    prom = yaml.safe_load(open(os.path.join(D, "prometheus.yml")))
    assert prom["scrape_configs"][0]["static_configs"][0]["targets"] == ["tiered-moe:8000"]


def _serve_args(text):
    from runtime.cli import build_parser
    return build_parser().parse_args(text)


def test_container_commands_parse_with_our_cli():
    df = open(os.path.join(D, "Dockerfile")).read()
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", df, re.M).group(1))
    assert cmd[0] == "tiered-moe"
    a = _serve_args(cmd[1:])
    assert (a.cmd, a.host, a.port) == ("serve", "0.0.0.0", 8000)
    for line in re.findall(r"^COPY (?!--from=)(.+)$", df, re.M):     # from the build context (not a stage)
        for src in line.split()[:-1]:
            assert os.path.exists(os.path.join(ROOT, src)), f"Dockerfile copies {src}, which does not exist"
    c = yaml.safe_load(open(os.path.join(D, "compose.yaml")))
    srv = c["services"]["tiered-moe"]
    script = srv["command"][2]
    extra = re.search(r":-(.*)\}$", srv["environment"]["TIERED_MOE_ARGS"]).group(1)
    script = script.replace("$${TIERED_MOE_ARGS}", extra).replace('"$${TIERED_MOE_MODEL:-/models/demo/store}"',
                                                                   "/models/demo/store")
    build, serve = script.split("&&")
    build = shlex.split(build.split("then", 1)[1].split("; fi")[0])
    assert build[0] == "tiered-moe" and _serve_args(build[1:]).build_only
    serve = shlex.split(serve)
    assert serve[:2] == ["exec", "tiered-moe"]
    a = _serve_args(serve[2:])
    assert (a.cmd, a.model, a.prefetch) == ("serve", "/models/demo/store", "lookahead")


@pytest.mark.slow
def test_demo_build_only_prints_a_store(tmp_path):
    r = subprocess.run([sys.executable, "-m", "runtime.cli", "demo", "--build-only", "--workdir", str(tmp_path)],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(tmp_path / "store")
    assert os.path.exists(tmp_path / "store" / "manifest.json") and os.path.exists(tmp_path / "store" / "tokenizer.json")


def test_grafana_provisioning_and_dashboard():
    ds = yaml.safe_load(open(os.path.join(D, "grafana", "provisioning", "datasources", "prometheus.yml")))
    assert ds["datasources"][0]["url"] == "http://prometheus:9090"
    prov = yaml.safe_load(open(os.path.join(D, "grafana", "provisioning", "dashboards", "tiered-moe.yml")))
    assert prov["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    path = os.path.join(D, "grafana", "dashboards", "tiered-moe.json")
    dash = json.load(open(path))
    sys.path.insert(0, os.path.join(D, "grafana"))
    import make_dashboard
    assert dash == make_dashboard.dashboard(), "dashboard JSON is stale: run python docker/grafana/make_dashboard.py"
    titles = " ".join(p["title"].lower() for p in dash["panels"])
    for want in ("hit rate per tier", "per layer", "bytes/s per link", "stalled", "tokens/s", "batch size",
                 "unique experts", "latency"):
        assert want in titles
    uids = {p["datasource"]["uid"] for p in dash["panels"]}
    assert uids == {ds["datasources"][0]["uid"]}


def dashboard_exprs():
    dash = json.load(open(os.path.join(D, "grafana", "dashboards", "tiered-moe.json")))
    return [t["expr"] for p in dash["panels"] for t in p["targets"]]


@pytest.fixture
def exprs():
    return dashboard_exprs()


def test_dashboard_names_only_metrics_the_server_exports(exprs, server):
    import urllib.request
    text = urllib.request.urlopen(server.url + "/metrics").read().decode()
    exported = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    used = {n for e in exprs for n in re.findall(r"\btiered_moe_\w+", e)}
    assert used and used <= exported, used - exported
