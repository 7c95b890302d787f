"""What a model takes on one device, the sums ``load_model`` splits a device budget by and ``tiered-moe plan``
reports (runtime/plan.py): the dense weights' bytes, the KV cache and per-sequence state of a context x
sequences, the tensors a pipeline stage holds, and the device's memory.

In the model package because ``load_model`` needs them as it loads: the planner above imports them."""
from __future__ import annotations

import math

import torch

from cache_policy import cost_model as cm
from cache_policy.layout import MultiGPU

from .layers.cache import kv_block_size
from .layers.kinds import cache_specs

GPU_MEMORY_UTILIZATION = 0.9   # the share of a device --device-budget auto takes (vLLM's gpu_memory_utilization)


def dense_bytes(tensors, dtype) -> int:
    """Bytes of the dense weights as the model holds them: floating-point tensors in the compute dtype, the
    rest (hash tables) as stored."""
    return int(sum(t.numel() * (dtype.itemsize if t.is_floating_point() else t.element_size()) for t in tensors))


def device_memory(device: "str | None", profile: "str | None") -> "tuple[int, str]":
    """(bytes, where from) of one rank's device: the CUDA device's total memory, else the profile's GPU."""
    if device is not None and str(device).startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.device(device)).total_memory, f"{device}'s memory"
    name = profile or "h200"
    return MultiGPU.of(cm.load_profile(name)).hbm_bytes, f"the {name} profile's GPU (no CUDA device here)"


def cache_bytes(cfg, dtype, context: int, batch: int, layers: "set | None" = None,
                snapshots: "int | None" = None) -> int:
    """KV blocks holding ``context`` tokens of each of ``batch`` sequences plus their fixed state, for the
    layers in ``layers`` (None: all), as PagedKV allocates them (whole blocks) - and, where the layers keep
    per-sequence state, the prefix cache's ``snapshots`` of it (the engine's default: one per sequence)."""
    specs = {i: s for i, s in cache_specs(cfg).items() if layers is None or i in layers}
    per_tok = sum(s.bytes_per_token(dtype) for s in specs.values() if hasattr(s, "bytes_per_token"))
    per_seq = sum(s.bytes_per_sequence(dtype) for s in specs.values() if hasattr(s, "bytes_per_sequence"))
    bs = kv_block_size(cfg)
    blocks = batch * -(-context // bs)
    return int(math.ceil(blocks * bs * per_tok)) + (batch + (batch if snapshots is None else snapshots)) * int(per_seq)


def stage_tensors(cfg, names, layers: set, first: bool, last: bool) -> list:
    """The dense tensors a pipeline stage holds: its layers', the embeddings on the first, norm and head on
    the last (a tied head reads the embeddings: the last stage keeps a copy)."""
    keep = []
    for n in names:
        if n.startswith("model.layers."):
            i = int(n.split(".")[2])
            if i in layers:
                keep.append(n)
        elif n == "model.embed_tokens.weight":
            if first or (last and cfg.tie_word_embeddings):
                keep.append(n)
        elif last:
            keep.append(n)
    return keep
