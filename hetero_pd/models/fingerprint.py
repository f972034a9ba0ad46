"""Fingerprints that two processes compute from their own copy of a model folder and
compare before they exchange state: the weights (an SSD tier's namespace, a prefill and a
decode worker linking), the weights plus tokenizer, and an edge split."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import xxhash
from safetensors import safe_open

from hetero_pd.models.config import ModelConfig
from hetero_pd.models.loader import ModelLoadError, weight_files

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


def model_fingerprint(path: str | Path) -> str:
    """A short hex digest of the weights (:func:`weights_fingerprint`) and the tokenizer
    files: two workers whose KV is interchangeable agree on it."""
    path = Path(path)
    digest = hashlib.sha256(weights_fingerprint(path))
    for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"):
        if (path / name).is_file():
            digest.update(name.encode() + hashlib.sha256((path / name).read_bytes()).digest())
    return digest.hexdigest()[:16]


def split_fingerprint(path: str | Path, split_layer: int) -> str:
    """A short hex digest both sides compute from their copy of the model folder: the model's
    shape, the split layer, the tokenizer and the last edge layer's output projection.

    Edge and cloud agree on it only when they hold the same model split at the same layer.
    """
    path = Path(path)
    cfg = ModelConfig.from_dir(path)
    if not 1 <= split_layer < cfg.num_layers:
        raise ValueError(f"split layer {split_layer} is not in [1, {cfg.num_layers - 1}]")
    digest = hashlib.sha256()
    shape = (cfg.architecture, cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.head_dim)
    digest.update(json.dumps([*shape, cfg.num_kv_heads, split_layer]).encode())
    tokenizer = path / "tokenizer.json"
    if tokenizer.is_file():
        digest.update(hashlib.sha256(tokenizer.read_bytes()).digest())
    name = f"model.layers.{split_layer - 1}.self_attn.o_proj.weight"
    for file in weight_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            if name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                tensor = f.get_tensor(name).float().contiguous()
                digest.update(tensor.numpy().tobytes())
                return digest.hexdigest()[:16]
    raise ModelLoadError(f"{path}: no tensor {name!r} to fingerprint the split with")
