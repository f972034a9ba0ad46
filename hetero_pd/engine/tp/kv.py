"""A tensor-parallel worker's KV as one whole-head cache in shared memory: each rank's
cache is the slice of its KV heads, so rank 0's transfer region holds every head and a
hand-off between workers of different TP sizes needs no resharding on the wire.

::

    /dev/shm file per tensor (K_0, V_0, K_1, ...), allocated by rank 0 (the worker):
        [num_blocks, block_size, num_kv_heads, head_dim]
    rank r's cache tensor = file[:, :, heads(r), :]        (a strided view, no copy)

    prefill TP 2                                              decode TP 1
    rank 0: heads [0, H/2) --+                           +--> rank 0: heads [0, H)
    rank 1: heads [H/2, H) --+-- blocks of all H heads --+

The region, the grants and the blocks on the wire are those of a TP 1 worker, so a
mismatched TP moves as many (and as large) writes as a matched one. Ranks write their heads
during a step; rank 0 reads or writes the blocks only between steps (or, layer by layer,
after a layer's last all-reduce, which every rank reaches only once its heads are written),
and a transfer into the cache lands before the step that reads it is broadcast. When TP
exceeds the KV head count (MLA's latent counts as one head), the ranks sharing a head write
the same values into it: the same bits, from the same inputs, weights and kernels.
"""

from __future__ import annotations

import math
import os

import torch

from hetero_pd.engine.model_runner import KVAllocator
from hetero_pd.models.config import ModelConfig
from hetero_pd.models.parallel import Parallel, kv_head_range


def shared_files(tensors: list[torch.Tensor]) -> list[str]:
    """The /dev/shm files behind `tensors` (ValueError if one is not file-backed)."""
    files = [t.untyped_storage().filename for t in tensors]
    if any(f is None for f in files):
        raise ValueError(
            "a tensor-parallel prefill or decode worker keeps its KV in shared memory the "
            "ranks map; its KV allocator gave tensors that are not file-backed"
        )
    return [str(f) for f in files]


def head_slices(cfg: ModelConfig, tp: Parallel, tensors: list[torch.Tensor]) -> KVAllocator:
    """A KV allocator (the model runner's) giving rank `tp.rank`'s heads of the whole-head
    `tensors`, after checking that the runner asks for what they hold."""
    heads = kv_head_range(cfg, tp.size, tp.rank)

    def allocate(
        num_layers: int,
        num_blocks: int,
        block_shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        tensors_per_layer: int,
    ) -> list[torch.Tensor]:
        want = (num_blocks, block_shape[0], cfg.num_kv_heads, *block_shape[2:])
        if len(tensors) != num_layers * tensors_per_layer or any(
            tuple(t.shape) != want or t.dtype != dtype or t.device != device for t in tensors
        ):
            first = tensors[0]
            raise ValueError(
                f"rank {tp.rank}'s KV: {num_layers * tensors_per_layer} tensors {want} "
                f"{dtype} on {device} asked for, the shared cache has {len(tensors)} "
                f"{tuple(first.shape)} {first.dtype} on {first.device}"
            )
        return [t[:, :, heads.start : heads.stop] for t in tensors]

    return allocate


def mapped_slices(
    cfg: ModelConfig,
    tp: Parallel,
    files: list[str],
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
) -> KVAllocator:
    """A KV allocator for a rank other than 0: rank 0's whole-head `files` mapped (the pool's
    `num_blocks` and the null block: the step runs eager under TP), this rank's heads given."""
    whole = (num_blocks + 1, *cfg.kv_block_shape(block_size))
    nbytes = math.prod(whole) * torch.empty((), dtype=dtype).element_size()
    for f in files:
        if os.path.getsize(f) != nbytes:
            raise ValueError(f"shared KV file {f}: {os.path.getsize(f)} bytes, not {nbytes}")
    tensors = [
        torch.from_file(f, shared=True, size=math.prod(whole), dtype=dtype).view(whole)
        for f in files
    ]
    return head_slices(cfg, tp, tensors)
