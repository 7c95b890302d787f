"""What a model takes on one device, the sums ``load_model`` splits a device budget by and ``tiered-moe plan``
reports (runtime/plan.py): the dense weights' bytes, the KV cache and per-sequence state of a context x
sequences, the tensors a pipeline stage holds, and the device's memory.

In the model package because ``load_model`` needs them as it loads: the planner above imports them."""
from __future__ import annotations

import math

import torch

from cache_policy import cost_model as cm
from cache_policy.layout import MultiGPU

from .. import kernels

from .layers.cache import kv_block_size
from .layers.kinds import cache_specs

GPU_MEMORY_UTILIZATION = 0.9   # the share of a device --device-budget auto takes (vLLM's gpu_memory_utilization)
# What --host-budget auto leaves free of the memory available to the process: for the allocator, Python and
# torch's own buffers, the page cache of the store's reads, and the step's activations.
HOST_MARGIN_BYTES = 256 * 2**20
HOST_MARGIN_SHARE = 0.10


def _read_int(path: str) -> "int | None":
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def host_memory_available(proc: str = "/proc", cgroup: str = "/sys/fs/cgroup") -> "tuple[int, str]":
    """(bytes, where from) this process can still take: the kernel's MemAvailable, or less where its cgroup's
    memory limit (v2 memory.max, v1 memory.limit_in_bytes; page cache counted) leaves less above what the
    cgroup already uses."""
    avail, src = None, "MemAvailable"
    try:
        with open(f"{proc}/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    if avail is None:
        raise ValueError(f"cannot read MemAvailable from {proc}/meminfo: give --host-budget in bytes")
    rel = ""
    try:
        with open(f"{proc}/self/cgroup") as f:
            for line in f:          # v2: "0::/path"; v1: "N:memory:/path"
                parts = line.strip().split(":", 2)
                if len(parts) == 3 and (parts[1] == "" or "memory" in parts[1].split(",")):
                    rel = parts[2]
                    if parts[1]:
                        break
    except OSError:
        pass
    for d in {f"{cgroup}{rel}".rstrip("/"), cgroup, f"{cgroup}/memory{rel}".rstrip("/"), f"{cgroup}/memory"}:
        for lim_name, use_name in (("memory.max", "memory.current"), ("memory.limit_in_bytes", "memory.usage_in_bytes")):
            lim, use = _read_int(f"{d}/{lim_name}"), _read_int(f"{d}/{use_name}")
            if lim is not None and use is not None and lim < 1 << 60 and lim - use < avail:
                avail, src = max(0, lim - use), f"the cgroup limit {d}/{lim_name} ({lim:,} bytes) less its use"
    return avail, src


def default_cache_tokens(context: int, max_batch: int) -> int:
    """Token slots of the KV cache the engine makes when no budget is given (runtime/engine/engine.py):
    ``max_batch`` sequences of 1024 tokens, and at least one whole context up to 8192."""
    return max(max_batch * min(context, 1024), min(context, 8192))


def host_margin(avail: int) -> int:
    """The margin --host-budget auto leaves: HOST_MARGIN_BYTES + HOST_MARGIN_SHARE of what is available."""
    return HOST_MARGIN_BYTES + int(HOST_MARGIN_SHARE * avail)


def host_budget_auto(avail: int, dense: int, cache: int) -> int:
    """--host-budget auto: the memory available, less the dense weights still to be made, the KV cache and the
    margin (``host_margin``)."""
    return int(avail) - int(dense) - int(cache) - host_margin(int(avail))


def dense_bytes(tensors, dtype) -> int:
    """Bytes of the dense weights as the model holds them: floating-point tensors in the compute dtype, the
    rest (hash tables) as stored."""
    return int(sum(t.numel() * (dtype.itemsize if t.is_floating_point() else t.element_size()) for t in tensors))


# --dense-quant name -> bytes per weight of the codes and their scales (group 32: int8 + a float16 scale, int4 + a
# bf16 scale; layers/dense.py's _QUANT_FORMATS)
_DENSE_QUANT_BYTES = {"int8": 1 + 2 / 32, "int4": 0.5 + 2 / 32}


def dense_kept_bytes(named: dict, dtype, quant: str = "none", host_kernels: "bool | None" = None) -> int:
    """Bytes of the dense weights as a CPU model keeps them (layers/dense.py's ``Linear`` rules), for the one
    memory's budget: a projection (a 2-D floating ``*.weight`` other than the embeddings whose input size is a
    multiple of 32) is held as ``--dense-quant`` codes + scales (the head at int8), or, with the host kernels,
    as stored when stored bf16 (the bf16 GEMV reads it); everything else in ``dtype``. ``named``: name -> tensor
    (meta tensors do). ``host_kernels``: whether the host kernels load (None: ask them)."""
    if host_kernels is None:
        host_kernels = kernels.lib() is not None
    fast = host_kernels and dtype == torch.float32
    total = 0.0
    for name, t in named.items():
        if not t.is_floating_point():
            total += t.numel() * t.element_size()
            continue
        linear = (t.dim() == 2 and name.endswith(".weight") and "embed_tokens" not in name
                  and t.shape[1] % 32 == 0)
        if fast and linear and quant != "none":
            total += t.numel() * _DENSE_QUANT_BYTES["int8" if name.startswith("lm_head") else quant]
        elif fast and linear and t.dtype == torch.bfloat16:
            total += t.numel() * 2
        else:
            total += t.numel() * dtype.itemsize
    return int(total)


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
