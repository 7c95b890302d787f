"""Expert tiers with real bytes: device slab, pinned host slab, disk files with a manifest."""
from .layout import Manifest, StoreWriter
from .store import ChecksumError, ExpertLoadError, ExpertStore, Fetch

__all__ = ["Manifest", "StoreWriter", "ChecksumError", "ExpertLoadError", "ExpertStore", "Fetch"]
