"""Links and sessions: the authenticated handshake (:mod:`transfer.auth`,
:mod:`transfer.handshake`), re-links, teardown.

The linker owns every session table (links we opened, sessions both ways, pending
handshakes, where each peer listens) and publishes what happens to them: ``on_linked``
(a session is up: transfers waiting for it resume), ``on_lost`` (a session is gone: its
data connections close, its transfers wait for a new one) and ``on_link_failed`` (a
handshake failed). Nobody else changes the tables; they ask :meth:`Linker.session_for`.
"""

from __future__ import annotations

import concurrent.futures
import hmac
import logging
from collections.abc import Callable

import zmq

from transfer import auth, handshake, wire
from transfer.addresses import parse_endpoint
from transfer.config import RECEIVE_HWM, TransferConfig
from transfer.errors import StatusCode, TransferError
from transfer.loop import IOLoop
from transfer.messages import (
    About,
    Auth,
    Bye,
    Challenge,
    Error,
    Handshake,
    Hello,
    RegionInfo,
    Regions,
    Welcome,
)
from transfer.metrics import Metrics
from transfer.outbox import Outbox
from transfer.session import Identity, Link, Session

log = logging.getLogger(__name__)

Frames = list[zmq.Frame]
Waiter = concurrent.futures.Future[None]


