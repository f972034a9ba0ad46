"""Two background threads move KV blocks between the tiers while the engine computes.

    engine thread                copy thread (device <-> host)     disk thread (host <-> SSD)
    a cached block freed ─────>  device block -> host slot ──────> host slot -> file
    prefix found below device:
      all in host DRAM ───────>  host slots -> device blocks
      some on the SSD ──────────────────────────────────────────>  files -> host slots, checked
                                 host slots -> device blocks <───┘
    completed() <── every job, once its copies are done ──┘

The engine waits only for the copy thread, and only when it is out of device blocks that an
offload still holds; it never waits for the disk thread while it has work to run. A job's
device blocks are held (ref-counted) by the engine until the job comes back, so no copy
ever reads or writes a block that a request uses.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from backends import Backend
from hetero_pd.engine.kv_tiers.disk import DiskTier, ReadResult
from hetero_pd.engine.kv_tiers.host import HostTier

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Offload:
    """A cached device block copied down into a reserved host slot."""

    block_id: int
    block_hash: int
    token_ids: tuple[int, ...]
    slot: int
    ready: torch.Event | None = None  # recorded after the block's KV was computed
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
    started: float = field(default_factory=time.perf_counter)
    num_valid: int = 0
    disk_hits: int = 0
    corrupt: int = 0
    seconds: float = 0.0


class _DiskWrite(NamedTuple):
    slot: int  # pinned in the host tier until written
    block_hash: int
    token_ids: tuple[int, ...]


Job = Offload | Onload


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
        self._copy_q: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._disk_q: queue.SimpleQueue[Onload | _DiskWrite | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[Job] = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._in_copy = 0  # jobs queued for or running on the copy thread
        self._in_flight = 0  # jobs not yet in `completed()`
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
                self._disk_q.put(job)
                return
            self._in_copy += 1
        self._copy_q.put(job)

    def completed(self) -> list[Job]:
        """Jobs whose copies are done, in completion order (each returned once)."""
        jobs = []
        while True:
            try:
                jobs.append(self._done.get_nowait())
            except queue.Empty:
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
        """Until some job waits in `completed()`; with `all_jobs`, until every job and SSD
        write is done."""
        with self._cond:
            if all_jobs:
                self._cond.wait_for(lambda: self._in_flight == 0 and self._writes == 0, timeout)
            else:
                self._cond.wait_for(lambda: not self._done.empty(), timeout)

    def close(self) -> None:
        self._copy_q.put(None)
        if self.disk is not None:
            self._disk_q.put(None)
        for thread in self._threads:
            thread.join(timeout=30)

    def _finish(self, job: Job, copy_thread: bool) -> None:
        self._done.put(job)
        with self._cond:
            self._in_flight -= 1
            if copy_thread:
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
                self._finish(job, copy_thread=True)

    def _offload(self, job: Offload) -> None:
        stored = False
        try:
            if job.ready is not None and self._stream is not None:
                self._stream.wait_event(job.ready)
            self.backend.copy_blocks(
                self.host_layers, [job.slot], self.device_layers, [job.block_id], self._stream
            )
            job.ok = True
            to_disk = self.disk is not None and not self.disk.contains(job.block_hash)
            stored = self.host.store(job.slot, job.block_hash, job.token_ids, pin=to_disk)
            if stored and to_disk:  # write-through: the host copy stays pinned until written
                with self._cond:
                    self._writes += 1
                self._disk_q.put(_DiskWrite(job.slot, job.block_hash, job.token_ids))
        finally:
            if not job.ok:
                self.host.release(job.slot)

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
                self._copy_q.put(item)
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
