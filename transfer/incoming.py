"""One incoming transfer: what its BEGIN announced, validated against our region and ledger.

Nothing a peer sends is used before :func:`accept_begin` checked it: the region exists, the
block ids are in range, shapes, dtypes, block and token counts are consistent, the chunk
plan matches, the transport may be used from where the peer is, and the reservation named
by ``(request id, epoch)`` is live and granted to this very peer (NOT_GRANTED otherwise).
Every later chunk must then be exactly the chunk the plan puts at its sequence number.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from transfer import aead, checksum, kv_codec, kv_layouts, layout
from transfer.errors import StatusCode, TransferError
from transfer.ledger import Ledger, Reservation
from transfer.messages import Begin, End
from transfer.region import KVRegion, parse_dtype
from transfer.session import Identity, Session

DIRECT = frozenset({"local", "shm"})


class Early(NamedTuple):
    """A direct-write chunk checked before END (when its LANDED came)."""

    digest: int  # the digest it was checked against
    good: bool  # it matched
    by_writer: bool  # only the writer hashed it (``wv``): END spot-checks these


@dataclass(slots=True, eq=False)
class InTransfer:
    """State of one incoming transfer (all attempts of it)."""

    transfer_id: str
    session: Session
    reservation: Reservation
    region: KVRegion
    dst_ids: torch.Tensor
    dst_array: np.ndarray
    src_dtype: torch.dtype
    #: The sender's block layout (BEGIN ``fmt``); chunks are converted as they land.
    src_layout: str
    src_block_shape: tuple[int, ...]
    src_block_bytes: int
    tensors: range
    layers: range
    num_src_blocks: int
    num_tokens: int
    num_chunks: int
    blocks_per_chunk: int
    algo: str | None
    mode: str
    #: ``(request id, epoch)`` of the reservation it writes.
    fingerprint: tuple[str, int]
    #: 1 for every chunk received and verified.
    good: bytearray
    #: ``layout.is_run(dst_ids)``: chunks land with one slice copy each.
    dst_run: bool
    bad_checksum: set[int] = field(default_factory=set)
    #: Chunks whose checksum the hashing threads are computing (frames for them: dropped).
    verifying: set[int] = field(default_factory=set)
    #: An END that arrived while chunks were being verified (handled once they are).
    pending_end: tuple[Session, End] | None = None
    #: Direct writes: the chunks found bad by the check this END started (None: not done).
    direct_verdict: list[int] | None = None
    #: Direct writes: chunks checked when the writer said they landed, before END.
    early: dict[int, Early] = field(default_factory=dict)
    #: Direct writes: the number of the grant now open (LANDED of older grants is ignored).
    grant: int = 0
    last_seen: float = field(default_factory=time.monotonic)
    started: float = field(default_factory=time.monotonic)
    nbytes: int = 0
    #: How its stream chunks are encoded (:mod:`transfer.kv_codec`).
    codec: str = "none"
    #: :func:`transfer.aead.begin_digest` of its latest BEGIN (sealed chunks are under it).
    begin_digest: bytes = b""

    def chunk_nbytes(self, num_blocks: int) -> int:
        """The exact size a chunk of ``num_blocks`` blocks has on the wire."""
        itemsize = self.src_block_bytes // max(math.prod(self.src_block_shape), 1)
        return kv_codec.encoded_nbytes(self.codec, num_blocks, self.src_block_shape, itemsize)

    #: The chunk plan, built once on first use (:meth:`plan`).
    _plan: list[layout.Chunk] = field(default_factory=list)

    def plan(self) -> list[layout.Chunk]:
        """Every chunk of the transfer, as the sender cut it (LANDED and END both use it)."""
        if not self._plan:
            self._plan = layout.plan(self.tensors, self.num_src_blocks, self.blocks_per_chunk)
        return self._plan

    @property
    def peer(self) -> str:
        """The engine sending it (the only one whose frames count for it)."""
        return self.session.peer_id

    def is_planned(self, seq: int, tensor: int, lo: int, hi: int) -> bool:
        """True if chunk ``seq`` is exactly blocks ``[lo, hi)`` of ``tensor`` in the plan
        (so a damaged location can never land a chunk somewhere else)."""
        if not 0 <= seq < self.num_chunks:
            return False
        per_tensor = math.ceil(self.num_src_blocks / self.blocks_per_chunk)
        start = (seq % per_tensor) * self.blocks_per_chunk
        return (
            tensor == self.tensors.start + seq // per_tensor
            and lo == start
            and hi == min(start + self.blocks_per_chunk, self.num_src_blocks)
        )


def accept_begin(
    msg: Begin,
    session: Session,
    me: Identity,
    regions: dict[str, KVRegion],
    ledger: Ledger,
    max_frame_bytes: int,
    accepted_codec: str = "none",
) -> InTransfer:
    """Validate a BEGIN from ``session``; the new :class:`InTransfer` or a TransferError."""
    region = regions.get(msg.region)
    if region is None:
        raise TransferError(StatusCode.KV_CACHE_NOT_EXIST, f"no region {msg.region!r} here")
    # types and bounds were checked by the decoder; here: what they mean for this region
    dst, shape = msg.dst, tuple(msg.block_shape)
    region.check_blocks(dst, "destination")
    layers = range(*msg.layers)
    tensors = region.tensor_range((layers.start, layers.stop))
    src_dtype = parse_dtype(msg.dtype)
    block_size, num_src, num_tokens = msg.block_size, msg.num_src, msg.num_tokens
    num_chunks, per_chunk, mode = msg.num_chunks, msg.blocks_per_chunk, msg.mode
    block_bytes = math.prod(shape) * torch.empty((), dtype=src_dtype).element_size()
    problems = []
    if msg.tensors_per_layer != region.tensors_per_layer:
        problems.append(f"tensors per layer {msg.tensors_per_layer} != {region.tensors_per_layer}")
    if (
        len(shape) != len(region.block_shape)
        or shape[0] != block_size
        or shape[1:] != region.block_shape[1:]
    ):
        problems.append(f"block shape {shape} incompatible with {region.block_shape}")
    if not 0 < num_tokens <= num_src * block_size or per_chunk < 1:
        problems.append(f"{num_tokens} tokens in {num_src} blocks of {block_size}")
    elif block_size == region.block_size and len(dst) != num_src:
        problems.append(f"{num_src} source blocks for {len(dst)} destination blocks")
    elif block_size != region.block_size and len(dst) * region.block_size < num_tokens:
        problems.append(f"{len(dst)} destination blocks cannot hold {num_tokens} tokens")
    elif block_size != region.block_size and num_src > math.ceil(num_tokens / block_size):
        # (equal sizes: num_src is len(dst)) per-chunk state stays bounded by the reservation
        problems.append(f"{num_src} source blocks of {block_size} for {num_tokens} tokens")
    if per_chunk >= 1 and num_chunks != len(tensors) * math.ceil(num_src / per_chunk):
        problems.append(f"chunk count {num_chunks}")
    if per_chunk * block_bytes > max_frame_bytes and mode == "tcp":
        problems.append(f"chunks of {per_chunk * block_bytes} bytes exceed max_frame_bytes")
    if msg.checksum is not None and msg.checksum not in checksum.available():
        problems.append(f"checksum {msg.checksum!r} not installed here")
    codec_refusal = kv_codec.refusal(msg.codec, accepted_codec, mode, src_dtype)
    if codec_refusal is not None:
        problems.append(codec_refusal)
    if mode not in ("tcp", *DIRECT):
        problems.append(f"transport {mode!r} not accepted")
    elif mode != "tcp" and session.host != me.host:
        problems.append("direct transport from another host")
    elif mode == "shm" and region.shm_token is None:
        problems.append(f"region {region.name!r} is not in shared memory")
    elif mode == "local" and session.pid != me.pid:
        problems.append("local transport from another process")
    problems += _layout_problems(msg.layout, shape, src_dtype, block_size, region)
    if problems:
        raise TransferError(StatusCode.PARAM_INVALID, "; ".join(problems))
    dst_array = np.asarray(dst, dtype=np.int64)
    fingerprint = (msg.request_id, msg.epoch)
    reservation = ledger.check(region.name, *fingerprint, dst_array, writer=session.peer_id)
    return InTransfer(
        msg.transfer_id,
        session,
        reservation,
        region,
        torch.from_numpy(dst_array),
        dst_array,
        src_dtype,
        msg.layout,
        shape,
        block_bytes,
        tensors,
        layers,
        num_src,
        num_tokens,
        num_chunks,
        per_chunk,
        msg.checksum,
        mode,
        fingerprint,
        bytearray(num_chunks),
        bool(dst_array.size <= 1 or (np.diff(dst_array) == 1).all()),
        codec=msg.codec,
        begin_digest=aead.begin_digest(msg),
    )


def _layout_problems(
    fmt: str, shape: tuple[int, ...], dtype: torch.dtype, block_size: int, region: KVRegion
) -> list[str]:
    """Why blocks in layout ``fmt`` cannot land in ``region`` (``kv_layouts.CONVERSIONS``)."""
    why = kv_layouts.check(fmt, shape, dtype)
    if why is not None:
        return [f"source {why}"]
    if (fmt, region.layout) not in kv_layouts.CONVERSIONS:
        return [f"no conversion from KV layout {fmt!r} to {region.layout!r}"]
    if region.layout != kv_layouts.ND and block_size != region.block_size:
        return [f"block size {block_size} -> {region.block_size} needs an nd destination"]
    return []
