"""The parts of one engine, wired together, and the dispatch of incoming frames.

::

    TransferEngine (caller threads)
        │ loop.call(...)
        v
    IOLoop ── poll ──> ROUTER (peers' links to us) ─┐
       │         └──> our links (Linker) ───────────┼──> Core.dispatch ─> Linker (handshake)
       │         └──> data channel (DataChannel) ───┘        │         ─> Receiver / Sender /
       │                                                     │            Puller / PullServer
       └── every iteration: Sender.pump, deadlines, leases   v
                                                          Outbox ──> peers (faults applied)

Each part gets only its collaborators; the linker publishes session events the sender and
the data channel subscribe to; the ledger and offer book are thread-safe and keep their
locks inside. Nothing here imports the public API (:mod:`transfer.engine`).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any, cast

import zmq

from transfer import devices, wire
from transfer.addresses import endpoint
from transfer.config import RECEIVE_HWM, Role, TransferConfig
from transfer.errors import StatusCode, TransferError
from transfer.faults import FaultInjector
from transfer.handle import RemoteBlocks, TransferState
from transfer.hashing import Hasher
from transfer.ledger import Ledger, Reservation
from transfer.linker import Linker
from transfer.loop import IOLoop
from transfer.messages import (
    Ack,
    AnyMessage,
    Auth,
    Begin,
    Bye,
    Data,
    End,
    Error,
    Grant,
    Handshake,
    Header,
    Hello,
    Landed,
    Ping,
    Pull,
    Regions,
    Renew,
    RoleName,
)
from transfer.metrics import Metrics, TransferMetrics
from transfer.offers import OfferBook
from transfer.outbox import Outbox
from transfer.pulls import Puller, PullServer
from transfer.receiver import Receiver
from transfer.region import KVRegion
from transfer.sender import Sender
from transfer.session import Identity, Link, Session, host_id
from transfer.transports import local
from transfer.transports.tcp.channel import DataChannel
from transfer.transports.tcp.data_in import DataIn

log = logging.getLogger(__name__)

_NOT_LINKED = "not linked: link (authenticate) first"


class Core:
    """Everything one engine runs on its I/O thread."""

    def __init__(self, engine_id: str, role: Role, config: TransferConfig) -> None:
        self.engine_id, self.config = engine_id, config
        devices.hash_io()  # starts building the C copy-and-hash loop (used once it is there)
        self.metrics = Metrics()
        self.loop = IOLoop(engine_id, self.metrics)
        self.regions: dict[str, KVRegion] = {}
        self.ledger = Ledger(config.dedup_capacity, config.max_renewed_s)
        self.offers = OfferBook(config.max_renewed_s)
        self.hasher = Hasher(engine_id, self.loop.call)
        injector = FaultInjector(config.faults) if config.faults else None
        self.router = self._listen(config)
        self.outbox = Outbox(self.loop, self.router, self.metrics, injector)
        self.datachan = (
            DataChannel(config, self.loop, self.metrics, engine_id, self._intake)
            if config.data_channel
            else None
        )
        self.outbox.datachan = self.datachan
        self.me = Identity(
            engine_id,
            cast(RoleName, role.value),
            host_id(),
            os.getpid(),
            self.datachan.address if self.datachan is not None else "",
        )
        self.linker = Linker(
            self.me,
            config,
            self.loop,
            self.outbox,
            self.metrics,
            lambda: [region.describe() for region in self.regions.values()],
            lambda frames, link: self.dispatch(frames, link=link),
        )
        self.outbox.on_broken = self.linker.drop
        self.receiver = Receiver(
            self.me,
            config,
            self.loop,
            self.outbox,
            self.ledger,
            self.regions,
            self.metrics,
            self.hasher,
        )
        self.sender = Sender(
            self.me,
            config,
            self.loop,
            self.outbox,
            self.linker,
            self.metrics,
            self.hasher,
            injector,
        )
        self.puller = Puller(config, self.loop, self.outbox, self.linker)
        self.receiver.on_committed = self.puller.committed
        self.pulls = PullServer(
            config, self.loop, self.outbox, self.sender, self.offers, self.regions, self.metrics
        )
        if self.datachan is not None:
            datachan = self.datachan
            datachan.on_unusable = self.sender.on_data_unusable
            datachan.on_peer_closed = self.ping
            self.linker.on_lost.append(lambda session, reason: datachan.close_session(session))
            self.loop.every_iteration(lambda: datachan.tick(time.monotonic()), "data channel")
        self.loop.busy_hint = self.sender.busy_hint
        self.loop.on_shutdown = self._shutdown
        self.loop.watch(self.router, zmq.POLLIN, lambda events: self._drain_router())
        self.loop.every_iteration(self.sender.pump, "sending")
        self.loop.every_iteration(self._tick, "deadlines")
        self.loop.every_iteration(self.outbox.flush_faults, "faults")
        self._local = local.publish(engine_id, self.regions)
        self.loop.start()

    def _listen(self, config: TransferConfig) -> zmq.Socket[bytes]:
        router: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        router.setsockopt(zmq.MAXMSGSIZE, config.max_frame_bytes + wire.MAX_HEADER_BYTES)
        # Sending never drops a session's frame (no SNDHWM; unauthenticated connections get a
        # few replies, Outbox.to_identity); receiving stops at RECEIVE_HWM per connection.
        router.setsockopt(zmq.SNDHWM, 0)
        router.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
        if config.port:
            router.bind(f"tcp://{config.host}:{config.port}")
            port = config.port
        else:
            port = router.bind_to_random_port(f"tcp://{config.host}")
        #: Where peers link to us (``tcp://host:port``, the advertised host).
        self.address = endpoint(config.advertise_host or config.host, port)
        return router

    def held_ids(self) -> dict[str, set[int]]:
        """Source blocks held by unfinished sends and live offers, per region."""
        held = self.sender.held_ids()
        for name, ids in self.offers.held_ids().items():
            held.setdefault(name, set()).update(ids)
        return held

    def metrics_snapshot(self) -> TransferMetrics:
        """Counters plus gauges."""
        return self.metrics.snapshot(
            self.engine_id,
            peers=len(self.linker.peers()),
            transfers_active=len(self.sender.active) + len(self.receiver.active),
            held_blocks=sum(len(ids) for ids in self.held_ids().values()),
            reserved_blocks=sum(self.ledger.reserved_blocks().values()),
        )

    # ---- what the engine hands to the I/O thread -----------------------------------------
    def add_region(self, region: KVRegion) -> None:
        """Register ``region``: the ledger tracks its blocks, every peer hears of it."""
        if region.name in self.regions:
            raise TransferError(StatusCode.PARAM_INVALID, f"region {region.name!r} exists")
        self.regions[region.name] = region
        self.ledger.add_region(region)
        self.linker.announce_regions()

    def drop_reservation(self, reservation: Reservation) -> None:
        """A released reservation: forget its incoming transfers, cancel its handle."""
        why = f"request {reservation.blocks.request_id!r} released"
        self.receiver.release(reservation)
        self.loop.finish(
            reservation.handle, TransferState.CANCELLED, TransferError(StatusCode.CANCELLED, why)
        )

    def renew_held(self, request_id: str, now: float, seconds: float | None) -> None:
        """Extend the leases of our pushes and of our offer for ``request_id``."""
        self.sender.renew(request_id, now, seconds)
        self.pulls.renew(request_id, now, seconds)

    def send_renew(self, peer: str, blocks: RemoteBlocks) -> None:
        """Ask ``peer`` to keep its reservation or offer ``blocks`` alive (if linked)."""
        session = self.linker.session_for(peer)
        if session is not None:
            self.outbox.post(session, Renew(request_id=blocks.request_id, epoch=blocks.epoch))

    def _intake(self, sock: socket.socket, on_closed: Any) -> DataIn:
        return DataIn(
            sock,
            self.config,
            self.metrics,
            self.receiver,
            self.ledger,
            self.linker.by_data_proof,
            on_closed,
        )

    def _tick(self) -> None:
        now = time.monotonic()
        self.receiver.tick(now)
        self.puller.tick(now)
        self.pulls.tick(now)

    # ---- incoming frames ----------------------------------------------------------------
    def _drain_router(self) -> None:
        for _ in range(256):
            try:
                frames = self.router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.ZMQError:
                return
            identity, parts = frames[0].bytes, frames[1:]
            self.dispatch(parts, identity=identity)
            del frames, parts  # drop the payload now: ZMQ then reuses one buffer

    def dispatch(
        self, parts: list[zmq.Frame], identity: bytes | None = None, link: Link | None = None
    ) -> None:
        """Validate one incoming message and route it; bad frames are counted, not raised."""
        if not parts or len(parts) > 2:
            self.metrics.reject("bad_parts")
            return
        try:
            header = wire.decode(parts[0].buffer, len(parts))
        except wire.FrameError as exc:
            self.metrics.reject(exc.reason)
            return
        if len(parts) == 2 and len(parts[1]) > self.config.max_frame_bytes:
            self.metrics.reject("oversized")
            return
        try:
            session = self._authenticate(header, parts[0], identity, link)
            if session is not None:
                payload = parts[1].buffer if len(parts) == 2 else None
                if isinstance(header.msg, Data) and payload is not None and session.sealer:
                    payload = self.receiver.open_sealed(
                        session, parts[0].bytes, header.msg, payload
                    )
                self._route(header.msg, session, payload)
        except wire.FrameError as exc:
            self.metrics.reject(exc.reason)
        except Exception:  # a bug handling one frame: count it, the thread goes on
            log.exception("engine %s: handling %r failed", self.engine_id, header.msg)
            self.metrics.internal_errors_total += 1
            self.metrics.reject("internal_error")

    def _authenticate(
        self, header: Header, first: zmq.Frame, identity: bytes | None, link: Link | None
    ) -> Session | None:
        """The session a frame belongs to; None when it was a handshake frame or refused."""
        msg = header.msg
        if isinstance(msg, Handshake):
            peer_ip = _peer_ip(first) if isinstance(msg, Auth | Hello) else ""
            self.linker.on_handshake(msg, identity, link, peer_ip)
            return None
        session = self.linker.by_identity(identity) if identity is not None else None
        if link is not None:
            session = link.session
            if session is None and isinstance(msg, Error):
                self.linker.on_link_error(link, msg)
                return None
            restarted = isinstance(msg, Error) and not msg.transfer_id
            if session is not None and restarted and header.sid != session.token:
                # the engine at our link's address does not know our session (it
                # restarted): all this can make us do is link again, so no token needed
                assert isinstance(msg, Error)
                self.linker.on_session_error(session, msg)
                return None
        if session is None or not session.alive or header.sid != session.token:
            self.metrics.reject("unauthenticated")
            if identity is not None and not isinstance(msg, Error):
                code = StatusCode.NOT_LINKED.number
                refusal = Error(transfer_id="", code=code, text=_NOT_LINKED)
                self.outbox.to_identity(identity, wire.encode(refusal))
            return None
        if not wire.authentic(first.buffer, session.mac_receive):
            self.metrics.reject("bad_mac")  # altered on the way, or not from the peer
            return None
        session.take(header)  # "replay": a frame of the session sent again
        return session

    def _route(self, msg: AnyMessage, session: Session, payload: memoryview | None) -> None:
        match msg:
            case Begin():
                self.receiver.on_begin(session, msg)
            case Data():
                assert payload is not None  # wire.decode: DATA always has its payload
                self.receiver.on_data(session, msg, payload, sealed=session.sealer is not None)
            case Landed():
                self.receiver.on_landed(session, msg)
            case End():
                self.receiver.on_end(session, msg)
            case Pull():
                self.pulls.serve(session, msg)
            case Grant() | Ack():
                self.sender.on_reply(session, msg)
            case Error() if not msg.transfer_id:
                self.linker.on_session_error(session, msg)
            case Error():
                if not self.puller.on_error(session, msg):
                    self.sender.on_reply(session, msg)
            case Regions():
                session.regions = wire.regions_by_name(msg.regions)
            case Renew():
                self._on_renew(session, msg)
            case Bye():
                self.linker.drop(session, "peer said bye")
            case Ping():
                pass  # it proves the session is known (an unknown one got NOT_LINKED)
            case _:
                self.metrics.reject("unexpected_handshake")  # handshakes never get here

    def ping(self, session: Session) -> None:
        """Probe a session on its link: a restarted peer answers NOT_LINKED (we re-link), a
        dead one makes the send fail (we drop the session)."""
        if session.alive:
            self.outbox.post(session, Ping())

    def _on_renew(self, session: Session, msg: Renew) -> None:
        """A peer keeps our reservation (it writes) or our offer (it reads) alive."""
        now, request_id, epoch, peer = time.monotonic(), msg.request_id, msg.epoch, session.peer_id
        try:
            if not self.ledger.renew(request_id, now, epoch=epoch, writer=peer):
                self.pulls.renew(request_id, now, epoch=epoch, reader=peer)
        except TransferError:
            self.metrics.reject("not_granted")

    def _shutdown(self, closed: TransferError) -> None:
        self.sender.abort_all(closed)
        self.receiver.abort_all(closed)
        self.puller.abort_all(closed)
        self.pulls.abort_all(closed)
        self.linker.close()
        if self.datachan is not None:
            self.datachan.shutdown()
        self.router.close(0)
        self.hasher.close()


def _peer_ip(frame: zmq.Frame) -> str:
    """The address an inbound ZMQ message came from ("" if unknown)."""
    try:
        return str(frame.get("Peer-Address"))
    except (zmq.ZMQError, AttributeError, TypeError):
        return ""
