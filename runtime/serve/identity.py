"""What the server says about itself: the package's version (``GET /version``) and ``system_fingerprint`` (on every
chat completion and completion object and chunk, as OpenAI returns it): a hash of that version and the store's
manifest (its experts' layout and checksums), so it changes when the code or the weights that answer do, and
not when the store is moved or the server restarted."""
from __future__ import annotations

import hashlib
import os


def package_version() -> str:
    """The installed tiered-moe's version; from pyproject.toml beside the package when it runs from a checkout."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("tiered-moe")
    except PackageNotFoundError:
        path = os.path.join(os.path.dirname(__file__), "..", "..", "pyproject.toml")
        try:
            import tomllib
            with open(path, "rb") as f:
                return tomllib.load(f)["project"]["version"]
        except (OSError, KeyError, ImportError, ValueError):
            return "unknown"


def system_fingerprint(store_dir: str) -> str:
    h = hashlib.sha256(package_version().encode())
    try:
        with open(os.path.join(store_dir, "manifest.json"), "rb") as f:
            h.update(f.read())
    except OSError:
        h.update(os.path.abspath(store_dir).encode())      # no manifest (never for a served store): its place
    return "fp_" + h.hexdigest()[:10]
