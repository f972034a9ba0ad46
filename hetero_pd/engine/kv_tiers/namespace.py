"""The namespace of a model's KV blocks on the SSD: SSD files are shared only between
engines that would compute the same KV (same weights, dtype and block shape)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
import xxhash

from hetero_pd.engine.kv_tiers import blockfile
from hetero_pd.models.loader import weight_files

_SAMPLES = 16
_SAMPLE_BYTES = 64 * 1024


def weights_fingerprint(path: Path) -> bytes:
    """A digest of the model folder's config and weights: each safetensors file's size and
    header (tensor names, dtypes, shapes, offsets) and 16 samples of its bytes, so a
    fine-tune with the same shapes differs too, without reading gigabytes at start."""
    digest = hashlib.sha256((path / "config.json").read_bytes())
    for file in weight_files(path):
        size = file.stat().st_size
        digest.update(f"{file.name}:{size}".encode())
        with file.open("rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            digest.update(f.read(min(header_len, size)))
            for i in range(_SAMPLES):
                f.seek(size * i // _SAMPLES)
                digest.update(xxhash.xxh3_64_digest(f.read(_SAMPLE_BYTES)))
    return digest.digest()


def kv_namespace(
    model_path: Path, dtype: torch.dtype, block_shape: tuple[int, ...], num_tensors: int
) -> bytes:
    """16 bytes naming (weights, dtype, per-layer block shape, KV tensor count, file format)."""
    digest = hashlib.sha256(weights_fingerprint(model_path))
    layout = [blockfile.VERSION, str(dtype), list(block_shape), num_tensors]
    digest.update(json.dumps(layout).encode())
    return digest.digest()[:16]
