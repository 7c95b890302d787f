"""The server image, built and run for real: a Debian base from Debian's packages (debootstrap +
docker import: no image registry is reachable here), an offline build from wheels made on this
machine, the container serving a store from a read-only volume on loopback; /health, one
completion and /metrics checked from outside the container; inside it, the package imported from
site-packages only (the built wheel, not editable, no sources in the image or its working directory).

The image is built by tests/imagebuild.py on a background thread that the root conftest starts when this test
is selected (it then runs last), so the build overlaps the rest of the suite.

Skipped, saying why, where Docker cannot run (no dockerd, not root, the daemon does not start); with
TIERED_MOE_REQUIRE_DOCKER=1 (a machine where tests/install_docker.sh gives a daemon) that fails instead.
Everything stays on this machine: dockerd runs with --bridge=none --iptables=false, builds and
the container use the host network and the server binds 127.0.0.1.
"""
import json
import os
import socket
import time
import urllib.request

import pytest

import imagebuild
from imagebuild import sh

pytestmark = pytest.mark.slow



def no_docker(reason: str):
    """Like servehelp.require_tool: TIERED_MOE_REQUIRE_DOCKER=1 says this machine has Docker, so a missing piece fails."""
    if os.environ.get("TIERED_MOE_REQUIRE_DOCKER") == "1":
        pytest.fail(f"{reason} (TIERED_MOE_REQUIRE_DOCKER=1)", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="module")
def image():
    """The image tests/imagebuild.py builds (the daemon, a Debian base from debootstrap, docker/Dockerfile built
    offline): started by the root conftest at collection, so most of its build ran beside the other tests."""
    out = imagebuild.build().wait()
    if isinstance(out, tuple):
        kind, why = out
        if kind == "skip":
            no_docker(why)
        raise AssertionError(f"building the image failed: {why}")
    return out


# Run inside the container from its working directory (python -c puts it on sys.path, as -m does).
WHERE = r"""
import importlib, json, os, sysconfig
from importlib.metadata import distribution
site = os.path.realpath(sysconfig.get_paths()["purelib"])
mods = ("runtime", "runtime.cli", "runtime.serve.engine_proc", "runtime.model.config", "cache_policy")
modules = {m: os.path.realpath(importlib.import_module(m).__file__) for m in mods}
direct = json.loads(distribution("tiered-moe").read_text("direct_url.json") or "{}")
strays = []
for d, dirs, files in os.walk("/"):
    if d == "/":
        dirs[:] = [x for x in dirs if x not in ("proc", "sys", "dev")]
    if os.path.basename(d) in ("runtime", "cache_policy") and not os.path.realpath(d).startswith(site + os.sep) \
            and {"cli.py", "cost_model.py"} & set(files):
        strays.append(d)
print(json.dumps({"site": site, "modules": modules, "direct_url": direct, "strays": strays, "cwd": os.getcwd(),
                  "cwd_entries": sorted(os.listdir(".")),
                  "editable": bool(direct.get("dir_info", {}).get("editable"))}))
"""


# The kernels inside the container: where they came from, and that no compiler could have made them there.
KERNELS = r"""
import json, shutil
from runtime import kernels
flags = open("/proc/cpuinfo").read()
print(json.dumps({"ok": kernels.lib() is not None, "source": kernels.source(), "why": kernels.unavailable(),
                  "compilers": [c for c in ("gcc", "cc", "clang") if shutil.which(c)],
                  "cpu_ok": all(f in flags for f in ("avx2", "fma", "f16c"))}))
"""


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_image_builds_and_serves_from_outside(image, tiny_store):
    port = free_port()
    name = f"tiered-moe-test-{os.getpid()}"
    sh("docker", "run", "-d", "--rm", "--name", name, "--network", "host", "-v", f"{tiny_store[1]}:/models/store:ro",
       image, "tiered-moe", "serve", "--model", "/models/store", "--host", "127.0.0.1", "--port", str(port))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 180
        while True:
            try:
                if json.loads(urllib.request.urlopen(url + "/health", timeout=5).read())["status"] == "ok":
                    break
            except OSError:
                pass
            if time.time() > deadline:
                logs = sh("docker", "logs", name, check=False)
                raise AssertionError(f"the container never answered /health:\n{logs.stdout[-2000:]}{logs.stderr[-2000:]}")
            time.sleep(1)
        req = urllib.request.Request(url + "/v1/completions", data=json.dumps(
            {"model": "store", "prompt": "hello from outside", "max_tokens": 5, "temperature": 0}).encode(),
            headers={"Content-Type": "application/json"})
        r = json.loads(urllib.request.urlopen(req, timeout=60).read())
        assert r["usage"]["completion_tokens"] == 5 and r["choices"][0]["finish_reason"] == "length"
        metrics = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
        assert "tiered_moe_generation_tokens_total 5.0" in metrics
        # it runs as the unprivileged user the Dockerfile makes
        assert sh("docker", "exec", name, "id", "-u").stdout.strip() == "10001"
        # and from site-packages only: the wheel installed (not editable), no sources anywhere else,
        # not even in the working directory that `python -m` (the engine process) puts on sys.path
        where = json.loads(sh("docker", "exec", name, "python", "-c", WHERE).stdout)
        site = where["site"]
        assert "site-packages" in site and site.startswith("/opt/venv/"), where
        for mod, path in where["modules"].items():
            assert path.startswith(site + "/"), f"{mod} imports from {path}, not from site-packages {site}"
        assert not where["editable"], f"an editable install: {where['direct_url']}"
        assert where["strays"] == [], f"sources outside site-packages: {where['strays']}"
        assert not {"runtime", "cache_policy", "pyproject.toml"} & set(where["cwd_entries"]), where
        # the host kernels the wheel carries run, in an image with no C compiler (built in the build stage)
        kern = json.loads(sh("docker", "exec", name, "python", "-c", KERNELS).stdout)
        assert kern["compilers"] == [], kern
        if kern["cpu_ok"]:
            assert kern["ok"] and kern["source"].startswith("prebuilt (/opt/venv/"), kern
    finally:
        sh("docker", "rm", "-f", name, check=False)
