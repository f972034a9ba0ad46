"""The one way out: every frame an engine sends to a peer goes through :meth:`Outbox.send`.

A frame goes on the session's ZMQ link (our DEALER for sessions we opened, our ROUTER for
sessions a peer opened) or, for stream transfers, on its data channel. Fault injection
(tests) happens here, so every transport sees the same faults. A link that cannot take a
frame any more (the peer's connection is gone) is reported through ``on_broken``.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import zmq

from transfer.checksum import Running
from transfer.faults import FaultInjector
from transfer.loop import IOLoop
from transfer.messages import AnyMessage, tag
from transfer.metrics import Metrics
from transfer.session import Session
from transfer.transports.tcp.frames import TRAILER_BYTES

Part = bytes | memoryview
#: Replies a connection without a session gets at most: a handshake takes two (CHALLENGE,
#: WELCOME or a refusal), a restarted peer's frames a NOT_LINKED.
MAX_UNAUTHENTICATED_REPLIES = 8
#: Connections without a session whose replies are counted (the oldest forgotten).
MAX_UNAUTHENTICATED_PEERS = 4096


class FrameOwner(Protocol):
    """A transfer whose source blocks queued frames view (held until the kernel took them)."""

    session: Session | None
    #: Bytes of its frames still queued on a data connection.
    queued: int


class DataPath(Protocol):
    """The data channel, as the outbox uses it
    (:class:`transfer.transports.tcp.channel.DataChannel`)."""

    def send(
        self,
        session: Session,
        parts: list[Part],
        owner: FrameOwner | None,
        hash_with: Running | None = None,
    ) -> bool: ...

    def cancel(self, owner: FrameOwner) -> None: ...


@dataclass(slots=True, frozen=True)
class Route:
    """Where a frame goes: the session's ZMQ link, or its data channel (``via_data``)."""

    session: Session
    via_data: bool = False
    #: The transfer whose source blocks the frame views (data channel accounting).
    owner: FrameOwner | None = None
    #: Data channel: the frame's digest trailer is computed while it is written.
    hash_with: Running | None = None


class Outbox:
    """Sends frames to sessions (I/O thread only)."""

    def __init__(
        self,
        loop: IOLoop,
        router: zmq.Socket[bytes],
        metrics: Metrics,
        injector: FaultInjector | None,
    ) -> None:
        self.loop, self.router, self.metrics, self.injector = loop, router, metrics, injector
        self.datachan: DataPath | None = None
        #: Replies sent to connections without a session, per connection (LRU).
        self._unanswered: OrderedDict[bytes, int] = OrderedDict()
        #: Told when a session's link cannot take frames any more (the linker drops it).
        self.on_broken: Callable[[Session, str], None] = lambda session, reason: None

    @property
    def faults_on(self) -> bool:
        """True when faults are injected (frames may be delayed or repeated later)."""
        return self.injector is not None

    def has_data_channel(self, session: Session) -> bool:
        """Whether frames to ``session``'s peer can go on a data channel: ours is on, and
        its address is known and was not found unusable."""
        return self.datachan is not None and bool(session.data_address) and not session.data_failed

    def post(self, session: Session, msg: AnyMessage) -> zmq.MessageTracker | bool:
        """Send a header-only message to ``session`` on its link; False if it could not go."""
        return self.send(session, tag(msg), session.header(msg))

    def send(
        self,
        session: Session,
        msg_type: str,
        header: bytes,
        payload: Part | None = None,
        track: bool = False,
        via_data: bool = False,
        owner: FrameOwner | None = None,
        trailer: bytes | None = None,
        hash_with: Running | None = None,
    ) -> zmq.MessageTracker | bool:
        """Send one frame to ``session``; False if it could not go. ``msg_type`` names
        the frame's message (:func:`transfer.messages.tag`) for fault rules.

        ``via_data``: ``header`` is a data-channel header (:mod:`transfer.transports.tcp.frames`)
        and the frame goes on the session's data channel; ``owner`` is the transfer whose source
        blocks ``payload`` views (held until the kernel took it). ``track``: return a ZMQ
        tracker that says when a zero-copy payload was released. A data-channel DATA frame
        whose header says so ends with a digest trailer: ``trailer`` (known), or computed by
        ``hash_with`` over the payload as it is written.
        """
        parts: list[Part] = [header] if payload is None else [header, payload]
        if trailer is not None or hash_with is not None:
            parts.append(trailer if trailer is not None else memoryview(bytearray(TRAILER_BYTES)))
        if self.injector is None:
            return self._send_raw(Route(session, via_data, owner, hash_with), parts, track)
        # With faults on, senders never hand out views of their source blocks, so frames
        # can be delayed or duplicated safely; trackers are not needed.
        for out in self.injector.apply(msg_type, parts, Route(session, via_data)):
            self.metrics.faults_injected_total = self.injector.fired
            if out.disconnect_first:
                self.on_broken(out.target.session, "fault: disconnect")
            if out.delay_s > 0:
                self.loop.at(
                    out.delay_s, functools.partial(self._send_later, out.target, out.parts)
                )
            else:
                self._send_raw(out.target, out.parts, False)
        return True

    def to_identity(self, identity: bytes, header: bytes) -> bool:
        """Send a bare header to a connection on our ROUTER that has no session (yet): at
        most ``MAX_UNAUTHENTICATED_REPLIES`` until it authenticates (:meth:`authenticated`),
        so a peer that never reads them cannot grow our queue (the ROUTER has no send
        high-water mark: sessions must never lose a frame)."""
        sent = self._unanswered.pop(identity, 0)
        self._unanswered[identity] = sent + 1
        while len(self._unanswered) > MAX_UNAUTHENTICATED_PEERS:
            self._unanswered.popitem(last=False)
        if sent >= MAX_UNAUTHENTICATED_REPLIES:
            self.metrics.reject("reply_budget")
            return False
        try:
            self.router.send_multipart([identity, header], zmq.NOBLOCK)
            return True
        except zmq.ZMQError:
            return False

    def authenticated(self, identity: bytes) -> None:
        """``identity`` has a session now: its replies go through :meth:`send`."""
        self._unanswered.pop(identity, None)

    def flush_faults(self) -> None:
        """Send frames the reorder fault held back when nothing came after them."""
        if self.injector is not None and self.injector.held:
            for out in self.injector.flush():
                self._send_raw(out.target, out.parts, False)

    def cancel_queued(self, owner: FrameOwner) -> None:
        """Forget the data-channel frames of a transfer that ended without its ACK."""
        if self.datachan is not None:
            self.datachan.cancel(owner)

    def _send_later(self, route: Route, parts: list[Part]) -> None:
        self._send_raw(route, parts, False)

    def _send_raw(self, route: Route, parts: list[Part], track: bool) -> zmq.MessageTracker | bool:
        session = route.session
        if not session.alive:
            return False
        if route.via_data:
            if self.datachan is None or not session.data_address:
                return False
            return self.datachan.send(session, parts, route.owner, route.hash_with)
        try:
            if session.identity is not None:
                self.router.send_multipart([session.identity, *parts], zmq.NOBLOCK, copy=False)
                return True
            assert session.link is not None
            tracker = session.link.socket.send_multipart(
                parts, zmq.NOBLOCK, copy=False, track=track
            )
            return tracker if track and tracker is not None else True
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:  # EHOSTUNREACH: the peer's connection is gone
            self.on_broken(session, f"send failed: {exc}")
            return False
