"""The SSD tier: one MAC-sealed file per KV block in a folder per model namespace, LRU.

    <disk_path>/<namespace hex>/<block hash hex>.kv     (format: blockfile.py), 0600
    <disk_path>/<namespace hex>/.lock                   (held by the one engine using it)

The namespace folder is 0700 and ours: one owned by another user is refused, one of ours
that others could read is made private (what it held is checked by MAC like the rest), and
a `disk_path` others may write without the sticky bit is refused (they could swap the
folder). The index is rebuilt from the folder on start (warm restart), in modification-time
order; files whose header is not sealed under this tier's key are dropped then, and every
file is checked again, payload included, when it is read. Writes go to a temporary name
and are renamed into place, so a crash leaves either the whole file or none. File I/O
runs on the tiers' disk thread, never the engine's.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
import stat
import threading
from collections import OrderedDict
from enum import Enum
from pathlib import Path
from typing import IO

import torch

from hetero_pd.engine.kv_tiers import blockfile

log = logging.getLogger(__name__)
SUFFIX = ".kv"
_PROCESS_KEY: list[bytes] = []


def process_key() -> bytes:
    """The MAC key of an engine outside a deployment: random, one per process, never
    written anywhere (its SSD files are reused within this process only)."""
    if not _PROCESS_KEY:
        _PROCESS_KEY.append(secrets.token_bytes(blockfile.KEY_BYTES))
    return _PROCESS_KEY[0]


class ReadResult(Enum):
    OK = "ok"
    MISSING = "missing"  # evicted or deleted meanwhile
    CORRUPT = "corrupt"  # failed validation: deleted, served as a miss


def _bytes(block: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous host tensor, writable in place."""
    if block.device.type != "cpu" or not block.is_contiguous():
        raise ValueError("SSD block I/O needs a contiguous host tensor")
    return block.reshape(-1).view(torch.uint8).numpy().data


