"""Frames of the data channel: one fixed 48-byte binary header, then a body.

The data channel (:mod:`transfer.transports.tcp.channel`) is a plain TCP stream, so every
frame states its body length up front and the receiver can land the body wherever it wants
(straight into destination blocks). Headers are parsed with :mod:`struct` and validated
before use; bodies are raw tensor bytes or a msgpack header checked by :mod:`transfer.wire`.
Never pickle::

    offset  size  field
         0     4  magic  b"HPDC"
         4     1  version
         5     1  kind    1 PREFACE (body: session token)  2 MESSAGE (body: msgpack BEGIN/END)
                          3 DATA (body: chunk payload)
         6     2  flags   bit 0: ``digest`` is set; bit 1: the body is followed by an
                          8-byte little-endian digest of it (a trailer, not counted in
                          ``length``), for senders that hash each piece just before the
                          kernel copies it, while it is in the cache; bit 2: the body is
                          sealed (DATA of a sealed session: :mod:`transfer.aead`, the
                          header its associated data)
         8     8  stream  the sender's number for the transfer (BEGIN names it, DATA uses it)
        16    16  seq, ti, lo, hi   (uint32 each) chunk location, as in the DATA message
        32     8  length  body bytes
        40     8  digest  checksum of the body (DATA)
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from backends.cpuinfo import l2_cache_bytes
from transfer import aead, envs, wire
from transfer.auth import NONCE_BYTES

HEADER = struct.Struct("<4sBBHQIIIIQQ")
HEADER_BYTES = HEADER.size
MAGIC = b"HPDC"
VERSION = 2
PREFACE, MESSAGE, DATA = 1, 2, 3
FLAG_DIGEST = 1
FLAG_TRAILER = 2
FLAG_SEALED = 4
TRAILER_BYTES = 8
_U32 = (1 << 32) - 1
#: Checksummed chunks are hashed in pieces of this size on both ends, each while the
#: kernel's copy of it is still in this core's cache (``envs.hash_piece_bytes``).
HASH_PIECE = envs.hash_piece_bytes(l2_cache_bytes())


@dataclass(frozen=True, slots=True)
class FrameHeader:
    """A validated data-channel header."""

    kind: int
    stream: int
    seq: int
    ti: int
    lo: int
    hi: int
    length: int
    digest: int | None
    #: The body's digest follows it (``TRAILER_BYTES``, little-endian).
    trailer: bool = False
    #: The body is a sealed chunk (``aead.OVERHEAD`` bytes more than the chunk).
    sealed: bool = False


def pack(
    kind: int,
    length: int,
    stream: int = 0,
    seq: int = 0,
    ti: int = 0,
    lo: int = 0,
    hi: int = 0,
    digest: int | None = None,
    trailer: bool = False,
    sealed: bool = False,
) -> bytes:
    """Encode one header."""
    flags = (0 if digest is None else FLAG_DIGEST) | (FLAG_TRAILER if trailer else 0)
    flags |= FLAG_SEALED if sealed else 0
    return HEADER.pack(MAGIC, VERSION, kind, flags, stream, seq, ti, lo, hi, length, digest or 0)


def unpack(raw: bytes | bytearray | memoryview, max_payload: int) -> FrameHeader:
    """Parse and bound-check a header; raises :class:`wire.FrameError` (stream is unusable)."""
    magic, version, kind, flags, stream, seq, ti, lo, hi, length, digest = HEADER.unpack(raw)
    if magic != MAGIC:
        raise wire.FrameError("malformed", "data channel magic")
    if version != VERSION:
        raise wire.FrameError("bad_version", f"data channel v{version}")
    # a trailer comes instead of a header digest, and never after a sealed body
    exclusive = (FLAG_DIGEST | FLAG_TRAILER, FLAG_TRAILER | FLAG_SEALED)
    if flags & ~(FLAG_DIGEST | FLAG_TRAILER | FLAG_SEALED) or any(
        flags & both == both for both in exclusive
    ):
        raise wire.FrameError("malformed", f"data channel flags {flags:#x}")
    if flags & (FLAG_TRAILER | FLAG_SEALED) and kind != DATA:
        raise wire.FrameError("malformed", f"flags {flags:#x} on a kind {kind} frame")
    sealed = bool(flags & FLAG_SEALED)
    if kind == PREFACE:
        ok = length == NONCE_BYTES
    elif kind == MESSAGE:
        ok = 0 < length <= wire.MAX_HEADER_BYTES
    elif kind == DATA:
        ok = aead.OVERHEAD * sealed < length <= max_payload + aead.OVERHEAD * sealed
    else:
        raise wire.FrameError("unknown_type", f"data channel kind {kind}")
    if not ok:
        raise wire.FrameError("oversized", f"kind {kind} with {length} bytes")
    return FrameHeader(
        kind,
        stream,
        seq,
        ti,
        lo,
        hi,
        length,
        digest if flags & FLAG_DIGEST else None,
        bool(flags & FLAG_TRAILER),
        sealed,
    )


def preface(token: bytes) -> list[bytes]:
    """The first frame of a data connection: binds it to the session ``token``."""
    return [pack(PREFACE, len(token)), token]


def message(stream: int, header: bytes) -> bytes:
    """Header of a MESSAGE frame carrying the msgpack ``header`` (BEGIN / END)."""
    return pack(MESSAGE, len(header), stream)


def data(
    stream: int,
    seq: int,
    ti: int,
    lo: int,
    hi: int,
    length: int,
    digest: int | None,
    trailer: bool = False,
    sealed: bool = False,
) -> bytes:
    """Header of a DATA frame (``trailer``: its digest follows the body instead; ``sealed``:
    ``length`` counts the sealed body)."""
    if max(seq, ti, lo, hi) > _U32:
        raise ValueError("chunk location does not fit the data channel header")
    return pack(DATA, length, stream, seq, ti, lo, hi, digest, trailer, sealed)


def trailer(digest: int) -> bytes:
    """The bytes that follow a trailer frame's body."""
    return digest.to_bytes(TRAILER_BYTES, "little")
