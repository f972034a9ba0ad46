"""Named KV block layouts and the conversions between them, chosen by (source, destination).

A region's blocks keep their logical shape ``[block_size, *inner]`` whatever their layout,
as torch_npu keeps a tensor's logical shape whatever its storage format; the layout says in
which order a block's bytes lie. Two layouts exist:

``nd`` (the standard, every backend but the NPU): token-major, row-major::

    element (t, c) of a block, c = flat index into inner (c = head * head_dim + dim)
    offset = t * C + c                                   C = prod(inner)

``fractal_nz`` (the NPU backend; in the spirit of Ascend's FRACTAL_NZ): the block is a
``[block_size, C]`` matrix cut into column strips ``C0`` elements (32 bytes) wide; strips
lie one after another, each holding every token's ``C0`` elements in token order::

    C0 = 32 // itemsize      (16 for bfloat16/float16, 8 for float32)
    C1 = C // C0             (C must be a multiple of C0)
    offset = (c // C0) * block_size * C0 + t * C0 + c % C0
    i.e. the block is stored as [C1, block_size, C0]

When ``block_size`` is a multiple of 16 this is exactly Ascend's FRACTAL_NZ of the block
matrix with ``16 x C0`` fractals (fractal ``(c // C0, t // 16)``, row ``t % 16``, column
``c % C0``): fractals of one column strip are consecutive, so strip-major order is the same.

A transfer converts once, where it writes: source layout (in the source dtype) -> nd ->
destination dtype -> destination layout (:func:`to_destination`). The entry for each pair
of layouts is in :data:`CONVERSIONS`; the pair comes from the sending region (the BEGIN's
``fmt``) and the receiving region (its ``layout``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

ND = "nd"
FRACTAL_NZ = "fractal_nz"
LAYOUTS = (ND, FRACTAL_NZ)
#: Bytes in one fractal row (Ascend's C0 is 32 bytes of any dtype).
NZ_ROW_BYTES = 32


def nz_c0(dtype: torch.dtype) -> int:
    """Elements per fractal row of ``dtype`` (16 for 2-byte types, 8 for float32)."""
    return max(1, NZ_ROW_BYTES // torch.empty((), dtype=dtype).element_size())


def check(layout: str, block_shape: tuple[int, ...], dtype: torch.dtype) -> str | None:
    """Why blocks of ``block_shape`` and ``dtype`` cannot have ``layout`` (None: they can)."""
    if layout not in LAYOUTS:
        return f"unknown KV layout {layout!r}; known: {', '.join(LAYOUTS)}"
    if layout == FRACTAL_NZ:
        width, c0 = math.prod(block_shape[1:]), nz_c0(dtype)
        if width % c0:
            return (
                f"{FRACTAL_NZ} needs the per-token width ({width} = prod{block_shape[1:]}) to be "
                f"a multiple of {c0} ({NZ_ROW_BYTES} bytes of {dtype})"
            )
    return None


def nd_to_nz(x: torch.Tensor) -> torch.Tensor:
    """Blocks ``x`` ``[n, block_size, *inner]`` in nd -> the same blocks in fractal_nz."""
    n, bs = x.shape[0], x.shape[1]
    c0 = nz_c0(x.dtype)
    strips = x.reshape(n, bs, -1, c0)  # [n, bs, C1, C0]
    return strips.permute(0, 2, 1, 3).contiguous().view(x.shape)


def nz_to_nd(x: torch.Tensor) -> torch.Tensor:
    """Blocks ``x`` in fractal_nz -> the same blocks in nd (inverse of :func:`nd_to_nz`)."""
    n, bs = x.shape[0], x.shape[1]
    c0 = nz_c0(x.dtype)
    strips = x.reshape(n, -1, bs, c0)  # [n, C1, bs, C0]
    return strips.permute(0, 2, 1, 3).contiguous().view(x.shape)


Convert = Callable[[torch.Tensor, torch.dtype, torch.device], torch.Tensor]


def _nd_nd(x: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return x.to(device=device, dtype=dtype)


def _nz_nd(x: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return nz_to_nd(x).to(device=device, dtype=dtype)


def _nd_nz(x: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return nd_to_nz(x.to(device=device, dtype=dtype))


def _nz_nz(x: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if nz_c0(dtype) == nz_c0(x.dtype):  # same strip width: the element order is kept
        return x.to(device=device, dtype=dtype)
    return nd_to_nz(nz_to_nd(x).to(device=device, dtype=dtype))


#: (source layout, destination layout) -> conversion of source blocks (in the source dtype)
#: into the destination's dtype, device and layout.
CONVERSIONS: dict[tuple[str, str], Convert] = {
    (ND, ND): _nd_nd,
    (FRACTAL_NZ, ND): _nz_nd,
    (ND, FRACTAL_NZ): _nd_nz,
    (FRACTAL_NZ, FRACTAL_NZ): _nz_nz,
}


def to_destination(
    chunk: torch.Tensor, src_layout: str, dst_layout: str, dst: torch.Tensor
) -> torch.Tensor:
    """Source blocks ``chunk`` (``src_layout``, source dtype) as the destination tensor
    ``dst`` holds blocks: its dtype, device and ``dst_layout``."""
    return CONVERSIONS[src_layout, dst_layout](chunk, dst.dtype, dst.device)


def read_slots(cache: torch.Tensor, slots: torch.Tensor, layout: str) -> torch.Tensor:
    """Rows ``[len(slots), *inner]`` of a cache ``[num_blocks, block_size, *inner]`` in
    ``layout``; slot = block * block_size + token (what an engine's attention reads)."""
    inner = cache.shape[2:]
    if layout == ND:
        return cache.view(-1, *inner).index_select(0, slots)
    bs = cache.shape[1]
    strips = cache.view(cache.shape[0], -1, bs, nz_c0(cache.dtype))  # [nb, C1, bs, C0]
    return strips[slots // bs, :, slots % bs].reshape(slots.shape[0], *inner)


def write_slots(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, layout: str) -> None:
    """Writes ``rows`` ``[len(slots), *inner]`` at ``slots`` of a cache in ``layout``."""
    if layout == ND:
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, rows)
        return
    bs, c0 = cache.shape[1], nz_c0(cache.dtype)
    strips = cache.view(cache.shape[0], -1, bs, c0)
    strips[slots // bs, :, slots % bs] = rows.reshape(slots.shape[0], -1, c0).to(cache.dtype)
