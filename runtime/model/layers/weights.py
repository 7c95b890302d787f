"""Layers take their tensors out of the loaded dense dict at build time: a layer holds what it
computes with, and what no layer took is visible (``MoEModel.unused``).

The model hands the layers a ``DenseTensors``: the checkpoint's tensors as stored, with the device and
dtype the model computes in. ``take`` converts a tensor as it leaves (one converted copy alive at a
time); ``take_raw`` leaves it in the checkpoint's dtype for ``Linear``, which may keep bf16 weights
as they are (runtime/model/layers/dense.py)."""
from __future__ import annotations


class DenseTensors(dict):
    """name -> tensor as stored; ``device`` / ``dtype``: what ``take`` converts to."""

    def __init__(self, tensors: dict, device, dtype) -> None:
        super().__init__(tensors)
        self.device, self.dtype = device, dtype


def take_raw(w: dict, name: str):
    """Remove and return ``name`` on the model's device, in the dtype it is stored in; a missing one
    names itself."""
    try:
        t = w.pop(name)
    except KeyError:
        raise KeyError(f"dense tensor {name!r} is missing from the converted store") from None
    return t.to(w.device) if isinstance(w, DenseTensors) else t


def take(w: dict, name: str):
    """Remove and return ``name`` in the model's compute dtype."""
    t = take_raw(w, name)
    return t.to(w.dtype) if isinstance(w, DenseTensors) else t


def compute_dtype(w: dict, t):
    """The dtype ``take`` converts to (a plain dict: ``t``'s own)."""
    return w.dtype if isinstance(w, DenseTensors) else t.dtype


def take_opt(w: dict, name: str):
    return take(w, name) if name in w else None


def layer_prefix(i: int) -> str:
    return f"model.layers.{i}."
