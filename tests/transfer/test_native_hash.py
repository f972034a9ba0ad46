"""The C copy loop of direct writes (backends/xxh3_io.py): its digests are the `xxhash`
package's, it covers every byte of a chunk (a flipped byte in the first or the last piece
changes the digest), and the portable path stays when it is switched off."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import pytest
import xxhash

from backends import native, xxh3_io
from transfer import checksum, devices
from transfer.transports import direct

needs_cc = pytest.mark.skipif(native.compiler() is None, reason="no C compiler")


@pytest.fixture(scope="module")
def io(tmp_path_factory: pytest.TempPathFactory) -> xxh3_io.Xxh3Io:
    built = xxh3_io.load(Path(tmp_path_factory.mktemp("kernels")))
    assert built is not None, "the xxh3 kernel did not build"
    return built


def _at(buf: bytearray) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


@needs_cc
@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [0, 1, 17, 240, 241, 16 << 10, (16 << 10) + 5, (1 << 20) + 3])
def test_copy_digests_are_xxhash_and_the_copy_exact(io: xxh3_io.Xxh3Io, n: int) -> None:
    src = bytearray(os.urandom(n))
    dst = bytearray(n + 1)  # a byte more: nothing is written past n
    s, d = io.running(), io.running()
    io.copy(_at(dst) if n else 0, _at(src) if n else 0, n, direct.NATIVE_PIECE_BYTES, s, d)
    assert dst[:n] == src and dst[n] == 0
    assert s.value() == d.value() == xxhash.xxh3_64_intdigest(bytes(src))


@needs_cc
@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["first", "boundary", "last"])
def test_a_flipped_byte_in_any_piece_changes_the_digest(io: xxh3_io.Xxh3Io, where: str) -> None:
    piece = direct.NATIVE_PIECE_BYTES
    n = 3 * piece + 123  # the last piece is a short one
    src = bytearray(os.urandom(n))
    at = {"first": 0, "boundary": piece, "last": n - 1}[where]
    digests, dst = [], bytearray(n)
    for flip in (False, True):
        if flip:
            src[at] ^= 0x01
        s, d = io.running(), io.running()
        io.copy(_at(dst), _at(src), n, piece, s, d)
        assert s.value() == d.value()
        digests.append(s.value())
    assert digests[0] != digests[1]


@needs_cc
@pytest.mark.timeout(120)
def test_running_holds_xxh3_in_c_where_built_and_in_python_when_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    data = os.urandom(100_000)
    monkeypatch.setenv("HETERO_PD_NATIVE_HASH", "1")
    assert devices.hash_io(wait=None) is not None
    native_one = checksum.Running("xxh3", native=True)
    assert native_one.native is not None
    monkeypatch.setenv("HETERO_PD_NATIVE_HASH", "0")
    assert devices.hash_io() is None
    portable = checksum.Running("xxh3", native=True)
    assert portable.native is None
    assert checksum.Running("xxh3").native is None  # the data channel's: Python unless asked
    for r in (native_one, portable):
        r.update(data[:777])
        r.update(memoryview(data)[777:])
    assert native_one.value() == portable.value() == xxhash.xxh3_64_intdigest(data)
