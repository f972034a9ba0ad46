"""A fingerprint of an edge split that device and cloud each compute from their own copy of
the model folder; a session starts only when the two agree."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from safetensors import safe_open

from hetero_pd.models.config import ModelConfig
from hetero_pd.models.loader import ModelLoadError, weight_files


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
