"""Tensor-parallel ranks (runtime/parallel/shard.py: what a rank holds; group.py: the process group and its driver)."""
