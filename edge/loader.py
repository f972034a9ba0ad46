"""Partial weight loading for the device: reads only the embeddings and layers [0, k) from a
model folder's safetensors files (other tensors are never read, and may be absent), plus a
fingerprint of the split that the cloud can compute from its own copy of the folder."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from edge.stack import EdgeStack
from hetero_pd.models.config import ModelConfig
from hetero_pd.models.loader import (
    ModelLoadError,
    copy_tensor,
    missing_tensors,
    weight_files,
)
from hetero_pd.models.rotary import rope_table

_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")
# Tensors the device never needs, whatever k is.
_CLOUD_ONLY = ("model.norm.weight", "lm_head.weight")


def edge_tensor_names(names: list[str], split_layer: int) -> list[str]:
    """The checkpoint tensors layers [0, split_layer) need: embeddings and those layers."""
    keep = []
    for name in names:
        m = _LAYER_INDEX.match(name)
        if m is not None:
            if int(m.group(1)) < split_layer:
                keep.append(name)
        elif name not in _CLOUD_ONLY:
            keep.append(name)
    return keep


def load_edge_stack(
    path: str | Path,
    split_layer: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | None = None,
    max_positions: int | None = None,
) -> EdgeStack:
    """Builds `EdgeStack` for layers [0, split_layer) on `device` in `dtype`, reading only the
    tensors it needs and checking every shape (a ModelLoadError names what is wrong)."""
    path = Path(path)
    cfg = ModelConfig.from_dir(path)
    device = device or torch.device("cpu")
    positions = max_positions or cfg.max_position_embeddings
    with torch.device("meta"):
        stack = EdgeStack(cfg, split_layer, positions)
    stack.to_empty(device=device)
    params = dict(stack.named_parameters())
    filled: dict[str, set[int | None]] = {}
    for file in weight_files(path):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                names = list(f.keys())
                for name in edge_tensor_names(names, split_layer):
                    copy_tensor(cfg, params, filled, name, f.get_tensor(name), file)
        except SafetensorError as e:
            raise ModelLoadError(f"{file}: corrupt or unreadable safetensors file ({e})") from e
    missing = [name for p in params for name in missing_tensors(p, filled.get(p, set()))]
    if missing:
        raise ModelLoadError(
            f"{path}: weights missing for {len(missing)} tensor(s) the edge needs "
            f"(layers [0, {split_layer})), e.g. {missing[:3]}"
        )
    stack.to(dtype)
    # Built after the dtype cast: the table stays float32, as in CausalLM.
    stack.cos_sin = rope_table(cfg, positions).to(device)
    return stack.eval()


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
