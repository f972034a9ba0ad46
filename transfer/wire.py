"""Wire format: one versioned msgpack header per frame, optionally followed by raw bytes.

A frame is a ZMQ multipart message ``[header]`` or ``[header, payload]``. The header is a
msgpack map with ``v`` (protocol version), ``t`` (message type), ``sid`` (session token,
empty during the handshake) and the fields listed in :data:`SCHEMAS`, followed by the CRC32
of its bytes (4 bytes, little-endian): a header damaged on the way is rejected as
``corrupt`` and its transfer retried, never believed. Payloads are raw tensor
bytes, never pickled objects. :func:`decode` validates every field's type before anything
else looks at it; whatever does not validate raises :class:`FrameError` with a short reason
that the engine counts in its metrics.
"""

from __future__ import annotations

import zlib
from typing import Any

import msgpack

from transfer import kv_layouts
from transfer.addresses import split_host_port
from transfer.errors import TransferError

VERSION = 3
MAX_HEADER_BYTES = 1 << 20
CRC_BYTES = 4

_INT = (int,)
_STR = (str,)
_BIN = (bytes,)
_FLOAT = (float, int)
_LIST = (list,)
_OPT_INT = (int, type(None))
_OPT_STR = (str, type(None))
_OPT_LIST = (list, type(None))

#: Required fields (and their types) per message type, beyond ``v``, ``t`` and ``sid``.
SCHEMAS: dict[str, dict[str, tuple[type, ...]]] = {
    # handshake
    # before authentication nothing but ids and nonces; who we are and what we hold after
    "hello": {"eid": _STR, "role": _STR, "nonce": _BIN},
    "challenge": {"eid": _STR, "role": _STR, "nonce": _BIN, "proof": _BIN},
    "auth": {"proof": _BIN, "host": _STR, "pid": _INT, "da": _STR, "regions": _LIST, "fp": _STR},
    "welcome": {
        "token": _BIN,
        "host": _STR,
        "pid": _INT,
        "da": _STR,
        "regions": _LIST,
        "fp": _STR,
    },
    "regions": {"regions": _LIST},
    "bye": {},
    "ping": {},
    # transfers
    "begin": {
        "x": _STR,
        "rid": _STR,
        "ep": _INT,
        "reg": _STR,
        "dst": _LIST,
        "nsrc": _INT,
        "dt": _STR,
        "bs": _INT,
        "tpl": _INT,
        "shape": _LIST,
        "lay": _LIST,
        "ntok": _INT,
        "nf": _INT,
        "bpc": _INT,
        "ck": _OPT_STR,
        "mode": _STR,
        "kc": _STR,
        "fmt": _STR,
    },
    "grant": {"x": _STR, "ttl": _FLOAT, "until": _FLOAT, "g": _INT},
    "renew": {"rid": _STR, "ep": _INT},
    "data": {"x": _STR, "s": _INT, "ti": _INT, "lo": _INT, "hi": _INT, "d": _OPT_INT},
    "landed": {"x": _STR, "s": _LIST, "ds": _LIST, "wv": (bool,), "g": _INT},
    "end": {"x": _STR, "nf": _INT, "ds": _OPT_LIST},
    "ack": {"x": _STR, "code": _INT, "msg": _STR, "bad": _LIST, "dup": (bool,)},
    "error": {"x": _STR, "code": _INT, "msg": _STR},
    "pull": {
        "x": _STR,
        "rid": _STR,
        "ep": _INT,
        "reg": _STR,
        "dst": _LIST,
        "sreg": _STR,
        "src": _LIST,
        "oreq": _STR,
        "oep": _INT,
        "lay": _OPT_LIST,
        "ntok": _OPT_INT,
        "ttl": _FLOAT,
    },
}

#: Message types that carry a payload part.
WITH_PAYLOAD = frozenset({"data"})
#: Message types accepted from a peer that has not authenticated yet.
HANDSHAKE = frozenset({"hello", "challenge", "auth", "welcome"})


