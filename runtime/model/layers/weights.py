"""Layers take their tensors out of the loaded dense dict at build time: a layer holds what it
computes with, and what no layer took is visible (``MoEModel.unused``)."""
from __future__ import annotations


def take(w: dict, name: str):
    """Remove and return ``name`` from the dense tensors; a missing one names itself."""
    try:
        return w.pop(name)
    except KeyError:
        raise KeyError(f"dense tensor {name!r} is missing from the converted store") from None


def take_opt(w: dict, name: str):
    return w.pop(name, None)


def layer_prefix(i: int) -> str:
    return f"model.layers.{i}."
