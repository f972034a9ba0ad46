"""Block layout arithmetic: chunk plans, gathers, scatters with dtype/block-size conversion.

A transfer moves ``len(src)`` source blocks of each tensor in a layer range. It is cut into
chunks, each ``(tensor, src[lo:hi])``; a chunk is the unit of framing, checksumming and
retransmission::

    tensor ti:  src blocks  [ 7  8  9 | 10 11 12 | 40 ]   -> chunks (ti,0,3) (ti,3,6) (ti,6,7)
                dst blocks  [ 2  5  6 |  9 10 11 | 12 ]      written by index, epoch-checked

When block sizes differ the receiver maps tokens: token ``t`` of the sequence goes to
``dst[t // bs_dst] * bs_dst + t % bs_dst`` of the token view of the destination tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class Chunk:
    """Frame ``seq``: blocks ``src[lo:hi]`` of region tensor ``ti``."""

    seq: int
    ti: int
    lo: int
    hi: int


def blocks_per_chunk(block_bytes: int, chunk_bytes: int, nblocks: int | None = None) -> int:
    """How many blocks go in one chunk: at most ``chunk_bytes`` worth (at least one block).

    With ``nblocks``, the blocks are spread evenly over the fewest chunks that fit, so a
    transfer's frames have (nearly) one size instead of full chunks plus a small tail: the
    receiver's allocator then reuses the same buffers frame after frame.
    """
    cap = max(1, chunk_bytes // max(block_bytes, 1))
    if nblocks is None or nblocks < 1:
        return cap
    nchunks = -(-nblocks // cap)
    return -(-nblocks // nchunks)


def plan(tensors: range, nblocks: int, blocks_per_chunk: int) -> list[Chunk]:
    """Chunks covering ``nblocks`` blocks of every tensor in ``tensors``."""
    chunks: list[Chunk] = []
    for ti in tensors:
        for lo in range(0, nblocks, blocks_per_chunk):
            chunks.append(Chunk(len(chunks), ti, lo, min(lo + blocks_per_chunk, nblocks)))
    return chunks


def is_run(ids: torch.Tensor) -> bool:
    """True when ``ids`` are consecutive ascending block ids (a plain slice)."""
    n = ids.numel()
    return n <= 1 or (int(ids[-1]) - int(ids[0]) == n - 1 and bool((ids.diff() == 1).all()))


def gather(tensor: torch.Tensor, ids: torch.Tensor, run: bool | None = None) -> torch.Tensor:
    """Blocks ``ids`` of ``tensor`` as one contiguous tensor (a view when they are a run).

    ``run`` is :func:`is_run` of ``ids`` (or of ids they are a slice of) when already known.
    """
    if is_run(ids) if run is None else run:
        first = int(ids[0])
        return tensor[first : first + ids.numel()]
    return tensor.index_select(0, ids.to(tensor.device))


def as_bytes(t: torch.Tensor) -> memoryview:
    """Zero-copy byte view of a contiguous CPU tensor (keeps ``t`` alive)."""
    arr: Any = t.reshape(-1).view(torch.uint8).numpy()
    return memoryview(arr)


def from_bytes(buf: memoryview, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Tensor view over received bytes (no copy); caller checked ``len(buf)``."""
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)


def scatter(
    dst: torch.Tensor,
    dst_ids: torch.Tensor,
    chunk: torch.Tensor,
    lo: int,
    src_block_size: int,
    num_tokens: int,
    dst_run: bool | None = None,
) -> None:
    """Write source blocks ``src[lo:lo+len(chunk)]`` (``chunk``) into ``dst``.

    ``dst_ids`` lists the destination blocks of the whole transfer (``dst_run``: their
    :func:`is_run`, when already known). Converts dtype, device and block size once, here.
    """
    data = chunk.to(device=dst.device, dtype=dst.dtype)
    n = chunk.shape[0]
    dst_block_size = int(dst.shape[1])
    if dst_block_size == src_block_size:
        idx = dst_ids[lo : lo + n]
        if is_run(idx) if dst_run is None else dst_run:
            first = int(idx[0])
            dst[first : first + n].copy_(data)
        else:
            dst.index_copy_(0, idx.to(dst.device), data)
        return
    inner = tuple(dst.shape[2:])
    pos = _token_positions(dst_ids, lo, n, src_block_size, dst_block_size, num_tokens)
    if pos.numel():
        rows = data.reshape(-1, *inner)[: pos.numel()]
        dst.view(-1, *inner).index_copy_(0, pos.to(dst.device), rows)


def _token_positions(
    dst_ids: torch.Tensor,
    lo: int,
    n: int,
    src_block_size: int,
    dst_block_size: int,
    num_tokens: int,
) -> torch.Tensor:
    """Rows of the destination's token view that source blocks ``[lo, lo+n)`` fill."""
    t0 = lo * src_block_size
    t1 = max(min(t0 + n * src_block_size, num_tokens), t0)
    tokens = torch.arange(t0, t1)
    return dst_ids[tokens // dst_block_size] * dst_block_size + tokens % dst_block_size


def sent_image(
    chunk: torch.Tensor, lo: int, src_block_size: int, dst_block_size: int, num_tokens: int
) -> torch.Tensor:
    """What writing ``chunk`` (already in the destination's dtype) leaves in the destination,
    in order: the blocks themselves, or only its real tokens when block sizes differ."""
    if dst_block_size == src_block_size:
        return chunk
    t0 = lo * src_block_size
    t1 = max(min(t0 + chunk.shape[0] * src_block_size, num_tokens), t0)
    return chunk.reshape(-1, *chunk.shape[2:])[: t1 - t0]


def landed_image(
    dst: torch.Tensor,
    dst_ids: torch.Tensor,
    lo: int,
    n: int,
    src_block_size: int,
    num_tokens: int,
    dst_run: bool | None = None,
) -> torch.Tensor:
    """The destination bytes a direct write of source blocks ``[lo, lo+n)`` produced, in the
    order of :func:`sent_image`, so both sides' checksums compare."""
    dst_block_size = int(dst.shape[1])
    if dst_block_size == src_block_size:
        idx = dst_ids[lo : lo + n]
        return gather(dst, idx, dst_run if dst_run is not None else None)
    pos = _token_positions(dst_ids, lo, n, src_block_size, dst_block_size, num_tokens)
    return dst.view(-1, *dst.shape[2:]).index_select(0, pos.to(dst.device))
