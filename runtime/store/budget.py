"""How many expert slots a store's tiers get from their byte budgets, checked once: the device tier must
hold one layer's top-k, the host tier (inclusive) at least the device tier, and tensor-parallel ranks
need a host tier that holds every expert (their shared segment; a disk tier under them is not built)."""
from __future__ import annotations

from dataclasses import dataclass

from .layout import Manifest


@dataclass(frozen=True)
class TierSizes:
    device_slots: int            # per device pool: per layer under scope "layer", else for every layer at once
    host_slots: "int | None"     # per host pool, likewise; None: the host tier holds every expert of the store
    n_dev: int                   # slots of the device slab
    n_host: int                  # slots of the host slab

    @property
    def host_holds_all(self) -> bool:
        return self.host_slots is None


def tier_sizes(m: Manifest, *, device_budget: int, host_budget: "int | None", scope: str,
               min_experts_per_layer: int, world: int, full_stride: int, layers: tuple) -> TierSizes:
    """The slots of a store whose device slots hold ``m``'s blobs (a rank's slices under tensor parallelism:
    ``world`` ranks, ``full_stride`` the stored blob's stride) for the MoE layers [a, b) = ``layers``.
    ValueError naming the minimum budget where one is too small."""
    L, E, stride = m.num_layers, m.num_experts, m.blob_stride
    per_layer = scope == "layer"
    dev_total = int(device_budget) // stride
    dev_slots = dev_total // L if per_layer else dev_total
    need = min_experts_per_layer
    if dev_slots < need:
        need_bytes = need * stride * (L if per_layer else 1)
        raise ValueError(f"device budget {int(device_budget):,} bytes holds {dev_slots} expert(s)"
                         f"{' per layer' if per_layer else ''}; one layer's top-k needs {need}: "
                         f"the minimum is {need_bytes:,} bytes ({stride:,} bytes per expert)")
    host_slots = None
    if host_budget is not None:
        host_total = int(host_budget) // stride
        host_slots = host_total // L if per_layer else host_total
        if host_slots < dev_slots:
            raise ValueError(f"host budget {int(host_budget):,} bytes holds {host_slots} experts, fewer than the "
                             f"device tier's {dev_slots}: tiers are inclusive, the host needs at least "
                             f"{dev_slots * stride * (L if per_layer else 1):,} bytes")
        if host_slots >= (E if per_layer else L * E):
            host_slots = None
    if world > 1 and host_slots is not None:
        raise ValueError(f"tensor parallelism needs a host tier that holds every expert ({L * E * full_stride:,} "
                         f"bytes shared by the node's ranks); a host budget of {int(host_budget):,} bytes holds "
                         f"{host_slots} - drop --host-budget (a disk tier under tensor-parallel ranks is not built yet)")
    Ls = layers[1] - layers[0]          # the layers this store holds (all but under pipeline stages)
    n_dev = dev_slots * (Ls if per_layer else 1)
    n_host = Ls * E if host_slots is None else host_slots * (L if per_layer else 1)
    return TierSizes(dev_slots, host_slots, n_dev, n_host)
