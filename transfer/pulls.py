"""Pulls, both sides: asking a peer for blocks it offered us, and serving such requests.

The puller (usually decode) reserves its destination blocks and sends PULL naming the
source's offer (:mod:`transfer.offers`); it resends PULL until the data commits or its
deadline passes. The source authorizes the request against the offer and runs an ordinary
push for it (same ACK, retries), leased until the offer's lease ends, whose handle surfaces
in its ``progress()`` with ``kind == "serve_pull"``. Repeated pull requests for an id in
flight are ignored; a repeat after completion is answered by the puller as a duplicate::

    puller                                   source
      PULL {x, offer rid+epoch, src, dst} ──> authorize (NOT_GRANTED: ERROR, counted)
                                          <── BEGIN / DATA / END  (a push, transfer id x)
      commit -> pull DONE                 ──> ACK -> serve_pull DONE -> offer DONE when
                                                  every offered layer was served
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from transfer.config import TransferConfig
from transfer.errors import StatusCode, TransferError
from transfer.handle import RemoteBlocks, TransferHandle, TransferState
from transfer.linker import Linker
from transfer.loop import IOLoop
from transfer.messages import Error, Pull
from transfer.metrics import Metrics
from transfer.offers import Offer, OfferBook
from transfer.outbox import Outbox
from transfer.outgoing import OutTransfer
from transfer.region import KVRegion
from transfer.sender import Sender
from transfer.session import Session


@dataclass(slots=True, eq=False)
class PendingPull:
    """A pull we asked a peer to serve; resent until the data commits or the deadline."""

    handle: TransferHandle
    request: Pull
    deadline: float
    resend_at: float


def new_pull(
    transfer_id: str,
    peer: str,
    region: KVRegion,
    src: RemoteBlocks | Sequence[int],
    src_region: str,
    dst: RemoteBlocks,
    layers: tuple[int, int],
    num_tokens: int | None,
    timeout_s: float,
    resend_s: float,
) -> PendingPull:
    """A pull of the peer's offer ``src`` into our reservation ``dst`` (plain ids name no
    offer: the peer refuses them), not sent yet."""
    offer_request, offer_epoch = "", 0
    if isinstance(src, RemoteBlocks):
        offer_request, offer_epoch = src.request_id, src.epoch
        src_region, src = src.region, src.block_ids
    nbytes = len(src) * region.block_bytes * len(region.tensor_range(layers))
    handle = TransferHandle(transfer_id, "pull", peer, dst.request_id, nbytes=nbytes, blocks=dst)
    request = Pull(
        transfer_id=transfer_id,
        request_id=dst.request_id,
        epoch=dst.epoch,
        region=dst.region,
        dst=list(dst.block_ids),
        src_region=src_region,
        src=list(src),
        offer_request=offer_request,
        offer_epoch=offer_epoch,
        layers=layers,
        num_tokens=num_tokens,
        ttl=float(timeout_s),
    )
    now = time.monotonic()
    return PendingPull(handle, request, now + timeout_s, now + resend_s)


class Puller:
    """Pulls this engine asked for (I/O thread only)."""

    def __init__(self, config: TransferConfig, loop: IOLoop, outbox: Outbox, links: Linker) -> None:
        self.config, self.loop, self.outbox, self.links = config, loop, outbox, links
        self.pending: dict[str, PendingPull] = {}

    def start(self, pull: PendingPull) -> None:
        """Send the pull request (NOT_LINKED without a session to the peer)."""
        session = self.links.session_for(pull.handle.peer)
        if session is None:
            err = TransferError(StatusCode.NOT_LINKED, f"no link to {pull.handle.peer!r}")
            self.loop.finish(pull.handle, TransferState.FAILED, err)
            return
        self.pending[pull.handle.transfer_id] = pull
        pull.handle.state = TransferState.IN_FLIGHT
        self.outbox.post(session, pull.request)

    def committed(self, transfer_id: str) -> None:
        """The push answering one of our pulls committed here: the pull is DONE."""
        pull = self.pending.pop(transfer_id, None)
        if pull is not None:
            self.loop.finish(pull.handle, TransferState.DONE)

    def on_error(self, session: Session, msg: Error) -> bool:
        """An ERROR about one of our pulls from its source (a final one fails it); True if it
        was one. Another peer naming our pull is not heard: only the source can end it."""
        pull = self.pending.get(msg.transfer_id)
        if pull is None or session.peer_id != pull.handle.peer:
            return False
        code = msg.status
        if not code.recoverable:
            del self.pending[msg.transfer_id]
            self.loop.finish(pull.handle, TransferState.FAILED, TransferError(code, msg.text))
        return True

    def tick(self, now: float) -> None:
        """Resend pulls not answered yet; time out the ones past their deadline."""
        for transfer_id, pull in list(self.pending.items()):
            if now > pull.deadline:
                del self.pending[transfer_id]
                err = TransferError(StatusCode.TIMEOUT, f"pull {transfer_id!r} not served in time")
                self.loop.finish(pull.handle, TransferState.TIMED_OUT, err)
            elif now > pull.resend_at:
                pull.resend_at = now + self.config.ack_timeout_s
                session = self.links.session_for(pull.handle.peer)
                if session is not None:
                    self.outbox.post(session, pull.request)

    def abort_all(self, err: TransferError) -> None:
        """Engine shutdown."""
        for pull in self.pending.values():
            self.loop.finish(pull.handle, TransferState.FAILED, err)
        self.pending.clear()


class PullServer:
    """Our offers and the pushes that serve them (I/O thread, except :meth:`OfferBook.add`)."""

    def __init__(
        self,
        config: TransferConfig,
        loop: IOLoop,
        outbox: Outbox,
        sender: Sender,
        offers: OfferBook,
        regions: dict[str, KVRegion],
        metrics: Metrics,
    ) -> None:
        self.config, self.loop, self.outbox, self.sender = config, loop, outbox, sender
        self.offers, self.regions, self.metrics = offers, regions, metrics

    def serve(self, session: Session, msg: Pull) -> None:
        """A peer asks us to push our offered blocks ``src`` into its reserved blocks."""
        transfer_id = msg.transfer_id
        if transfer_id in self.sender.active:
            return  # the pull request was repeated; we are already serving it
        now = time.monotonic()
        try:
            region = self.regions.get(msg.src_region)
            if region is None:
                raise TransferError(StatusCode.KV_CACHE_NOT_EXIST, f"no region {msg.src_region!r}")
            src = msg.src
            region.check_blocks(src, "source")
            layers = msg.layers or (0, region.num_layers)
            num_tensors = len(region.tensor_range(layers))
            dst = RemoteBlocks(msg.request_id, msg.epoch, tuple(msg.dst), msg.region)
            offer = self.offers.authorize(
                session.peer_id,
                msg.offer_request,
                msg.offer_epoch,
                region.name,
                src,
                range(*layers),
                now,
            )
        except TransferError as err:
            if err.code is StatusCode.NOT_GRANTED:
                self.metrics.reject("not_granted")
            self.outbox.post(session, Error.of(transfer_id, err))
            return
        ttl = min(msg.ttl, self.config.timeout_s)
        nbytes = len(src) * region.block_bytes * num_tensors
        handle = TransferHandle(
            transfer_id, "serve_pull", session.peer_id, dst.request_id, nbytes=nbytes
        )
        handle.cancel_with(self.sender.cancel)
        tokens = msg.num_tokens if msg.num_tokens is not None else len(src) * region.block_size
        out = OutTransfer(
            handle,
            region,
            torch.tensor(src, dtype=torch.long),
            dst,
            layers,
            tokens,
            None,
            None,
            min(now + ttl, offer.lease_until),
            offer.lease_until,
        )
        out.on_closed = lambda state, err: self._served(offer, session, transfer_id, state, err)
        self.offers.serving(offer, transfer_id, handle, range(*layers))
        self.sender.start(out)

    def _served(
        self,
        offer: Offer,
        session: Session,
        transfer_id: str,
        state: TransferState,
        err: TransferError | None,
    ) -> None:
        if self.offers.served(offer, transfer_id, state is TransferState.DONE):
            self.offers.end(offer.ticket.request_id, TransferState.DONE, None)
        elif state in (TransferState.FAILED, TransferState.TIMED_OUT) and session.alive:
            # Our retries are spent: the puller's next PULL would only start this again. Tell
            # it, and end the offer so its blocks are not held until the lease lapses.
            why = TransferError(StatusCode.NOT_SERVED, f"the source gave up: {err}")
            self.outbox.post(session, Error.of(transfer_id, why))
            self.offers.end(offer.ticket.request_id, TransferState.FAILED, why)
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
        for transfer_id in list(offer.serving):
            self.sender.extend_lease(transfer_id, offer.lease_until)
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
            self.sender.cancel(handle)
        self._settle(offer)

    def _settle(self, offer: Offer) -> None:
        """Finish an ended offer's handle once no serving push can read its blocks."""
        if offer.ending is not None and self.offers.finished(offer):
            self.loop.finish(offer.handle, *offer.ending)

    def abort_all(self, err: TransferError) -> None:
        """Engine shutdown."""
        for offer in self.offers.ended() + self.offers.expired(float("inf")):
            self.loop.finish(offer.handle, TransferState.FAILED, err)
