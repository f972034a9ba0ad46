"""Fast non-cryptographic checksums of KV chunks.

``xxh3`` (64-bit, ~50 GB/s on one quiet AVX2 core on cached data, ~30 in a push; xxhash is a
dependency) by default; zlib's ``crc32`` (~4 GB/s) where a peer asks for it. Both ends name
the algorithm in the transfer's header, so a receiver verifies with exactly what the sender
used.

A :class:`Running` xxh3 is held in C where the kernel of ``backends.xxh3_io`` is built
(:func:`transfer.devices.hash_io`): then direct writes feed it from the C loop that copies
and hashes each piece at once (``Running.native``); the digests are the same either way.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable

import xxhash

from transfer import devices

Buffer = bytes | bytearray | memoryview
Digest = Callable[[Buffer], int]
StreamDigest = Callable[[Iterable[Buffer]], int]

_ALGOS: dict[str, Digest] = {"crc32": zlib.crc32}
_STREAMS: dict[str, StreamDigest] = {}


def _crc32_stream(parts: Iterable[Buffer]) -> int:
    value = 0
    for part in parts:
        value = zlib.crc32(part, value)
    return value


_STREAMS["crc32"] = _crc32_stream
#: crc-style checksums continue from a previous value: ``f(data, value)``.
_CHAINED: dict[str, Callable[[Buffer, int], int]] = {"crc32": zlib.crc32}


def _xxh3_stream(parts: Iterable[Buffer]) -> int:
    h = xxhash.xxh3_64()
    for part in parts:
        h.update(part)
    return int(h.intdigest())


_ALGOS["xxh3"] = xxhash.xxh3_64_intdigest
_STREAMS["xxh3"] = _xxh3_stream

PREFERENCE = ("xxh3", "crc32")


def available() -> list[str]:
    """Installed algorithms, fastest first."""
    return [name for name in PREFERENCE if name in _ALGOS]


def resolve(name: str) -> str:
    """Turn ``"auto"`` into the fastest installed algorithm; reject unknown names."""
    if name == "auto":
        return available()[0]
    if name not in _ALGOS:
        raise ValueError(f"checksum algorithm {name!r} is not installed; have {available()}")
    return name


def digest(algo: str, data: Buffer) -> int:
    """Checksum of one contiguous buffer."""
    return _ALGOS[algo](data)


def digest_parts(algo: str, parts: Iterable[Buffer]) -> int:
    """Checksum of the concatenation of ``parts`` (without concatenating them)."""
    return _STREAMS[algo](parts)


class Running:
    """A checksum fed piece by piece: ``digest_parts`` of everything ``update``d so far.

    Used to hash bytes right after they were copied or received, while they are still in
    the cache, instead of reading them again from memory later. An xxh3 one is held in C
    where the kernel is built and ``native`` is asked for (the state the C copy loop of
    ``backends.xxh3_io`` feeds: direct writes); else in Python (the data channel, whose
    pieces the `xxhash` package hashes faster than a ctypes call: measured).
    """

    __slots__ = ("_crc", "_state", "_xxh", "native")

    def __init__(self, algo: str, native: bool = False) -> None:
        if algo not in _ALGOS:
            raise ValueError(f"checksum algorithm {algo!r} is not installed; have {available()}")
        io = devices.hash_io() if native and algo == "xxh3" else None
        #: The C state, which the C copy loop feeds (None: the state is Python's).
        self.native = io.running() if io is not None else None
        self._xxh = xxhash.xxh3_64() if algo == "xxh3" and io is None else None
        self._crc = _CHAINED.get(algo)
        self._state = 0

    def update(self, data: Buffer) -> None:
        """Add ``data`` (the next bytes, in order)."""
        if self.native is not None:
            view = memoryview(data).cast("B")
            self.native.update(devices.address(view), view.nbytes)
        elif self._xxh is not None:
            self._xxh.update(data)
        else:
            assert self._crc is not None
            self._state = self._crc(data, self._state)

    def value(self) -> int:
        """The checksum of all bytes added so far."""
        if self.native is not None:
            return self.native.value()
        return int(self._xxh.intdigest()) if self._xxh is not None else self._state


def requested(choice: bool | str | None, configured: str) -> str | None:
    """A push's ``checksum=`` argument as an algorithm name ("off"; None: the default)."""
    if choice is None:
        return None
    if choice is False:
        return "off"
    if choice is True:
        return configured
    return choice
