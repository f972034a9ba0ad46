"""Tensor parallelism inside one engine: rank 0 drives the other ranks (group.py)."""
