"""Collectives between the ranks of a tensor-parallel worker: which torch.distributed
backend drives each device kind, and which device each rank takes."""

from __future__ import annotations

import torch

#: device kind -> torch.distributed backend (hccl comes with torch_npu).
COLLECTIVE_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


def collective_backend(device: torch.device) -> str:
    """The torch.distributed backend for tensors on `device`'s kind."""
    name = COLLECTIVE_BACKENDS.get(device.type)
    if name is None:
        raise ValueError(
            f"no collective backend is known for {device.type} devices; "
            f"known: {sorted(COLLECTIVE_BACKENDS)}"
        )
    return name


def bind_device(device: torch.device) -> None:
    """Makes `device` this process's current device, where its collectives run (NCCL and
    HCCL pick the current device; without this every rank would use index 0)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif device.type == "npu":
        torch.npu.set_device(device)  # type: ignore[attr-defined]  # torch_npu's


def rank_device(first: torch.device, rank: int) -> torch.device:
    """Rank `rank`'s device: the host for every CPU rank, else the `rank`-th device of the
    kind counted from `first` (a TP worker given cuda:2 with 2 ranks takes cuda:2, cuda:3)."""
    if first.type == "cpu":
        return first
    return torch.device(first.type, (first.index or 0) + rank)
