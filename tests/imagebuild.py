"""The server image for tests/docker/test_image.py, built on a background thread from the start of the session.

Building it is mostly waiting (debootstrap downloading Debian's packages, docker import, pip unpacking wheels
inside ``docker build``): about two and a half minutes that the rest of the suite runs beside when the root
conftest starts the build at collection (only when the image test is among the selected tests; it then runs
last). The test waits for the result. Nothing here is faked: the same daemon, base image, offline build and
image as before, only earlier.

The outcome is the image's name, or why there is none: ``("skip", reason)`` where Docker cannot run here (the
test skips, or fails under TIERED_MOE_REQUIRE_DOCKER=1), ``("error", message)`` where a build step failed."""
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

from helpers import ROOT

BASE = "tiered-moe-base:bookworm"
BUILD_BASE = "tiered-moe-build-base:bookworm"      # the wheel's build stage: the same Debian with gcc
IMAGE = "tiered-moe:test"


class StepFailed(AssertionError):
    pass


def sh(*args, timeout=600, check=True, **kw):
    r = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, **kw)
    if check and r.returncode != 0:
        raise StepFailed(f"{' '.join(args[:4])} ... failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r


def daemon_up() -> bool:
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0
    except subprocess.TimeoutExpired:      # a stale socket with no daemon behind it
        return False


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


def dangling_images() -> set:
    out = sh("docker", "images", "--filter", "dangling=true", "--quiet", "--no-trunc", check=False)
    return set(out.stdout.split()) if out.returncode == 0 else set()


class _Skip(Exception):
    pass


class ImageBuild:
    """The daemon (the running one, or one started here as root and stopped by ``close``), the Debian base
    image (debootstrap + docker import) and docker/Dockerfile built offline from wheels made here."""

    def __init__(self) -> None:
        self.outcome = None            # IMAGE, ("skip", reason) or ("error", message)
        self.dockerd = None
        self.work = tempfile.mkdtemp(prefix="tiered-moe-image-")
        self.dangling: "set | None" = None  # untagged images before the build: the build's own are removed by close
        self.thread = threading.Thread(target=self._run, name="image-build", daemon=True)

    def start(self) -> "ImageBuild":
        self.thread.start()
        return self

    def wait(self):
        self.thread.join()
        return self.outcome

    def _run(self) -> None:
        try:
            self._daemon()
            self.outcome = self._image(self._base(BASE, "python3,python3-venv,ca-certificates"),
                                       self._base(BUILD_BASE, "python3,python3-venv,gcc,libc6-dev,ca-certificates"))
        except _Skip as e:
            self.outcome = ("skip", str(e))
        except Exception as e:         # reported by the test that needs the image
            self.outcome = ("error", f"{type(e).__name__}: {e}")

    def _daemon(self) -> None:
        if shutil.which("docker") is None:
            raise _Skip("no docker client (Debian's docker.io; tests/install_docker.sh installs it)")
        if daemon_up():
            return
        if shutil.which("dockerd") is None or os.geteuid() != 0:
            raise _Skip("no Docker daemon, and none can be started here (needs dockerd and root)")
        log = open(os.path.join("/tmp", "tiered-moe-dockerd.log"), "w")
        self.dockerd = subprocess.Popen(["dockerd", "--bridge=none", "--iptables=false", "--ip6tables=false"],
                                        stdout=log, stderr=subprocess.STDOUT)
        deadline = time.time() + 60
        while not daemon_up():
            if self.dockerd.poll() is not None or time.time() > deadline:
                self.dockerd.kill()
                raise _Skip(f"dockerd did not start (see /tmp/tiered-moe-dockerd.log): exit {self.dockerd.poll()}")
            time.sleep(0.5)

    def _base(self, name: str, packages: str) -> str:
        if sh("docker", "image", "inspect", name, check=False).returncode == 0:
            return name
        if shutil.which("debootstrap") is None:
            raise _Skip("no debootstrap to build a base image (Debian's debootstrap; tests/install_docker.sh installs it)")
        mirror = debian_mirror()
        if mirror is None:
            raise _Skip("no Debian mirror in this machine's apt sources for debootstrap")
        root = os.path.join(self.work, "rootfs")
        shutil.rmtree(root, ignore_errors=True)
        sh("debootstrap", "--variant=minbase", f"--include={packages}", "bookworm", root, mirror, timeout=900)
        tar = subprocess.Popen(["tar", "-C", root, "-c", "."], stdout=subprocess.PIPE)
        sh("docker", "import", "-", name, stdin=tar.stdout, timeout=300)
        tar.wait()
        shutil.rmtree(root, ignore_errors=True)
        return name

    def _image(self, base: str, build_base: str) -> str:
        """docker/Dockerfile, built offline: every wheel made here first (with this machine's pip
        configuration, which serves the CPU torch)."""
        ctx = os.path.join(self.work, "ctx")
        os.makedirs(ctx)
        for name in ("pyproject.toml", "setup.py", "README.md", "LICENSE"):
            shutil.copy(os.path.join(ROOT, name), os.path.join(ctx, name))
        for name in ("cache_policy", "runtime", "docker"):
            shutil.copytree(os.path.join(ROOT, name), os.path.join(ctx, name),
                            ignore=shutil.ignore_patterns("__pycache__", "*.whl"))
        wheels = os.path.join(ctx, "docker", "wheels")
        # the CPU build this machine runs (2.13.0+cpu), read without importing torch on this thread
        from importlib.metadata import version
        torch_version = version("torch")
        sh(sys.executable, "-m", "pip", "wheel", "-q", "-w", wheels, f"torch=={torch_version}", "setuptools>=64",
           "wheel", ctx, timeout=900)
        self.dangling = dangling_images()
        sh("docker", "build", "--network", "host", "-f", os.path.join(ctx, "docker", "Dockerfile"), "--build-arg",
           f"BASE={base}", "--build-arg", f"BUILD_BASE={build_base}", "--build-arg", f"TORCH_SPEC=torch=={torch_version}", "--build-arg", "TORCH_INDEX=",
           "--build-arg", "PIP_ARGS=--no-index", "-t", IMAGE, ctx, timeout=1200)
        return IMAGE

    def close(self) -> None:
        """Remove the image and the untagged images its build left (the wheel's build stage), stop the daemon if this
        build started it, remove the build's files. Each build leaves about 2.4 GB: kept, a machine that runs the
        suite again and again fills its disk (the base images stay: they are rebuilt only when missing)."""
        if self.thread.is_alive():
            self.thread.join(timeout=1200)
        if self.dangling is not None and daemon_up():
            left = sorted(dangling_images() - self.dangling)
            sh("docker", "rmi", "-f", IMAGE, *left, check=False)
        if self.dockerd is not None:
            self.dockerd.terminate()
            try:
                self.dockerd.wait(30)
            except subprocess.TimeoutExpired:
                self.dockerd.kill()
        shutil.rmtree(self.work, ignore_errors=True)


_BUILD = None


def build() -> ImageBuild:
    """The session's build, started now if the root conftest did not start it at collection."""
    global _BUILD
    if _BUILD is None:
        _BUILD = ImageBuild().start()
    return _BUILD


def close() -> None:
    if _BUILD is not None:
        _BUILD.close()