class DiskTier:
    def __init__(
        self,
        root: Path,
        namespace: bytes,
        capacity_bytes: int,
        block_bytes: int,
        key: bytes,
    ) -> None:
        if len(key) < blockfile.KEY_BYTES:
            raise ValueError(f"the SSD tier's MAC key must be {blockfile.KEY_BYTES} bytes")
        self.dir = root / namespace.hex()
        self.namespace = namespace
        self._key = key
        self.block_bytes = block_bytes
        self.file_bytes = blockfile.HEADER_SIZE + block_bytes
        self.capacity_files = capacity_bytes // self.file_bytes
        if self.capacity_files < 1:
            raise ValueError(
                f"kv_cache_disk_gb={capacity_bytes / 2**30:g} holds no KV block "
                f"(one block file is {self.file_bytes} bytes)"
            )
        _private_folder(root, self.dir)
        self._lock_file: IO[str] | None = self._claim()
        self._index: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()
        self.writes = self.evictions = self.write_errors = 0
        self._rebuild()

    def _claim(self) -> IO[str]:
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW
        lock = os.fdopen(os.open(self.dir / ".lock", flags, 0o600), "a+")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            raise RuntimeError(
                f"the SSD KV folder {self.dir} is in use by another engine; give each worker "
                "its own kv_cache_disk_path"
            ) from None
        return lock

    def _path(self, block_hash: int) -> Path:
        return self.dir / f"{block_hash:016x}{SUFFIX}"

    def _rebuild(self) -> None:
        found: list[tuple[float, int]] = []
        for path in self.dir.iterdir():
            if path.name.endswith(".tmp"):
                path.unlink(missing_ok=True)  # a write cut short by a crash
                continue
            if path.suffix != SUFFIX:
                continue
            try:
                block_hash = int(path.stem, 16)
                info = path.stat()
            except (ValueError, OSError):
                continue
            if info.st_size != self.file_bytes or not self._sealed(path, block_hash):
                path.unlink(missing_ok=True)
                continue
            found.append((info.st_mtime, block_hash))
        for _, block_hash in sorted(found):
            self._index[block_hash] = None
        self._evict(len(self._index) - self.capacity_files)

    def _sealed(self, path: Path, block_hash: int) -> bool:
        """Whether `path`'s header is sealed under our key and names `block_hash`."""
        try:
            with path.open("rb") as f:
                head = blockfile.read_header(
                    self._key, f.read(blockfile.HEADER_SIZE), self.namespace
                )
        except (OSError, blockfile.BlockFileError) as e:
            log.warning("SSD KV tier: dropping %s (%s)", path, e)
            return False
        return head.block_hash == block_hash

    @property
    def num_stored(self) -> int:
        with self._lock:
            return len(self._index)

    def contains(self, block_hash: int) -> bool:
        with self._lock:
            return block_hash in self._index

    def write(self, block_hash: int, token_ids: tuple[int, ...], block: torch.Tensor) -> bool:
        """Stores a block (the disk thread); False if it is there already or the write
        failed (the tier is a cache: a failed write is logged and skipped)."""
        if self.contains(block_hash):
            return False
        payload = _bytes(block)
        header = blockfile.encode_header(self._key, self.namespace, block_hash, token_ids, payload)
        path = self._path(block_hash)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
        try:
            with os.fdopen(os.open(tmp, flags, 0o600), "wb") as f:
                f.write(header)
                f.write(payload)
            with self._lock:
                excess = len(self._index) + 1 - self.capacity_files
            self._evict(excess)
            os.replace(tmp, path)
            with self._lock:
                self._index[block_hash] = None
                self.writes += 1
        except OSError as e:
            tmp.unlink(missing_ok=True)
            self.write_errors += 1
            log.warning("SSD KV tier: could not write %s: %s", path, e)
            return False
        return True

    def read_into(
        self, block_hash: int, token_ids: tuple[int, ...], out: torch.Tensor
    ) -> ReadResult:
        """Reads a block into `out` (a host slot) after checking it whole; a file that fails
        a check is deleted and reported CORRUPT, and `out` must then be ignored."""
        path = self._path(block_hash)
        payload = _bytes(out)
        try:
            with path.open("rb") as f:
                raw = f.read(blockfile.HEADER_SIZE)
                expected = blockfile.check_header(
                    self._key, raw, self.namespace, block_hash, token_ids, payload.nbytes
                )
                n = f.readinto(payload)
                extra = f.read(1)
        except FileNotFoundError:
            self._forget(block_hash)
            return ReadResult.MISSING
        except (OSError, blockfile.BlockFileError) as e:
            log.warning("SSD KV tier: %s is unusable (%s); treating it as a miss", path, e)
            self._drop(block_hash)
            return ReadResult.CORRUPT
        if n != payload.nbytes or extra or not blockfile.payload_ok(self._key, payload, expected):
            log.warning(
                "SSD KV tier: %s is truncated, corrupted or not written under this tier's key "
                "(payload MAC mismatch); treating it as a miss",
                path,
            )
            self._drop(block_hash)
            return ReadResult.CORRUPT
        with self._lock:
            if block_hash in self._index:
                self._index.move_to_end(block_hash)
        with contextlib.suppress(OSError):
            os.utime(path)  # keeps the LRU order across restarts
        return ReadResult.OK

    def _forget(self, block_hash: int) -> None:
        with self._lock:
            self._index.pop(block_hash, None)

    def _drop(self, block_hash: int) -> None:
        self._forget(block_hash)
        self._path(block_hash).unlink(missing_ok=True)

    def _evict(self, n: int) -> None:
        """Deletes the `n` least recently used files (the lock is not held while deleting:
        the engine thread's lookups never wait for the disk)."""
        with self._lock:
            victims = [self._index.popitem(last=False)[0] for _ in range(min(n, len(self._index)))]
            self.evictions += len(victims)
        for block_hash in victims:
            self._path(block_hash).unlink(missing_ok=True)

    def close(self) -> None:
        """Releases the folder for the next engine (a restarted worker)."""
        if self._lock_file is not None:
            fcntl.flock(self._lock_file, fcntl.LOCK_UN)
            self._lock_file.close()
            self._lock_file = None


def _private_folder(root: Path, folder: Path) -> None:
    """Makes `folder` (under `root`) ours and 0700, or raises PermissionError saying why not."""
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = root.stat()
    if info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
        raise PermissionError(
            f"kv_cache_disk_path {root} may be written by other users (mode "
            f"{stat.S_IMODE(info.st_mode):o}, no sticky bit): they could swap the SSD tier's "
            "folder; use a folder only this user can write (chmod go-w) or one with the "
            "sticky bit"
        )
    with contextlib.suppress(FileExistsError):
        folder.mkdir(mode=0o700)
    info = folder.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
        raise PermissionError(
            f"the SSD KV folder {folder} is not a folder of this user (uid {os.geteuid()}; it "
            f"is owned by uid {info.st_uid}): its files are not used; remove it or give this "
            "worker another kv_cache_disk_path"
        )
    if stat.S_IMODE(info.st_mode) != 0o700:
        log.warning("SSD KV tier: %s was mode %o; now 0700", folder, stat.S_IMODE(info.st_mode))
        folder.chmod(0o700)
