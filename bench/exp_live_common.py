"""The live model the runtime experiments (cache-aware routing, expert-aware batching, live
prefetch quality) run on: the demo's synthetic checkpoint, built once per workdir."""
import os
import tempfile

import exp_common  # noqa: F401 - puts the project on sys.path
from runtime.model.convert import convert
from runtime.model.synthetic import SyntheticModelSpec, build_checkpoint
from runtime.store import Manifest

DEFAULT_WORKDIR = os.path.join(tempfile.gettempdir(), "tiered-moe-experiments")


def demo_store(workdir: str = DEFAULT_WORKDIR) -> "tuple[str, SyntheticModelSpec]":
    spec = SyntheticModelSpec()
    hf, store = os.path.join(workdir, "hf"), os.path.join(workdir, "store")
    if not Manifest.current(store):
        build_checkpoint(hf, spec)
        convert(hf, store)
    return store, spec


def expert_budget(store: str, fraction: float) -> "tuple[int, int]":
    m = Manifest.read(store)
    slots = max(2, int(round(fraction * m.num_layers * m.num_experts)))
    return slots * m.blob_stride, slots
