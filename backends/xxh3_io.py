"""xxh3 hashed as the bytes are copied: one C loop copies a piece and hashes that piece of the
source and of the destination at once, then the next (csrc/xxh3_io.c).

The transfer engine's direct writes (`shm`, `local`) copy each KV chunk into the peer's
blocks and hash both sides of it (transfer/transports/direct.py). In Python each 512 KiB
piece cost a `ctypes.memmove` and two calls into the `xxhash` package, and the GIL changed
hands at each; in C a whole chunk is one call (the GIL released throughout, so two threads
copy at once) and its pieces are small enough (16 KiB) to be hashed in the L1 cache the copy
just filled.

The hash itself is the `xxhash` package's: its extension module exports xxHash's C functions
(`XXH3_createState`, `XXH3_64bits_update_dispatch`, ...), which this module binds with ctypes
and hands to the loop; nothing of xxHash is compiled here, and the digests are the package's,
so a peer without the loop verifies them the same way. Built on first use and loaded by
backends/native.py (loaded only from a folder no one else may write). No compiler, a failed
build, or an `xxhash` whose module does not export those functions: `load()` gives None and
the caller hashes in Python.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from pathlib import Path

from backends import native

SOURCE = native.CSRC / "xxh3_io.c"

_ptr, _size = ctypes.c_void_p, ctypes.c_size_t


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))  # a CDLL call releases the GIL while the C code runs
    copy = lib.hpd_copy_hashed
    copy.argtypes, copy.restype = [_ptr, _ptr, _ptr, _size, _size, _ptr, _ptr], None
    return lib


def _xxhash_functions() -> ctypes.CDLL | None:
    """xxHash's C functions as the `xxhash` package's extension module exports them, typed;
    None where that module does not export them all."""
    try:
        import xxhash._xxhash as module

        xx = ctypes.CDLL(str(module.__file__))
        signatures = {
            "XXH3_createState": ([], _ptr),
            "XXH3_freeState": ([_ptr], ctypes.c_int),
            "XXH3_64bits_reset": ([_ptr], ctypes.c_int),
            "XXH3_64bits_update_dispatch": ([_ptr, _ptr, _size], ctypes.c_int),
            "XXH3_64bits_digest": ([_ptr], ctypes.c_uint64),
            "XXH3_64bits_dispatch": ([_ptr, _size], ctypes.c_uint64),
        }
        for name, (args, result) in signatures.items():
            fn = getattr(xx, name)
            fn.argtypes, fn.restype = args, result
    except (ImportError, OSError, AttributeError):
        return None
    return xx


class Xxh3Io:
    """The loaded loop and xxHash's functions: running xxh3 states and the copy that feeds
    them."""

    def __init__(self, lib: ctypes.CDLL, xx: ctypes.CDLL) -> None:
        self.lib = lib
        self.xx = xx
        self._update = ctypes.cast(xx.XXH3_64bits_update_dispatch, _ptr).value

    def running(self) -> Running:
        """A fresh xxh3 state (the digest of nothing so far)."""
        return Running(self)

    def digest(self, address: int, n: int) -> int:
        """xxh3 of ``n`` bytes at ``address``."""
        return int(self.xx.XXH3_64bits_dispatch(address, n))

    def copy(
        self,
        dst: int,
        src: int,
        n: int,
        piece: int,
        src_hash: Running | None,
        dst_hash: Running | None,
    ) -> None:
        """Copy ``n`` bytes from address ``src`` to ``dst`` (not overlapping), ``piece`` at a
        time, feeding each piece of the source to ``src_hash`` and what landed to
        ``dst_hash`` right after its copy (either may be None: not hashed)."""
        self.lib.hpd_copy_hashed(
            self._update,
            dst,
            src,
            n,
            piece,
            None if src_hash is None else src_hash.ptr,
            None if dst_hash is None else dst_hash.ptr,
        )


class Running:
    """One running xxh3 digest, a state xxHash allocated (freed with this object)."""

    __slots__ = ("io", "ptr")

    def __init__(self, io: Xxh3Io) -> None:
        self.io = io
        self.ptr: int | None = io.xx.XXH3_createState()
        if not self.ptr:
            raise MemoryError("XXH3_createState returned NULL")
        io.xx.XXH3_64bits_reset(self.ptr)

    def update(self, address: int, n: int) -> None:
        """Feed ``n`` bytes at ``address`` (the next bytes, in order)."""
        self.io.xx.XXH3_64bits_update_dispatch(self.ptr, address, n)

    def value(self) -> int:
        """xxh3 of everything fed so far."""
        return int(self.io.xx.XXH3_64bits_digest(self.ptr))

    def __del__(self) -> None:
        if self.ptr:
            self.io.xx.XXH3_freeState(self.ptr)
            self.ptr = None


@functools.cache
def load(kernel_dir: Path) -> Xxh3Io | None:
    """The kernel built into (or found in) ``kernel_dir``, loaded; None where it cannot be
    (the caller hashes in Python)."""
    xx = _xxhash_functions()
    if xx is None:
        return None
    lib = native.build(SOURCE, kernel_dir, "xxh3 while copying", _load)
    return None if lib is None else Xxh3Io(lib, xx)


_loading: dict[Path, threading.Thread] = {}
_lock = threading.Lock()


def load_soon(kernel_dir: Path) -> None:
    """Start :func:`load` on a daemon thread once per folder (a first build takes a second
    or more of a compiler's time, which no I/O loop should wait for)."""
    with _lock:
        if kernel_dir in _loading:
            return
        thread = threading.Thread(
            target=load, args=(kernel_dir,), name="xxh3-io-build", daemon=True
        )
        _loading[kernel_dir] = thread
        thread.start()


def loaded(kernel_dir: Path, wait: float | None = 0.0) -> Xxh3Io | None:
    """The kernel once built (see :func:`load_soon`, which this starts if nothing did);
    None while the build runs, or where it cannot be built. ``wait``: seconds to wait for
    a build under way (None: until it ends)."""
    load_soon(kernel_dir)
    thread = _loading[kernel_dir]
    if thread.is_alive() and wait != 0.0:
        thread.join(wait)
    return None if thread.is_alive() else load(kernel_dir)
