"""Checksums off the I/O thread: helper threads hash chunks in the background.

xxh3 (and zlib's crc32) release the GIL on large buffers, so hashing here overlaps
the I/O thread's copies, socket writes and reads instead of adding to them. A job keeps its
buffer alive until hashed; :meth:`Hasher.then` delivers the result back on the I/O thread.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

import torch

from transfer import checksum, envs, layout
from transfer.devices import to_host
from transfer.errors import TransferError

#: Helper threads per engine: enough to keep up with one core's copies, no more (one of
#: them also copies half of a direct write's chunks, transports.direct._copy_in_two).
THREADS = 2
#: Buffers up to this size are hashed at once on the calling thread: handing them to a
#: helper and waking the I/O thread with the result costs more than hashing them (xxh3 runs
#: at tens of GB/s on data the caller has just touched, so even a whole chunk takes ~0.1 ms).
INLINE_BYTES = envs.hash_inline_bytes()
Buffer = bytes | bytearray | memoryview
T = TypeVar("T")


class Hasher:
    """Background checksums (threads started lazily)."""

    def __init__(self, name: str, deliver: Callable[[Callable[[], None]], None]) -> None:
        """``deliver(fn)`` runs ``fn`` on the I/O thread (``IOLoop.call``)."""
        self._name, self._deliver = name, deliver
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def _executor(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(THREADS, f"hash-{self._name}")
        return self._pool

    def submit(self, algo: str, data: torch.Tensor) -> Future[int]:
        """Checksum of ``data``'s bytes (a contiguous copy is made only if needed)."""
        if data.numel() * data.element_size() <= INLINE_BYTES:
            return _done(tensor_digest, algo, data)
        return self._executor().submit(tensor_digest, algo, data)

    def submit_bytes(self, algo: str, data: Buffer) -> Future[int]:
        """Checksum of a byte buffer."""
        if len(data) <= INLINE_BYTES:
            return _done(checksum.digest, algo, data)
        return self._executor().submit(checksum.digest, algo, data)

    def run(self, fn: Callable[..., T], *args: object) -> Future[T]:
        """``fn(*args)`` on a helper thread (direct writes copy a second chunk there)."""
        return self._executor().submit(fn, *args)

    def then(self, fut: Future[T], fn: Callable[[T | None], None]) -> None:
        """Run ``fn(result)`` on the I/O thread once ``fut`` is done (None if it failed): at
        once when it already is (callers are on the I/O thread)."""
        if fut.done():
            fn(None if fut.cancelled() or fut.exception() is not None else fut.result())
            return

        def done(f: Future[T]) -> None:
            value = None if f.cancelled() or f.exception() is not None else f.result()
            with contextlib.suppress(TransferError):  # the engine closed meanwhile
                self._deliver(lambda: fn(value))

        fut.add_done_callback(done)

    def close(self) -> None:
        """Stop the helpers (jobs not started are dropped)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def _done(fn: Callable[[str, T], int], algo: str, data: T) -> Future[int]:
    """``fn(algo, data)`` run here, as a finished future (an error is kept in it)."""
    fut: Future[int] = Future()
    try:
        fut.set_result(fn(algo, data))
    except Exception as err:  # delivered as a failed digest, as a helper thread would
        fut.set_exception(err)
    return fut


def tensor_digest(algo: str, data: torch.Tensor) -> int:
    """Checksum of a tensor's bytes in memory order (staged to the host if on a device)."""
    return checksum.digest(algo, layout.as_bytes(to_host(data)))