class FrameError(Exception):
    """A frame that must be rejected; ``reason`` is a short metric label."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def encode(msg_type: str, sid: bytes = b"", **fields: Any) -> bytes:
    """Serialize one header. Field names must match :data:`SCHEMAS` (checked in tests)."""
    packed = msgpack.packb({"v": VERSION, "t": msg_type, "sid": sid, **fields}, use_bin_type=True)
    return seal(packed)


def seal(packed: bytes) -> bytes:
    """``packed`` followed by its CRC32 (what :func:`decode` expects)."""
    return packed + zlib.crc32(packed).to_bytes(CRC_BYTES, "little")


def decode(raw: bytes | memoryview, nparts: int) -> tuple[str, dict[str, Any]]:
    """Parse and validate a header; ``nparts`` is the number of parts in the message."""
    if len(raw) > MAX_HEADER_BYTES:
        raise FrameError("oversized_header", f"{len(raw)} bytes")
    view = memoryview(raw)
    if len(view) <= CRC_BYTES:
        raise FrameError("malformed", "header too short")
    body = view[:-CRC_BYTES]
    if zlib.crc32(body) != int.from_bytes(view[-CRC_BYTES:], "little"):
        raise FrameError("corrupt", "header checksum")
    try:
        obj = msgpack.unpackb(
            body,
            raw=False,
            strict_map_key=True,
            max_bin_len=1 << 16,
            max_str_len=1 << 12,
            max_array_len=1 << 20,
            max_map_len=64,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises many types on garbage; all mean "malformed"
        raise FrameError("malformed", type(exc).__name__) from None
    if not isinstance(obj, dict):
        raise FrameError("malformed", "header is not a map")
    if obj.get("v") != VERSION:
        raise FrameError("bad_version", repr(obj.get("v"))[:40])
    msg_type = obj.get("t")
    if not isinstance(msg_type, str) or msg_type not in SCHEMAS:
        raise FrameError("unknown_type", repr(msg_type)[:40])
    if not isinstance(obj.get("sid"), bytes):
        raise FrameError("malformed", "sid")
    expected_parts = 2 if msg_type in WITH_PAYLOAD else 1
    if nparts != expected_parts:
        raise FrameError("bad_parts", f"{msg_type} with {nparts} parts")
    for name, types in SCHEMAS[msg_type].items():
        value = obj.get(name, _MISSING)
        # bool is an int subclass: never accept it where an int is required
        if (
            value is _MISSING
            or not isinstance(value, types)
            or (isinstance(value, bool) and bool not in types)
        ):
            raise FrameError("bad_field", f"{msg_type}.{name}")
    return msg_type, obj


def int_list(value: list[Any], name: str, limit: int | None = None) -> list[int]:
    """Validate a list of non-negative ints (optionally ``< limit``)."""
    for item in value:
        if type(item) is not int or item < 0 or (limit is not None and item >= limit):
            raise FrameError("bad_field", f"{name} holds {item!r}")
    return value


_MISSING = object()


def region_descriptions(raw: list[Any]) -> dict[str, dict[str, Any]]:
    """Validate a peer's region descriptions (``KVRegion.describe()``), by name."""
    out: dict[str, dict[str, Any]] = {}
    for desc in raw[:64]:
        if not isinstance(desc, dict) or not isinstance(desc.get("name"), str):
            raise FrameError("bad_field", "regions")
        if not isinstance(desc.get("shm"), (str, type(None))):
            raise FrameError("bad_field", "regions.shm")
        for key in ("dt", "dev", "fmt"):
            if not isinstance(desc.get(key), str):
                raise FrameError("bad_field", f"regions.{key}")
        if desc["fmt"] not in kv_layouts.LAYOUTS:
            raise FrameError("bad_field", "regions.fmt")
        for key in ("nl", "tpl", "nb"):
            value = desc.get(key)
            if type(value) is not int or value < 1:
                raise FrameError("bad_field", f"regions.{key}")
        shape = desc.get("shape")
        if not isinstance(shape, list) or not shape:
            raise FrameError("bad_field", "regions.shape")
        int_list(shape, "regions.shape")
        out[desc["name"]] = desc
    return out


#: Longest fingerprint a peer may send, and the characters it may hold.
MAX_FINGERPRINT = 128
_FINGERPRINT_CHARS = frozenset("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ-_.:")


def fingerprint(value: str) -> str:
    """A peer's KV fingerprint (AUTH / WELCOME ``fp``): empty, or a short printable token."""
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
