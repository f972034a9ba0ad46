"""The namespace of a model's KV blocks on the SSD: SSD files are shared only between
engines that would compute the same KV (same weights, dtype and block shape)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from hetero_pd.engine.kv_tiers import blockfile
from hetero_pd.models.fingerprint import weights_fingerprint


def kv_namespace(
    model_path: Path,
    dtype: torch.dtype,
    block_shape: tuple[int, ...],
    num_tensors: int,
    kv_layout: str = "nd",
) -> bytes:
    """16 bytes naming (weights, dtype, per-layer block shape, KV tensor count, file format,
    and the byte order inside blocks when it is not the standard nd)."""
    digest = hashlib.sha256(weights_fingerprint(model_path))
    layout = [blockfile.VERSION, str(dtype), list(block_shape), num_tensors]
    if kv_layout != "nd":  # nd files written before layouts existed keep their namespace
        layout.append(kv_layout)
    digest.update(json.dumps(layout).encode())
    return digest.digest()[:16]
