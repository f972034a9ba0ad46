"""Two background threads move KV blocks between the tiers while the engine computes.

    engine thread                copy thread (device <-> host)     disk thread (host <-> SSD)
    a request's cached blocks
    freed ───────────────────>  device blocks -> host slots ────> host slots -> files
    prefix found below device:
      all in host DRAM ───────>  host slots -> device blocks
      some on the SSD ──────────────────────────────────────────>  files -> host slots, checked
                                 host slots -> device blocks <───┘
    completed() <── every job, once its copies are done ──┘

Onloads go before offloads on the copy thread and SSD reads before writes on the disk
thread: a request waits for an onload, nobody waits for an offload. The engine waits for
the copy thread only when it is out of device blocks that offloads still hold; it never
waits for the disk thread while it has work to run. A job's device blocks are held by the
engine until the job comes back, so no copy reads or writes a block a request may reuse.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, NamedTuple, TypeVar

import torch

from backends import Backend
from hetero_pd.engine.kv_tiers.disk import DiskTier, ReadResult
from hetero_pd.engine.kv_tiers.host import HostTier

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(slots=True)
class Offload:
    """Cached device blocks (one request's) copied down into reserved host slots."""

    block_ids: list[int]
    hashes: list[int]
    token_ids: list[tuple[int, ...]]
    slots: list[int]
    ready: torch.Event | None = None  # recorded after the blocks' KV was computed
    ok: bool = False


@dataclass(slots=True)
class Onload:
    """A request's prefix brought up from the tiers into device blocks the engine holds.

    Block i comes from host slot `slots[i]` (pinned there, or reserved for an SSD read when
    `on_disk[i]`). Once done, blocks [0, num_valid) hold their KV; a block that failed its
    checks ends the valid run, since every later block depends on it."""

    request_id: str
    block_ids: list[int]
    hashes: list[int]
    token_ids: list[tuple[int, ...]]
    slots: list[int | None]
    on_disk: list[bool]
    num_valid: int
    started: float = field(default_factory=time.perf_counter)
    disk_hits: int = 0
    corrupt: int = 0
    seconds: float = 0.0


class _DiskWrite(NamedTuple):
    slot: int  # pinned in the host tier until written
    block_hash: int
    token_ids: tuple[int, ...]


Job = Offload | Onload


class _Lanes(Generic[T]):
    """A work queue whose urgent lane always goes first; `get` returns None once closed
    and empty."""

    def __init__(self) -> None:
        self._urgent: deque[T] = deque()
        self._rest: deque[T] = deque()
        self._cond = threading.Condition()
        self._closed = False

    def put(self, item: T, urgent: bool) -> None:
        with self._cond:
            (self._urgent if urgent else self._rest).append(item)
            self._cond.notify()

    def get(self) -> T | None:
        with self._cond:
            self._cond.wait_for(lambda: self._urgent or self._rest or self._closed)
            if self._urgent:
                return self._urgent.popleft()
            return self._rest.popleft() if self._rest else None

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


class TierMover:
    def __init__(
        self,
        host: HostTier,
        disk: DiskTier | None,
        device_layers: Sequence[torch.Tensor],
        backend: Backend,
    ) -> None:
        self.host, self.disk, self.backend = host, disk, backend
        self.device_layers = list(device_layers)
        self.host_layers = host.layer_views()
        self._stream = backend.new_stream(self.device_layers[0].device)
        self._copy_q: _Lanes[Job] = _Lanes()
        self._disk_q: _Lanes[Onload | _DiskWrite] = _Lanes()
        self._done: deque[Job] = deque()
        self._cond = threading.Condition()
        self._in_copy = 0  # jobs queued for or running on the copy thread
        self._in_flight = 0  # jobs not yet taken by `completed()`
        self._writes = 0  # SSD writes queued or running
        self._threads = [threading.Thread(target=self._copy_loop, name="kv-tier-copy", daemon=True)]
        if disk is not None:
            self._threads.append(
                threading.Thread(target=self._disk_loop, name="kv-tier-disk", daemon=True)
            )
        for thread in self._threads:
            thread.start()

    # -- engine thread ---------------------------------------------------------------
    def submit(self, job: Job) -> None:
        with self._cond:
            self._in_flight += 1
            if isinstance(job, Onload) and any(job.on_disk):
                self._disk_q.put(job, urgent=True)
                return
            self._in_copy += 1
        self._copy_q.put(job, urgent=isinstance(job, Onload))

    def completed(self) -> list[Job]:
        """Jobs whose copies are done, in completion order (each returned once)."""
        with self._cond:
            jobs = list(self._done)
            self._done.clear()
            self._in_flight -= len(jobs)
            return jobs

    @property
    def in_flight(self) -> int:
        with self._cond:
            return self._in_flight

    def wait_copies(self, timeout: float) -> None:
        """Until the copy thread has nothing queued (host-memory copies only)."""
        with self._cond:
            self._cond.wait_for(lambda: self._in_copy == 0, timeout)

    def wait_done(self, timeout: float, all_jobs: bool = False) -> None:
        """Until some job waits in `completed()`; with `all_jobs`, until every job is done
        (SSD writes included)."""
        with self._cond:
            if all_jobs:
                self._cond.wait_for(
                    lambda: self._in_flight == len(self._done) and self._writes == 0, timeout
                )
            else:
                self._cond.wait_for(lambda: len(self._done) > 0, timeout)

    def close(self) -> None:
        """Stops the threads once the work queued before is done."""
        self._copy_q.close()
        self._disk_q.close()
        for thread in self._threads:
            thread.join(timeout=60)

    def _finish(self, job: Job) -> None:
        with self._cond:
            self._done.append(job)
            self._in_copy -= 1
            self._cond.notify_all()

    # -- copy thread -----------------------------------------------------------------
    def _copy_loop(self) -> None:
        while (job := self._copy_q.get()) is not None:
            try:
                if isinstance(job, Offload):
                    self._offload(job)
                else:
                    self._onload(job)
            except Exception:  # a failed copy is a miss; the thread and the engine go on
                log.exception("KV tier copy failed")
            finally:
                self._finish(job)

    def _offload(self, job: Offload) -> None:
        try:
            if job.ready is not None and self._stream is not None:
                self._stream.wait_event(job.ready)
            self.backend.copy_blocks(
                self.host_layers, job.slots, self.device_layers, job.block_ids, self._stream
            )
            job.ok = True
        finally:
            if not job.ok:
                for slot in job.slots:
                    self.host.release(slot)
        for slot, block_hash, tokens in zip(job.slots, job.hashes, job.token_ids, strict=True):
            to_disk = self.disk is not None and not self.disk.contains(block_hash)
            if self.host.store(slot, block_hash, tokens, pin=to_disk) and to_disk:
                # write-through: the host copy stays pinned until it is on the SSD
                with self._cond:
                    self._writes += 1
                self._disk_q.put(_DiskWrite(slot, block_hash, tokens), urgent=False)

    def _onload(self, job: Onload) -> None:
        try:
            n = job.num_valid
            slots = [s for s in job.slots[:n] if s is not None]
            if len(slots) != n:
                raise RuntimeError(f"onload of {job.request_id}: a valid block has no host slot")
            self.backend.copy_blocks(
                self.device_layers, job.block_ids[:n], self.host_layers, slots, self._stream
            )
        except Exception:
            job.num_valid = 0
            raise
        finally:
            for block_hash, slot in zip(job.hashes, job.slots, strict=True):
                if slot is not None:
                    self.host.unpin(block_hash)
            job.seconds = time.perf_counter() - job.started

    # -- disk thread -----------------------------------------------------------------
    def _disk_loop(self) -> None:
        assert self.disk is not None
        while (item := self._disk_q.get()) is not None:
            if isinstance(item, Onload):
                try:
                    self._read(item, self.disk)
                except Exception:  # the job still goes on, so its blocks come back
                    log.exception("KV tier SSD read failed")
                    item.num_valid = 0
                with self._cond:
                    self._in_copy += 1
                self._copy_q.put(item, urgent=True)
                continue
            try:
                self.disk.write(item.block_hash, item.token_ids, self.host.buffer[item.slot])
            except Exception:
                log.exception("KV tier SSD write failed")
            finally:
                self.host.unpin(item.block_hash)
                with self._cond:
                    self._writes -= 1
                    self._cond.notify_all()

    def _read(self, job: Onload, disk: DiskTier) -> None:
        """Reads the job's SSD blocks into their reserved host slots, in order, up to the
        first block that is missing or fails its checks (the rest are released)."""
        valid = job.num_valid
        for i, (block_hash, tokens) in enumerate(zip(job.hashes, job.token_ids, strict=True)):
            slot = job.slots[i]
            if not job.on_disk[i] or slot is None:
                continue
            result = ReadResult.MISSING
            if i < valid:
                result = disk.read_into(block_hash, tokens, self.host.buffer[slot])
            if result is ReadResult.OK:
                job.disk_hits += 1
                if self.host.store(slot, block_hash, tokens, pin=True):
                    continue
                slot = self.host.pin(block_hash, tokens)  # stored meanwhile: use that copy
                job.slots[i] = slot
                if slot is not None:
                    continue
            else:
                self.host.release(slot)
                job.slots[i] = None
            job.corrupt += result is ReadResult.CORRUPT
            valid = min(valid, i)
        job.num_valid = valid
