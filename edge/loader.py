"""Partial weight loading for the device: reads only the embeddings and layers [0, k) from a
model folder's safetensors files (other tensors are never read, and may be absent).
`split_fingerprint` (from `hetero_pd.models.fingerprint`, which the cloud computes too)
identifies the split."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from edge.stack import EdgeStack
from hetero_pd.models.config import ModelConfig
from hetero_pd.models.fingerprint import split_fingerprint
from hetero_pd.models.loader import (
    ModelLoadError,
    copy_tensor,
    materialize,
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
    materialize(stack, device)
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
    missing = [name for p in params for name in missing_tensors(cfg, p, filled.get(p, set()))]
    if missing:
        raise ModelLoadError(
            f"{path}: weights missing for {len(missing)} tensor(s) the edge needs "
            f"(layers [0, {split_layer})), e.g. {missing[:3]}"
        )
    stack.to(dtype)
    # Built after the dtype cast: the table stays float32, as in CausalLM.
    stack.cos_sin = rope_table(cfg, positions).to(device)
    return stack.eval()


__all__ = ["edge_tensor_names", "load_edge_stack", "split_fingerprint"]
