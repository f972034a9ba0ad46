"""Source-side grants: which peer may pull which of our blocks, for which request and epoch.

A PULL is served only under an offer the source made explicitly::

    source (prefill)                              reader (decode)
      offer(rid, ids, reader="decode-0") -> ticket ──control plane──>  reserve(dst)
                                          <── PULL {ticket's rid + epoch, src ids, layers}
      authorize: reader, epoch, ids, layers, lease?  (else NOT_GRANTED, counted)
      serve it as a push (lease = the offer's)     ──> BEGIN/DATA/END ──> ACK
      every offered layer served and ACKed -> offer DONE: free the source blocks
      lease ends first -> TIMED_OUT (LEASE_EXPIRED); withdraw() -> CANCELLED

Each offered layer is served once: a range that overlaps layers already served (or being
served) is refused, so nothing reads the source blocks after the offer is DONE. This module
is bookkeeping only (thread-safe); :mod:`transfer.pulls` drives it on the I/O thread.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from transfer.epochs import EpochSource
from transfer.errors import StatusCode, TransferError
from transfer.handle import RemoteBlocks, TransferHandle, TransferState
from transfer.region import KVRegion


@dataclass(slots=True, eq=False)
class Offer:
    """Blocks of one request that one reader may pull, for a bounded time."""

    ticket: RemoteBlocks
    reader: str
    layers: range
    handle: TransferHandle
    lease_s: float
    lease_until: float
    #: Latest lease end a reader's renewals can give it (TransferConfig.max_renewed_s).
    renewable_until: float = float("inf")
    #: Layers served and ACKed.
    served: set[int] = field(default_factory=set)
    #: Serving pushes in flight: transfer id -> (their handle, their layers).
    serving: dict[str, tuple[TransferHandle, range]] = field(default_factory=dict)
    #: Set when the offer ended: the handle finishes with it once nothing is in flight.
    ending: tuple[TransferState, TransferError | None] | None = None


class OfferBook:
    """Live offers of one engine, by request id."""

    def __init__(self, max_renewed_s: float = float("inf")) -> None:
        self._max_renewed_s = max_renewed_s
        self._lock = threading.Lock()
        self._epochs = EpochSource()
        self._by_request: dict[str, Offer] = {}

    def add(
        self,
        region: str,
        request_id: str,
        block_ids: list[int],
        reader: str,
        layers: range,
        lease_s: float,
        handle: TransferHandle,
        now: float,
    ) -> Offer:
        """Offer ``block_ids`` (``layers``) of ``request_id`` to ``reader`` under a new epoch."""
        with self._lock:
            if request_id in self._by_request:
                raise TransferError(
                    StatusCode.REPEAT_REQUEST, f"request {request_id!r} already has an offer"
                )
            ticket = RemoteBlocks(request_id, self._epochs.next(), tuple(block_ids), region)
            handle.blocks = ticket
            offer = Offer(ticket, reader, layers, handle, lease_s, now + lease_s)
            offer.renewable_until = now + max(lease_s, self._max_renewed_s)
            self._by_request[request_id] = offer
            return offer

    def authorize(
        self,
        peer: str,
        request_id: str,
        epoch: int,
        region: str,
        src_ids: list[int],
        layers: range,
        now: float,
    ) -> Offer:
        """The offer that lets ``peer`` pull ``src_ids`` (``layers``) now, or NOT_GRANTED."""
        with self._lock:
            offer = self._by_request.get(request_id)
            problem = None
            if offer is None or offer.ending is not None or now > offer.lease_until:
                problem = f"no live offer {request_id!r}"
            elif offer.ticket.epoch != epoch or offer.reader != peer:
                problem = f"offer {request_id!r} is not for {peer!r} at epoch {epoch}"
            elif offer.ticket.region != region or not set(src_ids) <= set(offer.ticket.block_ids):
                problem = f"blocks {src_ids[:8]} of {region!r} are not in offer {request_id!r}"
            elif not (offer.layers.start <= layers.start and layers.stop <= offer.layers.stop):
                problem = f"layers [{layers.start}, {layers.stop}) are not offered"
            elif _overlaps(layers, offer):
                problem = f"layers [{layers.start}, {layers.stop}) were served already"
            if problem is not None or offer is None:
                raise TransferError(StatusCode.NOT_GRANTED, problem or "no offer")
            return offer

    def serving(
        self, offer: Offer, transfer_id: str, handle: TransferHandle, layers: range
    ) -> None:
        """A push serving ``layers`` of ``offer`` started."""
        with self._lock:
            offer.serving[transfer_id] = (handle, layers)

    def served(self, offer: Offer, transfer_id: str, ok: bool) -> bool:
        """A serving push ended (``ok``: ACKed). True once every offered layer was served."""
        with self._lock:
            _, layers = offer.serving.pop(transfer_id, (None, range(0)))
            if ok:
                offer.served.update(layers)
            return offer.ending is None and set(offer.layers) <= offer.served

    def end(
        self, request_id: str, state: TransferState, error: TransferError | None
    ) -> Offer | None:
        """Stop serving ``request_id``'s offer (it stays listed until nothing is in flight)."""
        with self._lock:
            offer = self._by_request.get(request_id)
            if offer is None or offer.ending is not None:
                return None
            offer.ending = (state, error)
            return offer

    def finished(self, offer: Offer) -> bool:
        """Forget an ended offer whose serving pushes are all gone; True if it was."""
        with self._lock:
            if offer.ending is None or offer.serving:
                return False
            if self._by_request.get(offer.ticket.request_id) is offer:
                del self._by_request[offer.ticket.request_id]
            return True

    def renew(
        self,
        request_id: str,
        now: float,
        seconds: float | None = None,
        epoch: int | None = None,
        reader: str | None = None,
    ) -> Offer | None:
        """Extend a live offer's lease (with ``epoch``/``reader``: a reader's renewal, which
        must name the offer's epoch and ends by ``renewable_until``; NOT_GRANTED for another
        peer). The offer, or None."""
        with self._lock:
            offer = self._by_request.get(request_id)
            if offer is None or offer.ending is not None or now > offer.lease_until:
                return None
            if epoch is not None and offer.ticket.epoch != epoch:
                return None
            if reader is not None and offer.reader != reader:
                raise TransferError(
                    StatusCode.NOT_GRANTED, f"{reader!r} cannot renew {request_id!r}"
                )
            until = now + (seconds or offer.lease_s)
            if reader is not None:  # a reader's renewal: never past the limit
                until = min(until, offer.renewable_until)
            offer.lease_until = max(offer.lease_until, until)
            return offer

    def expired(self, now: float) -> list[Offer]:
        """Live offers whose lease ended."""
        with self._lock:
            return [
                o for o in self._by_request.values() if o.ending is None and now > o.lease_until
            ]

    def ended(self) -> list[Offer]:
        """Offers that ended and wait for their serving pushes to stop."""
        with self._lock:
            return [o for o in self._by_request.values() if o.ending is not None]

    def held_ids(self) -> dict[str, set[int]]:
        """Source blocks held by offers, per region (for leak checks)."""
        held: dict[str, set[int]] = {}
        with self._lock:
            for offer in self._by_request.values():
                held.setdefault(offer.ticket.region, set()).update(offer.ticket.block_ids)
        return held


def _overlaps(layers: range, offer: Offer) -> bool:
    taken = set(offer.served)
    for _, serving in offer.serving.values():
        taken.update(serving)
    return any(layer in taken for layer in layers)


def new_offer(
    engine_id: str,
    region: KVRegion,
    request_id: str,
    block_ids: list[int],
    reader: str,
    layers: tuple[int, int],
) -> TransferHandle:
    """The handle of a validated offer of ``block_ids`` (``layers``) to ``reader``, not
    booked yet (:meth:`OfferBook.add`)."""
    region.check_blocks(block_ids, "offered")
    if not block_ids:
        raise TransferError(StatusCode.PARAM_INVALID, "no blocks to offer")
    handle = TransferHandle(f"{engine_id}/offer/{request_id}", "offer", reader, request_id)
    handle.nbytes = len(block_ids) * region.block_bytes * len(region.tensor_range(layers))
    return handle
