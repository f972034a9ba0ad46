"""One KV block on the SSD: a checked header, then the block's bytes.

    +-------------------------------------------------------------------+
    | magic "HPDKVBLK" | version u16 | 0 u16 | num_tokens u32            |
    | namespace 16 B (model fingerprint, dtype, block shape)            |
    | block hash u64 | payload length u64 | payload xxh3 u64            |
    | token ids, num_tokens x i64                                       |
    | header xxh3 u64 (of everything above)                             |
    +-------------------------------------------------------------------+
    | payload: the block's KV, all layers, [2 * num_layers, *block]     |
    +-------------------------------------------------------------------+

A file is served only when every field matches what the reader expects and both checksums
agree; anything else (truncation, bit rot, another model's file) is a miss, never wrong KV.
"""

from __future__ import annotations

import struct
from array import array

import xxhash

MAGIC = b"HPDKVBLK"
VERSION = 1
_FIXED = struct.Struct("<8sHHI16sQQQ")
_DIGEST = struct.Struct("<Q")


class BlockFileError(ValueError):
    """A block file that must not be used, with the reason."""


def header_size(num_tokens: int) -> int:
    return _FIXED.size + 8 * num_tokens + _DIGEST.size


def encode_header(
    namespace: bytes, block_hash: int, token_ids: tuple[int, ...], payload: memoryview
) -> bytes:
    fixed = _FIXED.pack(
        MAGIC,
        VERSION,
        0,
        len(token_ids),
        namespace,
        block_hash,
        payload.nbytes,
        xxhash.xxh3_64_intdigest(payload),
    )
    head = fixed + array("q", token_ids).tobytes()
    return head + _DIGEST.pack(xxhash.xxh3_64_intdigest(head))


def check_header(
    raw: bytes, namespace: bytes, block_hash: int, token_ids: tuple[int, ...], payload_len: int
) -> int:
    """The payload's expected xxh3 digest; BlockFileError unless the header is intact and
    describes exactly this block of this model."""
    if len(raw) != header_size(len(token_ids)):
        raise BlockFileError(f"header is {len(raw)} bytes, expected {header_size(len(token_ids))}")
    head, (digest,) = raw[: -_DIGEST.size], _DIGEST.unpack(raw[-_DIGEST.size :])
    if xxhash.xxh3_64_intdigest(head) != digest:
        raise BlockFileError("header checksum mismatch")
    magic, version, _, num_tokens, ns, h, length, payload_digest = _FIXED.unpack(
        head[: _FIXED.size]
    )
    if magic != MAGIC or version != VERSION:
        raise BlockFileError(f"not a version-{VERSION} KV block file")
    if ns != namespace:
        raise BlockFileError("written by another model, dtype or block shape")
    if h != block_hash or num_tokens != len(token_ids) or length != payload_len:
        raise BlockFileError("holds another block")
    if tuple(array("q", head[_FIXED.size :])) != token_ids:
        raise BlockFileError("holds other token ids under the same hash")
    return int(payload_digest)


def payload_ok(payload: memoryview, expected_digest: int) -> bool:
    return xxhash.xxh3_64_intdigest(payload) == expected_digest
