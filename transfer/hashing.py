"""Checksums off the I/O thread: one helper thread per engine hashes chunks in the background.

xxh3 (and crc32c, zlib's crc32) release the GIL on large buffers, so hashing on the helper
overlaps the I/O thread's copies and socket writes instead of adding to them. A job keeps
its tensor alive until hashed.
"""

from __future__ import annotations

import concurrent.futures
from concurrent.futures import Future

import torch

from transfer import checksum, layout
from transfer.devices import to_host


class Hasher:
    """Background checksums (one worker thread, started lazily)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def submit(self, algo: str, data: torch.Tensor) -> Future[int]:
        """Checksum of ``data``'s bytes (a contiguous copy is made only if needed)."""
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, f"hash-{self._name}")
        return self._pool.submit(tensor_digest, algo, data)

    def close(self) -> None:
        """Stop the helper (pending jobs still run)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def tensor_digest(algo: str, data: torch.Tensor) -> int:
    """Checksum of a tensor's bytes in memory order (staged to the host if on a device)."""
    return checksum.digest(algo, layout.as_bytes(to_host(data)))
