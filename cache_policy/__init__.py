"""Which expert lives where: keys, policies, prefetchers, placement, traces, replay, cost model.

Pure Python and numpy; imports no torch, so every policy is testable and fast on its own.
"""
from .keys import Capacity, ExpertKey, parse_bytes
from .placement import Pool, TieredPlacement
from .policies import POLICIES
from .prefetch import PREFETCHERS
from .replay import ReplayConfig, replay, replay_batch
from .synthetic import GEOMETRIES, SyntheticSpec, generate
from .traces import Trace, load_trace, trace_stats

__all__ = ["Capacity", "ExpertKey", "parse_bytes", "Pool", "TieredPlacement", "POLICIES", "PREFETCHERS",
           "ReplayConfig", "replay", "replay_batch", "GEOMETRIES", "SyntheticSpec", "generate", "Trace",
           "load_trace", "trace_stats"]
