"""Layers take their tensors out of the loaded dense dict at build time: a layer holds what it
computes with, and what no layer took is visible (``MoEModel.unused``).

The model hands the layers a ``DenseTensors``: the checkpoint's tensors as stored, with the device and
dtype the model computes in. ``take`` converts a tensor as it leaves (one converted copy alive at a
time); ``take_raw`` leaves it in the checkpoint's dtype for ``Linear``, which may keep bf16 weights
as they are (runtime/model/layers/dense.py)."""
from __future__ import annotations


class DenseTensors(dict):
    """name -> tensor as stored; ``device`` / ``dtype``: what ``take`` converts to; ``quant`` /
    ``act_quant``: ``--dense-quant`` and ``--host-act-quant``, for the ``Linear`` layers build."""

    def __init__(self, tensors: dict, device, dtype, quant: str = "none", act_quant: str = "none") -> None:
        super().__init__(tensors)
        self.device, self.dtype = device, dtype
        self.quant, self.act_quant = quant, act_quant


def linear_opts(w: dict, head: bool = False) -> dict:
    """``Linear``'s quantization options for a projection built from ``w`` (a plain dict: none). The
    head stays at 8 bits under ``--dense-quant int4`` (llama.cpp's Q4_0 keeps it at 6: the logits
    are what sampling reads)."""
    q = getattr(w, "quant", "none")
    return {"quant": "int8" if head and q != "none" else q, "act_quant": getattr(w, "act_quant", "none")}


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
