"""Serving peers' pulls under offers: validate, authorize, push our blocks back.

The puller (usually decode) reserved its destination blocks and names blocks we offered it
(:mod:`transfer.offers`); we run an ordinary push for it (same ACK, retries), leased until
the offer's lease ends, whose handle surfaces in our ``progress()`` with
``kind == "serve_pull"``. Repeated pull requests for an id in flight are ignored; a repeat
after completion is answered by the puller's receiver as a duplicate.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from transfer import wire
from transfer.errors import StatusCode, TransferError
from transfer.handle import RemoteBlocks, TransferHandle, TransferState
from transfer.movers import OutTransfer
from transfer.offers import Offer, OfferBook
from transfer.session import Session

if TYPE_CHECKING:
    from transfer.core import Core


class PullServer:
    """Offers and the pushes that serve them (I/O thread, except :meth:`OfferBook.add`)."""

    def __init__(self, core: Core, offers: OfferBook) -> None:
        self.core = core
        self.offers = offers

    def serve(self, session: Session, h: dict[str, Any]) -> None:
        """A peer asks us to push our offered blocks ``src`` into its reserved blocks."""
        core, xid = self.core, h["x"]
        if xid in core.sender.active:
            return  # the pull request was repeated; we are already serving it
        now = time.monotonic()
        try:
            region = core.regions.get(h["sreg"])
            if region is None:
                raise TransferError(StatusCode.KV_CACHE_NOT_EXIST, f"no region {h['sreg']!r}")
            src = wire.int_list(h["src"], "src")
            region.check_blocks(src, "source")
            lay = h["lay"] or [0, region.num_layers]
            if len(lay) != 2 or not all(type(v) is int for v in lay):
                raise TransferError(StatusCode.PARAM_INVALID, f"bad layer range {lay!r}")
            layers = (lay[0], lay[1])
            ntensors = len(region.tensor_range(layers))
            dst = RemoteBlocks(h["rid"], h["ep"], tuple(wire.int_list(h["dst"], "dst")), h["reg"])
            offer = self.offers.authorize(
                session.peer_id, h["oreq"], h["oep"], region.name, src, range(*layers), now
            )
        except (TransferError, wire.FrameError) as exc:
            err = (
                exc
                if isinstance(exc, TransferError)
                else TransferError(StatusCode.PARAM_INVALID, str(exc))
            )
            if err.code is StatusCode.NOT_GRANTED:
                core.metrics.reject("not_granted")
            header = wire.encode(
                "error", session.token, x=xid, code=err.code.number, msg=err.message
            )
            core.send(session, "error", header)
            return
        ttl = min(max(float(h["ttl"]), 0.0), core.config.transfer_timeout_s)
        nbytes = len(src) * region.block_bytes * ntensors
        handle = TransferHandle(xid, "serve_pull", session.peer_id, dst.request_id, nbytes=nbytes)
        handle._cancel = core.sender.cancel
        ntok = h["ntok"] if h["ntok"] is not None else len(src) * region.block_size
        out = OutTransfer(
            handle,
            region,
            torch.tensor(src, dtype=torch.long),
            dst,
            layers,
            ntok,
            None,
            None,
            min(now + ttl, offer.lease_until),
            offer.lease_until,
        )
        out.on_closed = lambda state: self._served(offer, xid, state)
        self.offers.serving(offer, xid, handle, range(*layers))
        core.sender.start(out)

    def _served(self, offer: Offer, xid: str, state: TransferState) -> None:
        if self.offers.served(offer, xid, state is TransferState.DONE):
            self.offers.end(offer.ticket.request_id, TransferState.DONE, None)
        self._settle(offer)

    def renew(
        self,
        request_id: str,
        now: float,
        seconds: float | None = None,
        epoch: int | None = None,
        reader: str | None = None,
    ) -> bool:
        """Extend an offer's lease and the leases of the pushes serving it."""
        offer = self.offers.renew(request_id, now, seconds, epoch, reader)
        if offer is None:
            return False
        for xid in list(offer.serving):
            self.core.sender.extend_lease(xid, offer.lease_until)
        return True

    def withdraw(self, request_id: str) -> None:
        """The owner takes its offer back: refuse new pulls, stop the ones in flight."""
        err = TransferError(StatusCode.CANCELLED, f"offer {request_id!r} withdrawn")
        offer = self.offers.end(request_id, TransferState.CANCELLED, err)
        if offer is not None:
            self._stop(offer)

    def tick(self, now: float) -> None:
        """Expire offers whose lease ended."""
        for offer in self.offers.expired(now):
            err = TransferError(
                StatusCode.LEASE_EXPIRED,
                f"offer {offer.ticket.request_id!r} to {offer.reader!r} was not pulled in time",
            )
            if self.offers.end(offer.ticket.request_id, TransferState.TIMED_OUT, err):
                self._stop(offer)

    def _stop(self, offer: Offer) -> None:
        for handle, _ in list(offer.serving.values()):
            self.core.sender.cancel(handle)
        self._settle(offer)

    def _settle(self, offer: Offer) -> None:
        """Finish an ended offer's handle once no serving push can read its blocks."""
        if offer.ending is not None and self.offers.finished(offer):
            self.core.finish(offer.handle, *offer.ending)

    def abort_all(self, err: TransferError) -> None:
        """Engine shutdown."""
        for offer in self.offers.ended() + self.offers.expired(float("inf")):
            self.core.finish(offer.handle, TransferState.FAILED, err)
