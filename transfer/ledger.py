"""Receiver-side bookkeeping: reserved destination blocks, their epochs, and seen transfers.

Every reservation gets a fresh, never reused, unguessable epoch (:mod:`transfer.epochs`) and
names the one peer allowed to write it (``writer``; None: any authenticated peer). Each
destination block records the epoch of the reservation that owns it (0 = free, -1 = owned
but dead after a timeout), so a write is accepted only while ``owner[block] == epoch`` for
every block it touches: a late or duplicate transfer can never land in blocks that were
released and handed to another request.

Direct (shared-memory) writers are granted a bounded time window; releasing blocks while a
grant is open fences them until the grant ends (:meth:`Ledger.release` says how long).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from transfer.epochs import EpochSource
from transfer.errors import StatusCode, TransferError
from transfer.handle import RemoteBlocks, TransferHandle
from transfer.region import KVRegion

FREE = 0
DEAD = -1
T = TypeVar("T")


@dataclass(slots=True)
class Reservation:
    """Destination blocks of one request, waiting for the layers in ``expected``."""

    blocks: RemoteBlocks
    handle: TransferHandle
    expected: frozenset[int]
    deadline: float
    #: The only peer engine allowed to write these blocks (None: any authenticated peer).
    writer: str | None = None
    #: Seconds a renewal extends the deadline by (the reservation's original timeout).
    timeout_s: float = 0.0
    #: Latest deadline a peer's renewals can give it (TransferConfig.max_renewed_s).
    renewable_until: float = float("inf")
    layers_done: set[int] = field(default_factory=set)
    alive: bool = True


class Ledger:
    """Reservations, epochs, grants and committed transfer ids (thread-safe: the lock is
    taken inside; callers that write blocks do it through :meth:`write_if_current`)."""

    def __init__(self, dedup_capacity: int, max_renewed_s: float = float("inf")) -> None:
        self._max_renewed_s = max_renewed_s
        self._lock = threading.RLock()
        self._owner: dict[str, np.ndarray] = {}
        self._fence: dict[str, np.ndarray] = {}
        self._epochs = EpochSource()
        self._by_request: dict[str, Reservation] = {}
        self._grants: dict[str, tuple[str, list[int], float]] = {}
        self._committed: OrderedDict[str, tuple[str, int]] = OrderedDict()
        self._capacity = dedup_capacity

    def add_region(self, region: KVRegion) -> None:
        """Start tracking the blocks of a newly registered region."""
        with self._lock:
            self._owner[region.name] = np.zeros(region.num_blocks, dtype=np.int64)
            self._fence[region.name] = np.zeros(region.num_blocks, dtype=np.float64)

    def reserve(
        self,
        region: KVRegion,
        request_id: str,
        block_ids: list[int],
        layers: range,
        handle: TransferHandle,
        deadline: float,
        writer: str | None = None,
    ) -> Reservation:
        """Own ``block_ids`` for ``request_id`` under a fresh epoch, writable by ``writer``."""
        region.check_blocks(block_ids, "destination")
        ids = np.asarray(block_ids, dtype=np.int64)
        with self._lock:
            if request_id in self._by_request:
                raise TransferError(
                    StatusCode.REPEAT_REQUEST, f"request {request_id!r} already has a reservation"
                )
            owner, fence = self._owner[region.name], self._fence[region.name]
            busy = ids[owner[ids] != FREE]
            if busy.size:
                raise TransferError(
                    StatusCode.PARAM_INVALID,
                    f"blocks {busy[:8].tolist()} of {region.name!r} are reserved by another "
                    "request; release it first",
                )
            fenced = float(fence[ids].max(initial=0.0)) - time.monotonic()
            if fenced > 0:
                raise TransferError(
                    StatusCode.PARAM_INVALID,
                    f"blocks of {region.name!r} are fenced for {fenced:.3f}s more by a direct "
                    "write grant of a released request; reserve them after that",
                )
            epoch = self._epochs.next()
            owner[ids] = epoch
            blocks = RemoteBlocks(request_id, epoch, tuple(block_ids), region.name)
            handle.blocks = blocks
            now = time.monotonic()
            timeout = max(deadline - now, 0.0)
            res = Reservation(blocks, handle, frozenset(layers), deadline, writer, timeout)
            res.renewable_until = max(deadline, now + self._max_renewed_s)
            self._by_request[request_id] = res
            return res

    def check(
        self,
        region: str,
        request_id: str,
        epoch: int,
        ids: np.ndarray,
        writer: str | None = None,
    ) -> Reservation:
        """The live reservation that ``(request_id, epoch)`` names, or STALE_EPOCH.

        With ``writer``, also NOT_GRANTED unless that peer may write the reservation.
        """
        with self._lock:
            res = self._by_request.get(request_id)
            owner = self._owner.get(region)
            if owner is None:
                raise TransferError(StatusCode.KV_CACHE_NOT_EXIST, f"no region {region!r}")
            if res is None or res.blocks.epoch != epoch or not res.alive:
                raise TransferError(
                    StatusCode.STALE_EPOCH,
                    f"request {request_id!r} epoch {epoch} is not a live reservation here",
                )
            if ids.size and (ids.max() >= owner.size or not bool((owner[ids] == epoch).all())):
                raise TransferError(
                    StatusCode.STALE_EPOCH,
                    f"blocks of {request_id!r} changed owner (epoch {epoch})",
                )
            if writer is not None and res.writer is not None and res.writer != writer:
                raise TransferError(
                    StatusCode.NOT_GRANTED,
                    f"request {request_id!r} was reserved for writer {res.writer!r}, "
                    f"not {writer!r}",
                )
            return res

    def write_if_current(self, res: Reservation, write: Callable[[], T]) -> T:
        """Run ``write`` (which writes ``res``'s blocks) only while ``res`` still owns them,
        holding the lock so that :meth:`release` cannot free the blocks in between;
        STALE_EPOCH (nothing written) otherwise."""
        with self._lock:
            if not res.alive:
                raise TransferError(
                    StatusCode.STALE_EPOCH,
                    f"request {res.blocks.request_id!r} epoch {res.blocks.epoch} was released",
                )
            return write()

    def commit_if_current(
        self, transfer_id: str, fingerprint: tuple[str, int], res: Reservation, layers: range
    ) -> bool:
        """Commit a verified transfer while ``res`` is live (STALE_EPOCH otherwise): remember
        its id, mark its layers received. True if that completed the reservation."""
        with self._lock:
            if not res.alive:
                raise TransferError(
                    StatusCode.STALE_EPOCH,
                    f"request {res.blocks.request_id!r} epoch {res.blocks.epoch} was released",
                )
            self._committed[transfer_id] = fingerprint
            while len(self._committed) > self._capacity:
                self._committed.popitem(last=False)
            self._grants.pop(transfer_id, None)
            res.layers_done.update(layers)
            return res.expected <= res.layers_done

    def committed(self, transfer_id: str) -> tuple[str, int] | None:
        """``(request id, epoch)`` a transfer id was committed for, if it was."""
        with self._lock:
            return self._committed.get(transfer_id)

    def overdue(self, now: float) -> list[Reservation]:
        """Live, incomplete reservations whose deadline passed."""
        with self._lock:
            return [
                r
                for r in self._by_request.values()
                if r.alive and not r.handle.done() and now > r.deadline
            ]

    def reservations(self) -> list[Reservation]:
        """Every reservation not released yet."""
        with self._lock:
            return list(self._by_request.values())

    def renew(
        self,
        request_id: str,
        now: float,
        seconds: float | None = None,
        epoch: int | None = None,
        writer: str | None = None,
    ) -> bool:
        """Push a live reservation's deadline to ``now + seconds`` (default: its timeout).

        With ``epoch`` and ``writer`` (a peer's renewal), only that epoch's reservation and
        only for its writer, and never past its ``renewable_until``; NOT_GRANTED for another
        writer. False if nothing is live.
        """
        with self._lock:
            res = self._by_request.get(request_id)
            if res is None or not res.alive or res.handle.done():
                return False
            if epoch is not None and res.blocks.epoch != epoch:
                return False
            if writer is not None and res.writer is not None and res.writer != writer:
                raise TransferError(
                    StatusCode.NOT_GRANTED, f"{writer!r} cannot renew {request_id!r}"
                )
            until = now + (seconds or res.timeout_s)
            if writer is not None:  # a peer's renewal: never past the limit
                until = min(until, res.renewable_until)
            res.deadline = max(res.deadline, until)
            return True

    def kill(self, res: Reservation) -> None:
        """Keep the blocks owned but refuse every further write (after a timeout)."""
        with self._lock:
            res.alive = False
            owner = self._owner[res.blocks.region]
            ids = np.asarray(res.blocks.block_ids, dtype=np.int64)
            owner[ids[owner[ids] == res.blocks.epoch]] = DEAD

    def release(self, request_id: str) -> tuple[Reservation | None, float]:
        """Free the request's blocks; returns it and seconds until they may be reused."""
        now = time.monotonic()
        with self._lock:
            res = self._by_request.pop(request_id, None)
            if res is None:
                return None, 0.0
            res.alive = False
            region = res.blocks.region
            ids = np.asarray(res.blocks.block_ids, dtype=np.int64)
            owner = self._owner[region]
            owner[ids] = FREE
            wait = 0.0
            for _transfer_id, (g_region, g_ids, until) in self._grants.items():
                if g_region == region and until > now and set(g_ids) & set(res.blocks.block_ids):
                    fence = self._fence[region]
                    fence[ids] = np.maximum(fence[ids], until)
                    wait = max(wait, until - now)
            return res, wait

    def grant(self, transfer_id: str, region: str, ids: list[int], until: float) -> None:
        """Record a direct-write window on ``ids``."""
        with self._lock:
            self._grants[transfer_id] = (region, ids, until)

    def end_grant(self, transfer_id: str) -> None:
        """The direct writer is done (or gone)."""
        with self._lock:
            self._grants.pop(transfer_id, None)

    def check_integrity(self) -> None:
        """Raise INTERNAL unless every owned block belongs to exactly one listed reservation
        (its epoch, or DEAD after a timeout) and every listed reservation owns its blocks."""
        with self._lock:
            claimed: dict[str, set[int]] = {name: set() for name in self._owner}
            for res in self._by_request.values():
                region, ids = res.blocks.region, set(res.blocks.block_ids)
                owner = self._owner[region][list(ids)]
                mark = res.blocks.epoch if res.alive else DEAD
                if claimed[region] & ids or not bool((owner == mark).all()):
                    raise TransferError(
                        StatusCode.INTERNAL,
                        f"ledger: blocks of {res.blocks.request_id!r} are not owned by it",
                    )
                claimed[region] |= ids
            for name, owner in self._owner.items():
                owned = set(np.flatnonzero(owner != FREE).tolist())
                if owned != claimed[name]:
                    stray = sorted(owned ^ claimed[name])[:8]
                    raise TransferError(
                        StatusCode.INTERNAL, f"ledger: blocks {stray} of {name!r} leaked"
                    )

    def reserved_blocks(self) -> dict[str, int]:
        """Blocks currently owned by reservations, per region (for leak checks)."""
        with self._lock:
            return {name: int((owner != FREE).sum()) for name, owner in self._owner.items()}
