"""Figures as the report shows them: mean / p50 / p99 of a list of microseconds, a number's cell, the CPU."""
from __future__ import annotations

import platform


def stats(xs: list) -> dict:
    import numpy as np
    if not xs:
        return {"mean": float("nan"), "p50": float("nan"), "p99": float("nan")}
    a = np.asarray(xs)
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99))}


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def fmt(x, nd=1) -> str:
    if x is None or (isinstance(x, float) and x != x):
        return "-"
    if isinstance(x, float):
        return f"{x:,.{nd}f}"
    return str(x)