class Linker:
    """Sessions of one engine (I/O thread only, except the read-only lookups)."""

    def __init__(
        self,
        me: Identity,
        config: TransferConfig,
        loop: IOLoop,
        outbox: Outbox,
        metrics: Metrics,
        describe_regions: Callable[[], list[RegionInfo]],
        deliver: Callable[[Frames, Link], None],
    ) -> None:
        self.me, self.config, self.loop = me, config, loop
        self.outbox, self.metrics = outbox, metrics
        self._describe_regions, self._deliver = describe_regions, deliver
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._links: dict[zmq.Socket[bytes], Link] = {}
        self._outbound: dict[str, Session] = {}
        self._inbound: dict[str, Session] = {}
        self._by_identity: dict[bytes, Session] = {}
        self._pending = handshake.PendingHellos()
        #: The secret each peer's link is proven with (one shared, or one per peer id).
        self.secrets = auth.PeerSecrets(config.secret, config.per_peer_secrets)
        #: Where each peer listens, as last told (link, link_async, set_peer_address).
        self.addresses: dict[str, str] = {}
        self.on_linked: list[Callable[[Session], None]] = []
        self.on_lost: list[Callable[[Session, str], None]] = []
        self.on_link_failed: list[Callable[[str, TransferError], None]] = []

    # ---- lookups ------------------------------------------------------------------------
    def session_for(self, peer: str) -> Session | None:
        """The live session to ``peer`` (the one we opened first)."""
        for table in (self._outbound, self._inbound):
            session = table.get(peer)
            if session is not None and session.alive:
                return session
        return None

    def by_identity(self, identity: bytes) -> Session | None:
        """The session a peer opened to our ROUTER from connection ``identity``."""
        return self._by_identity.get(identity)

    def sessions(self) -> list[Session]:
        """Every live session."""
        return [s for s in (*self._outbound.values(), *self._inbound.values()) if s.alive]

    def peers(self) -> list[str]:
        """Ids of peers with a session."""
        return sorted({*self._outbound, *self._inbound})

    def by_data_proof(self, proof: bytes) -> Session | None:
        """The session a data connection's preface names (see :func:`auth.data_proof`)."""
        for session in self.sessions():
            if hmac.compare_digest(auth.data_proof(session.token, self.me.engine_id), proof):
                return session
        return None

    # ---- opening links ------------------------------------------------------------------
    def connect(self, peer_id: str, address: str, waiter: Waiter | None = None) -> None:
        """Start (or join) a handshake with ``peer_id`` at ``address``, where relinks go too."""
        self.addresses[peer_id] = address
        for link in self._links.values():
            if link.peer_id == peer_id and link.address == address and link.session is None:
                if waiter is not None:
                    link.waiters.append(waiter)
                return  # a handshake is already running
        current = self._outbound.get(peer_id)
        linked = current is not None and current.alive and current.link is not None
        if linked and waiter is not None and current.link.address == address:  # type: ignore[union-attr]
            waiter.set_result(None)
            return
        if self.secrets.secret_for(peer_id) is None:  # we may not link with it: say nothing
            self.metrics.auth_failures_total += 1
            self.metrics.link_failures_total += 1
            self._publish_failure(peer_id, auth.unknown_peer(peer_id), waiter)
            return
        sock: zmq.Socket[bytes] = self._context.socket(zmq.DEALER)
        for option, value in ((zmq.LINGER, 0), (zmq.SNDHWM, 0), (zmq.RCVHWM, RECEIVE_HWM)):
            sock.setsockopt(option, value)
        sock.setsockopt(zmq.MAXMSGSIZE, self.config.max_frame_bytes + wire.MAX_HEADER_BYTES)
        try:
            parse_endpoint(address)
            sock.connect(address)
        except (TransferError, zmq.ZMQError) as exc:
            sock.close(0)
            err = (
                exc
                if isinstance(exc, TransferError)
                else TransferError(StatusCode.LINK_FAILED, f"cannot connect to {address!r}: {exc}")
            )
            self.metrics.link_failures_total += 1
            self._publish_failure(peer_id, err, waiter)
            return
        link = Link(peer_id, address, sock, auth.new_nonce())
        if waiter is not None:
            link.waiters.append(waiter)
        self._links[sock] = link
        self.loop.watch(sock, zmq.POLLIN, lambda events: self._drain(link))
        hello = Hello(engine_id=self.me.engine_id, role=self.me.role, nonce=link.nonce)
        sock.send(wire.encode(hello), zmq.NOBLOCK)
        self.loop.at(self.config.link_timeout_s, lambda: self._expire(link))

    def moved(self, peer_id: str, address: str) -> None:
        """``peer_id`` listens at ``address`` now: link there unless already linked there."""
        self.addresses[peer_id] = address
        current = self._outbound.get(peer_id)
        if current is not None and current.alive and current.link is not None:
            if current.link.address == address:
                return
            self.drop(current, f"peer moved to {address}")
        for link in list(self._links.values()):
            if link.peer_id == peer_id and link.session is None:
                if link.address == address:
                    return  # already linking there
                self._close_link(link)  # a handshake with where it used to be
        self.connect(peer_id, address)

    def relink(self, session: Session) -> None:
        """Replace an outbound session's connection (to the peer's latest known address);
        a no-op for sessions the peer opened."""
        if session.link is None:
            return
        self.drop(session, "re-link")
        self.connect(session.peer_id, self.addresses.get(session.peer_id, session.link.address))

    def unlink(self, peer_id: str) -> None:
        """Say goodbye to ``peer_id`` and drop every session with it."""
        self.addresses.pop(peer_id, None)
        for table in (self._outbound, self._inbound):
            session = table.get(peer_id)
            if session is not None:
                self.outbox.post(session, Bye())
                self.drop(session, "unlink")

    def _drain(self, link: Link) -> None:
        for _ in range(256):
            if link.socket not in self._links:
                return  # closed while handling an earlier message
            try:
                frames = link.socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.ZMQError:
                return
            self._deliver(frames, link)
            del frames  # drop the payload now: ZMQ then reuses one buffer

    def _expire(self, link: Link) -> None:
        if link.session is None and link.socket in self._links:
            self.metrics.link_failures_total += 1
            self._fail_link(link, StatusCode.LINK_FAILED, "no answer within the link timeout")

    def _fail_link(self, link: Link, code: StatusCode, msg: str) -> None:
        self._close_link(link)
        err = TransferError(code, f"link to {link.peer_id or link.address}: {msg}")
        for waiter in link.waiters:
            if not waiter.done():
                waiter.set_exception(err)
        link.waiters.clear()
        self._publish_failure(link.peer_id, err)

    def _publish_failure(self, peer_id: str, err: TransferError, w: Waiter | None = None) -> None:
        if w is not None and not w.done():
            w.set_exception(err)
        for listener in self.on_link_failed:
            listener(peer_id, err)

    def _close_link(self, link: Link) -> None:
        if self._links.pop(link.socket, None) is not None:
            self.loop.unwatch(link.socket)
            link.socket.close(0)

    # ---- the handshake ------------------------------------------------------------------
    def on_handshake(
        self, msg: Handshake, identity: bytes | None, link: Link | None, peer_ip: str = ""
    ) -> None:
        """Route a handshake frame to the side that expects it (``peer_ip``: where an
        inbound connection comes from, for a peer that advertises a wildcard host)."""
        if identity is not None and isinstance(msg, Hello):
            self._on_hello(identity, msg, peer_ip)
        elif identity is not None and isinstance(msg, Auth):
            self._on_auth(identity, msg, peer_ip)
        elif link is not None and isinstance(msg, Challenge):
            self._on_challenge(link, msg)
        elif link is not None and isinstance(msg, Welcome):
            self._on_welcome(link, msg)
        else:
            self.metrics.reject("unexpected_handshake")

    def on_link_error(self, link: Link, msg: Error) -> None:
        """An ERROR answered our handshake (e.g. AUTH_FAILED)."""
        code = msg.status
        if code is StatusCode.AUTH_FAILED:
            self.metrics.auth_failures_total += 1
        self.metrics.link_failures_total += 1
        self._fail_link(link, code, msg.text)

    def on_session_error(self, session: Session, msg: Error) -> None:
        """A session-level error (NOT_LINKED: the peer restarted and forgot us): re-link."""
        if msg.status is StatusCode.NOT_LINKED and session.outbound:
            self.relink(session)

    def _on_hello(self, identity: bytes, msg: Hello, peer_ip: str) -> None:
        secret = self.secrets.secret_for(msg.engine_id)
        if secret is None:  # an id we hold no secret for: nobody may link as it
            self.metrics.auth_failures_total += 1
            self.metrics.reject("unknown_peer")
            self._reply(identity, wire.encode(Error.of("", auth.unknown_peer(msg.engine_id))))
            return
        server_nonce = auth.new_nonce()
        self._pending.add(identity, msg, server_nonce, peer_ip)
        me = self.me
        proof = auth.server_proof(secret, msg.nonce, server_nonce, msg.engine_id, me.engine_id)
        reply = Challenge(engine_id=me.engine_id, role=me.role, nonce=server_nonce, proof=proof)
        self._reply(identity, wire.encode(reply))

    def _on_challenge(self, link: Link, msg: Challenge) -> None:
        if link.session is not None or link.peer_hello is not None:
            self.metrics.reject("unexpected_handshake")
            return
        me = self.me.engine_id
        secret = self.secrets.secret_for(link.peer_id or msg.engine_id)
        expected = auth.server_proof(secret or b"", link.nonce, msg.nonce, me, msg.engine_id)
        if secret is None or not auth.verify(expected, msg.proof):
            self.metrics.auth_failures_total += 1
            self._fail_link(link, StatusCode.AUTH_FAILED, "peer failed to prove the secret")
            return
        if link.peer_id and msg.engine_id != link.peer_id:
            found = f"expected engine {link.peer_id!r}, found {msg.engine_id!r}"
            self._fail_link(link, StatusCode.LINK_FAILED, found)
            return
        link.peer_hello, link.secret = msg, secret
        proof = auth.client_proof(secret, link.nonce, msg.nonce, me, msg.engine_id)
        # the peer proved the secret: only now say who we are and what we hold
        link.socket.send(wire.encode(Auth(proof=proof, about=self._about_me())), zmq.NOBLOCK)

    def _on_auth(self, identity: bytes, msg: Auth, peer_ip: str) -> None:
        pending = self._pending.pop(identity)
        if pending is None:
            self.metrics.reject("unexpected_handshake")
            return
        hello, server_nonce = pending
        secret = self.secrets.secret_for(hello.engine_id)
        expected = auth.client_proof(
            secret or b"", hello.nonce, server_nonce, hello.engine_id, self.me.engine_id
        )
        if secret is None or not auth.verify(expected, msg.proof):
            self.metrics.auth_failures_total += 1
            self.metrics.reject("auth_failed")
            self._refuse(identity, StatusCode.AUTH_FAILED, "the link secrets differ")
            return
        try:
            data_address, theirs = handshake.peer_facts(msg.about, peer_ip)
        except wire.FrameError as exc:
            self.metrics.reject(exc.reason)
            self._refuse(identity, StatusCode.FRAME_INVALID, f"link refused: {exc}")
            return
        refused = handshake.mismatch(self.me.engine_id, self.config, hello, theirs, msg.about)
        if refused is not None:
            self.metrics.reject(refused[0])
            log.error("%s", refused[1])
            self._refuse(identity, StatusCode.PARAM_INVALID, refused[1])
            return
        keys = handshake.keys(self.config, secret, self.me, msg.about, hello, server_nonce)
        token = auth.new_nonce()
        session = handshake.new_session(
            hello, msg.about, token, data_address, keys, identity=identity
        )
        old = self._inbound.get(session.peer_id)
        if old is not None:
            self.drop(old, "peer re-linked")
        self._inbound[session.peer_id] = session
        self._by_identity[identity] = session
        self._reply(identity, wire.encode(Welcome(token=token, about=self._about_me())))
        self.outbox.authenticated(identity)
        self._up(session)

    def _on_welcome(self, link: Link, msg: Welcome) -> None:
        hello = link.peer_hello
        if hello is None or link.session is not None:
            self.metrics.reject("unexpected_handshake")
            return
        try:
            data_address, theirs = handshake.peer_facts(msg.about, parse_endpoint(link.address)[0])
        except wire.FrameError as exc:
            self.metrics.reject(exc.reason)
            self._fail_link(link, StatusCode.FRAME_INVALID, f"bad welcome: {exc}")
            return
        refused = handshake.mismatch(self.me.engine_id, self.config, hello, theirs, msg.about)
        if refused is not None:
            self.metrics.reject(refused[0])
            self._fail_link(link, StatusCode.PARAM_INVALID, refused[1])
            return
        keys = handshake.keys(self.config, link.secret, self.me, msg.about, hello, link.nonce)
        session = handshake.new_session(hello, msg.about, msg.token, data_address, keys, link=link)
        link.session = session
        old = self._outbound.get(session.peer_id)
        if old is not None and old is not session:
            self.drop(old, "replaced by a new link")
        self._outbound[session.peer_id] = session
        for waiter in link.waiters:
            if not waiter.done():
                waiter.set_result(None)
        link.waiters.clear()
        self._up(session)

    def _up(self, session: Session) -> None:
        self.metrics.links_total += 1
        for listener in self.on_linked:
            listener(session)

    def _about_me(self) -> About:
        return handshake.about(self.me, self._describe_regions(), self.config)

    def _refuse(self, identity: bytes, code: StatusCode, msg: str) -> None:
        self._reply(identity, wire.encode(Error.of("", TransferError(code, msg))))

    def _reply(self, identity: bytes, header: bytes) -> None:
        if not self.outbox.to_identity(identity, header):
            self._pending.pop(identity)

    # ---- sessions -----------------------------------------------------------------------
    def announce_regions(self) -> None:
        """Tell every peer about a region registered after linking."""
        regions = Regions(regions=self._describe_regions())
        for session in self.sessions():
            self.outbox.post(session, regions)

    def drop(self, session: Session, reason: str) -> None:
        """Forget a session and close its connection (pending frames are discarded)."""
        if not session.alive and session not in (*self._outbound.values(), *self._inbound.values()):
            return
        session.alive = False
        if self._outbound.get(session.peer_id) is session:
            del self._outbound[session.peer_id]
        if self._inbound.get(session.peer_id) is session:
            del self._inbound[session.peer_id]
        if session.identity is not None:
            self._by_identity.pop(session.identity, None)
        if session.link is not None:
            self._close_link(session.link)
        session.mapped.clear()
        for listener in self.on_lost:
            listener(session, reason)

    def close(self) -> None:
        """Say goodbye on every session and close every link (engine shutdown)."""
        for session in self.sessions():
            self.outbox.post(session, Bye())
        for link in list(self._links.values()):
            self._close_link(link)
