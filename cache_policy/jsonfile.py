"""Read a JSON object from a file, with an error that names the file."""
from __future__ import annotations

import json


def read_json(path: str) -> dict:
    try:
        with open(path) as f:
            d = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    except OSError as e:
        raise ValueError(f"{path}: cannot read ({e.strerror})") from None
    if not isinstance(d, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(d).__name__}")
    return d
