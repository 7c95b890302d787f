"""The server image, built and run for real: a Debian base from Debian's packages (debootstrap +
docker import: no image registry is reachable here), an offline build from wheels made on this
machine, the container serving a store from a read-only volume on loopback; /health, one
completion and /metrics checked from outside the container; inside it, the package imported from
site-packages only (the built wheel, not editable, no sources in the image or its working directory).

Skipped, saying why, where Docker cannot run (no dockerd, not root, the daemon does not start); with
TIERED_MOE_REQUIRE_DOCKER=1 (a machine where tests/install_docker.sh gives a daemon) that fails instead.
Everything stays on this machine: dockerd runs with --bridge=none --iptables=false, builds and
the container use the host network and the server binds 127.0.0.1.
"""
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from helpers import ROOT

pytestmark = pytest.mark.slow

BASE = "tiered-moe-base:bookworm"
IMAGE = "tiered-moe:test"


def sh(*args, timeout=600, check=True, **kw):
    r = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, **kw)
    if check and r.returncode != 0:
        raise AssertionError(f"{' '.join(args[:4])} ... failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r


def daemon_up() -> bool:
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0
    except subprocess.TimeoutExpired:      # a stale socket with no daemon behind it
        return False


def no_docker(reason: str):
    """Like servehelp.require_tool: TIERED_MOE_REQUIRE_DOCKER=1 says this machine has Docker, so a missing piece fails."""
    if os.environ.get("TIERED_MOE_REQUIRE_DOCKER") == "1":
        pytest.fail(f"{reason} (TIERED_MOE_REQUIRE_DOCKER=1)", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="module")
def docker():
    """A reachable Docker daemon: the running one, or one started here (root) and stopped after."""
    if shutil.which("docker") is None:
        no_docker("no docker client (Debian's docker.io; tests/install_docker.sh installs it)")
    proc = None
    if not daemon_up():
        if shutil.which("dockerd") is None or os.geteuid() != 0:
            no_docker("no Docker daemon, and none can be started here (needs dockerd and root)")
        log = open(os.path.join("/tmp", "tiered-moe-dockerd.log"), "w")
        proc = subprocess.Popen(["dockerd", "--bridge=none", "--iptables=false", "--ip6tables=false"],
                                stdout=log, stderr=subprocess.STDOUT)
        deadline = time.time() + 60
        while not daemon_up():
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                no_docker(f"dockerd did not start (see /tmp/tiered-moe-dockerd.log): exit {proc.poll()}")
            time.sleep(0.5)
    yield
    if proc is not None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def debian_mirror() -> "str | None":
    """The Debian mirror this machine's apt uses (deb822 or one-line sources)."""
    paths = ["/etc/apt/sources.list"] + [os.path.join("/etc/apt/sources.list.d", f)
                                         for f in sorted(os.listdir("/etc/apt/sources.list.d"))] \
        if os.path.isdir("/etc/apt/sources.list.d") else ["/etc/apt/sources.list"]
    for p in paths:
        try:
            text = open(p).read()
        except OSError:
            continue
        for line in text.splitlines():
            parts = line.split()
            if line.startswith("URIs:") and any(u.rstrip("/").endswith("/debian") for u in parts[1:]):
                return next(u for u in parts[1:] if u.rstrip("/").endswith("/debian"))
            if line.startswith("deb ") and len(parts) > 1:
                uri = next((x for x in parts[1:] if "://" in x), "")
                if uri.rstrip("/").endswith("/debian"):
                    return uri
    return None


@pytest.fixture(scope="module")
def base_image(docker, tmp_path_factory):
    if sh("docker", "image", "inspect", BASE, check=False).returncode == 0:
        return BASE
    if shutil.which("debootstrap") is None:
        no_docker("no debootstrap to build a base image (Debian's debootstrap; tests/install_docker.sh installs it)")
    mirror = debian_mirror()
    if mirror is None:
        no_docker("no Debian mirror in this machine's apt sources for debootstrap")
    root = str(tmp_path_factory.mktemp("rootfs") / "bookworm")
    sh("debootstrap", "--variant=minbase", "--include=python3,python3-venv,ca-certificates", "bookworm", root, mirror,
       timeout=900)
    tar = subprocess.Popen(["tar", "-C", root, "-c", "."], stdout=subprocess.PIPE)
    sh("docker", "import", "-", BASE, stdin=tar.stdout, timeout=300)
    tar.wait()
    shutil.rmtree(root, ignore_errors=True)
    return BASE


@pytest.fixture(scope="module")
def image(base_image, tmp_path_factory):
    """docker/Dockerfile, built offline: every wheel made here first (with this machine's pip
    configuration, which serves the CPU torch)."""
    ctx = tmp_path_factory.mktemp("ctx")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(os.path.join(ROOT, name), ctx / name)
    for name in ("cache_policy", "runtime", "docker"):
        shutil.copytree(os.path.join(ROOT, name), ctx / name, ignore=shutil.ignore_patterns("__pycache__", "*.whl"))
    wheels = ctx / "docker" / "wheels"
    torch_version = __import__("torch").__version__      # the CPU build this machine runs: 2.13.0+cpu
    sh(sys.executable, "-m", "pip", "wheel", "-q", "-w", str(wheels), f"torch=={torch_version}", "setuptools>=64",
       "wheel", str(ctx), timeout=900)
    sh("docker", "build", "--network", "host", "-f", str(ctx / "docker" / "Dockerfile"), "--build-arg", f"BASE={base_image}",
       "--build-arg", f"TORCH_SPEC=torch=={torch_version}", "--build-arg", "TORCH_INDEX=", "--build-arg",
       "PIP_ARGS=--no-index", "-t", IMAGE, str(ctx), timeout=1200)
    return IMAGE


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
    finally:
        sh("docker", "rm", "-f", name, check=False)
