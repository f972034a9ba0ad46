"""One KV block on the SSD: a header sealed with a keyed MAC, then the block's bytes.

    +-------------------------------------------------------------------+
    | magic "HPDKVBLK" | version u16 | 0 u16 | num_tokens u32            |
    | namespace 16 B (model fingerprint, dtype, block shape)            |
    | block hash u64 | payload length u64                               |
    | tokens MAC 32 B  (the token ids themselves are not stored)        |
    | payload MAC 32 B                                                  |
    | header MAC 32 B  (of everything above)                            |
    +-------------------------------------------------------------------+
    | payload: the block's KV, all layers, [2 * num_layers, *block]     |
    +-------------------------------------------------------------------+

Every MAC is HMAC-SHA256 under the tier's key (a deployment's, from its workers'
credential, else one per process), which is never written beside the files. A file is
served only when every field matches what the reader expects and all three MACs agree:
truncation, bit rot, another model's file, a file edited or planted by anyone without the
key, or one written under another key is a miss, never KV.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from array import array
from typing import NamedTuple

MAGIC = b"HPDKVBLK"
VERSION = 2
_FIXED = struct.Struct("<8sHHI16sQQ32s32s")
MAC_BYTES = 32
HEADER_SIZE = _FIXED.size + MAC_BYTES
KEY_BYTES = 32


class BlockFileError(ValueError):
    """A block file that must not be used, with the reason."""


def _mac(key: bytes, purpose: bytes, data: bytes | memoryview) -> bytes:
    h = hmac.new(key, purpose, hashlib.sha256)
    h.update(data)
    return h.digest()


def tokens_mac(key: bytes, token_ids: tuple[int, ...]) -> bytes:
    return _mac(key, b"tokens\0", array("q", token_ids).tobytes())


def payload_mac(key: bytes, payload: memoryview) -> bytes:
    return _mac(key, b"payload\0", payload)


def encode_header(
    key: bytes, namespace: bytes, block_hash: int, token_ids: tuple[int, ...], payload: memoryview
) -> bytes:
    fixed = _FIXED.pack(
        MAGIC,
        VERSION,
        0,
        len(token_ids),
        namespace,
        block_hash,
        payload.nbytes,
        tokens_mac(key, token_ids),
        payload_mac(key, payload),
    )
    return fixed + _mac(key, b"header\0", fixed)


class Header(NamedTuple):
    """A header's fields after its MAC checked out."""

    num_tokens: int
    block_hash: int
    payload_len: int
    tokens_mac: bytes
    payload_mac: bytes


def read_header(key: bytes, raw: bytes, namespace: bytes) -> Header:
    """The fields of an intact header sealed under `key` for `namespace`; BlockFileError
    otherwise (what a restart checks before it lists a file)."""
    if len(raw) != HEADER_SIZE:
        raise BlockFileError(f"header is {len(raw)} bytes, expected {HEADER_SIZE}")
    fixed, mac = raw[:-MAC_BYTES], raw[-MAC_BYTES:]
    magic, version, _, num_tokens, ns, block_hash, length, tokens, payload = _FIXED.unpack(fixed)
    if magic != MAGIC or version != VERSION:
        raise BlockFileError(f"not a version-{VERSION} KV block file")
    if not hmac.compare_digest(_mac(key, b"header\0", fixed), mac):
        raise BlockFileError("header MAC mismatch: not written under this tier's key")
    if ns != namespace:
        raise BlockFileError("written by another model, dtype or block shape")
    return Header(num_tokens, block_hash, length, tokens, payload)


def check_header(
    key: bytes,
    raw: bytes,
    namespace: bytes,
    block_hash: int,
    token_ids: tuple[int, ...],
    payload_len: int,
) -> bytes:
    """The payload's expected MAC; BlockFileError unless the header is intact, sealed under
    `key` and describes exactly this block of this model."""
    head = read_header(key, raw, namespace)
    if (head.block_hash, head.num_tokens, head.payload_len) != (
        block_hash,
        len(token_ids),
        payload_len,
    ):
        raise BlockFileError("holds another block")
    if not hmac.compare_digest(head.tokens_mac, tokens_mac(key, token_ids)):
        raise BlockFileError("holds other token ids under the same hash")
    return head.payload_mac


def payload_ok(key: bytes, payload: memoryview, expected_mac: bytes) -> bool:
    return hmac.compare_digest(payload_mac(key, payload), expected_mac)
