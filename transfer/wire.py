"""The transfer wire's codec: typed headers (+ CRC32), optionally followed by raw bytes.

A frame is a ZMQ multipart message ``[header]`` or ``[header, payload]``. The header is a
msgpack :class:`~transfer.messages.Header` ``{"v": VERSION, "sid": token, "m": {"t": tag,
...}}``, then its MAC, then the CRC32 of both (4 bytes, little-endian)::

    msgpack header | MAC 16 B: HMAC-SHA256(session key of this direction, header)[:16] | CRC32

A header damaged on the way is rejected as ``corrupt`` and its transfer retried, never
believed. The CRC is no secret, so whoever is on the path can alter a field and recompute
it: frames of a session also carry the MAC under the session's control key of their
direction (:func:`transfer.auth.control_keys`), checked once the session is known
(:func:`authentic`); handshake frames, which have no session yet, carry zeros there (their
proofs authenticate them). Payloads are raw tensor bytes (only DATA has one), never pickled
objects.

:func:`decode` hands out a message only after one typed decoder checked every field's
type and bounds (:mod:`transfer.messages`); whatever does not validate raises
:class:`FrameError` with a short reason that the engine counts in its metrics
(``frames_rejected``): ``oversized_header``, ``malformed``, ``corrupt``, ``bad_version``,
``unknown_type``, ``bad_field``, ``bad_parts`` here; the handlers add their own.
"""

from __future__ import annotations

import hmac
import zlib

import msgspec

from transfer.addresses import split_host_port
from transfer.errors import TransferError
from transfer.messages import VERSION, AnyMessage, Data, Header, RegionInfo

__all__ = [
    "CRC_BYTES",
    "MAC_BYTES",
    "MAX_HEADER_BYTES",
    "VERSION",
    "FrameError",
    "authentic",
    "decode",
    "encode",
    "seal",
]

MAX_HEADER_BYTES = 1 << 20
CRC_BYTES = 4
MAC_BYTES = 16
_NO_MAC = bytes(MAC_BYTES)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Header)


class FrameError(Exception):
    """A frame that must be rejected; ``reason`` is a short metric label."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def encode(msg: AnyMessage, sid: bytes = b"", key: bytes = b"", n: int = 0) -> bytes:
    """One sealed header carrying ``msg`` on session ``sid`` (empty while linking), its MAC
    under ``key`` (the session's control key for this direction; none while linking) and its
    number ``n`` in the session (:mod:`transfer.replay`; 0 while linking)."""
    packed = _encoder.encode(Header(v=VERSION, sid=sid, msg=msg, n=n))
    return seal(packed, _mac(key, packed) if key else _NO_MAC)


def seal(packed: bytes, mac: bytes = _NO_MAC) -> bytes:
    """``packed``, its ``mac`` and their CRC32 (what :func:`decode` expects)."""
    body = packed + mac
    return body + zlib.crc32(body).to_bytes(CRC_BYTES, "little")


def tag_of(raw: bytes | memoryview) -> bytes:
    """The MAC a sealed header carries."""
    return bytes(memoryview(raw)[-CRC_BYTES - MAC_BYTES : -CRC_BYTES])


def authentic(raw: bytes | memoryview, key: bytes) -> bool:
    """Whether a header that :func:`decode` accepted carries the MAC of its bytes under
    ``key`` (the peer's control key): made by a holder of the session's keys, unaltered."""
    packed = memoryview(raw)[: -CRC_BYTES - MAC_BYTES]
    return hmac.compare_digest(_mac(key, packed), tag_of(raw))


def _mac(key: bytes, packed: bytes | memoryview) -> bytes:
    return hmac.digest(key, packed, "sha256")[:MAC_BYTES]


def decode(raw: bytes | memoryview, nparts: int) -> Header:
    """Check, parse and validate a header; ``nparts`` is the number of parts in the message."""
    if len(raw) > MAX_HEADER_BYTES:
        raise FrameError("oversized_header", f"{len(raw)} bytes")
    view = memoryview(raw)
    if len(view) <= CRC_BYTES + MAC_BYTES:
        raise FrameError("malformed", "header too short")
    if zlib.crc32(view[:-CRC_BYTES]) != int.from_bytes(view[-CRC_BYTES:], "little"):
        raise FrameError("corrupt", "header checksum")
    try:
        header = _decoder.decode(view[: -CRC_BYTES - MAC_BYTES])
    except msgspec.ValidationError as exc:
        raise FrameError(_reason(str(exc)), str(exc)[:200]) from None
    except msgspec.DecodeError as exc:
        raise FrameError("malformed", str(exc)[:200]) from None
    expected_parts = 2 if isinstance(header.msg, Data) else 1
    if nparts != expected_parts:
        raise FrameError("bad_parts", f"{type(header.msg).__name__} with {nparts} parts")
    return header


def _reason(error: str) -> str:
    """The metric label for a validation error (msgspec names the path: ``- at `$.m.x```)."""
    if error.endswith(("`$.v`", "field `v`")):
        return "bad_version"
    if error.endswith(("`$.m.t`", "field `t` - at `$.m`")):
        return "unknown_type"
    if " - at " not in error or error.endswith("`$.sid`"):
        return "malformed"  # not a map, or not our envelope
    return "bad_field"


def regions_by_name(regions: list[RegionInfo]) -> dict[str, RegionInfo]:
    """A peer's region descriptions by name (each already validated by the decoder)."""
    return {region.name: region for region in regions}


#: Longest fingerprint a peer may send, and the characters it may hold.
MAX_FINGERPRINT = 128
_FINGERPRINT_CHARS = frozenset("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ-_.:")


def fingerprint(value: str) -> str:
    """A peer's KV fingerprint (AUTH / WELCOME ``fp``): empty, or a short printable token.
    Checked after decoding so that the peer is told why its link was refused."""
    if len(value) > MAX_FINGERPRINT or not set(value) <= _FINGERPRINT_CHARS:
        raise FrameError("bad_field", "fp")
    return value


def data_address(address: str) -> str:
    """A peer's advertised data address: empty (it has none) or ``host:port``."""
    if address:
        try:
            split_host_port(address, "data address")
        except TransferError as exc:
            raise FrameError("bad_field", exc.message) from None
    return address
