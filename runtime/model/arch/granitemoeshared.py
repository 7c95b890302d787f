"""Granite MoE with a shared expert (``granitemoeshared``): ``granitemoe`` plus an ungated shared MLP beside the
experts (``shared_intermediate_size`` wide; 0: none), stored as one ``shared_mlp.input_linear`` [2S, H] (gate rows,
then up) and ``shared_mlp.output_linear`` [H, S] (``sliced``); the routed and shared outputs' sum x
``residual_multiplier``."""
from . import granitemoe

sliding_layers = granitemoe.sliding_layers
stored_names = granitemoe.stored_names
_FUSED = {"gate_proj.weight": ("input_linear.weight", 0), "up_proj.weight": ("input_linear.weight", 1),
          "down_proj.weight": ("output_linear.weight", None)}


def sliced(name: str, cfg) -> "tuple | None":
    """Our shared MLP's gate / up / down as rows of the stored input_linear / output_linear."""
    head, sep, tail = name.rpartition(".shared_mlp.")
    if not sep or tail not in _FUSED:
        return None
    src, half = _FUSED[tail]
    S = cfg.shared_intermediate
    rows = (0, cfg.hidden_size) if half is None else (half * S, (half + 1) * S)
    return (f"{head}.shared_mlp.{src}", *rows)


def config(d: dict, common: dict, need) -> dict:
    return dict(granitemoe.config(d, common, need), shared_intermediate=int(d.get("shared_intermediate_size") or 0),
                shared_prefix="shared_mlp.")
