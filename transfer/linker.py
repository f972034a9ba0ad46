"""Linking: the authenticated handshake (see :mod:`transfer.auth`), re-links and teardown."""

from __future__ import annotations

import concurrent.futures
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import zmq

from transfer import auth, wire
from transfer.addresses import parse_endpoint, reachable, split_host_port
from transfer.errors import StatusCode, TransferError
from transfer.session import Link, Session

if TYPE_CHECKING:
    from transfer.core import Core

#: Handshakes in progress on the listening side, at most (oldest evicted).
MAX_PENDING_HELLOS = 256


class Linker:
    """Owns outbound links and the server side of the handshake."""

    def __init__(self, core: Core) -> None:
        self.core = core
        self.pending: OrderedDict[bytes, tuple[dict[str, Any], bytes]] = OrderedDict()
        #: Where each peer listens, as last told (link, link_async, set_peer_address).
        self.addresses: dict[str, str] = {}

    # ---- client side --------------------------------------------------------------------
    def connect(
        self, peer_id: str, address: str, waiter: concurrent.futures.Future[None] | None
    ) -> None:
        """Start (or join) a handshake with the engine listening at ``address``."""
        core = self.core
        for link in core.links.values():
            if link.peer_id == peer_id and link.address == address and link.session is None:
                if waiter is not None:
                    link.waiters.append(waiter)
                return  # a handshake is already running
        current = core.out_sessions.get(peer_id)
        if current is not None and current.alive and waiter is not None:
            assert current.link is not None
            if current.link.address == address:
                waiter.set_result(None)
                return
        sock: zmq.Socket[bytes] = core.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, core.config.max_frame_bytes + wire.MAX_HEADER_BYTES)
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
            core.metrics.link_failures_total += 1
            if waiter is not None and not waiter.done():
                waiter.set_exception(err)
            core.sender.on_link_failed(peer_id, err)
            return
        deadline = time.monotonic() + core.config.link_timeout_s
        link = Link(peer_id, address, sock, auth.new_nonce(), deadline)
        if waiter is not None:
            link.waiters.append(waiter)
        core.links[sock] = link
        core.poller.register(sock, zmq.POLLIN)
        hello = wire.encode("hello", eid=core.engine_id, role=core.role.value, nonce=link.nonce)
        sock.send(hello, zmq.NOBLOCK)
        core.at(core.config.link_timeout_s, lambda: self._expire(link))

    def _expire(self, link: Link) -> None:
        if link.session is None and link.socket in self.core.links:
            self.core.metrics.link_failures_total += 1
            self._fail_link(
                link,
                StatusCode.LINK_FAILED,
                f"no answer from {link.address} within the link timeout",
            )

    def _fail_link(self, link: Link, code: StatusCode, msg: str) -> None:
        self._close_link(link)
        err = TransferError(code, f"link to {link.peer_id or link.address}: {msg}")
        for w in link.waiters:
            if not w.done():
                w.set_exception(err)
        link.waiters.clear()
        self.core.sender.on_link_failed(link.peer_id, err)

    def _close_link(self, link: Link) -> None:
        if self.core.links.pop(link.socket, None) is not None:
            self.core.poller.unregister(link.socket)
            link.socket.close(0)

    def on_link_error(self, link: Link, h: dict[str, Any]) -> None:
        """An ERROR answered our handshake (e.g. AUTH_FAILED)."""
        code = StatusCode.from_number(h["code"])
        if code is StatusCode.AUTH_FAILED:
            self.core.metrics.auth_failures_total += 1
        self.core.metrics.link_failures_total += 1
        self._fail_link(link, code, h["msg"])

    def relink(self, session: Session) -> None:
        """Replace an outbound session's connection (after a timeout); no-op for inbound.

        Links to the peer's latest known address, which may have changed meanwhile."""
        if session.link is None:
            return
        self.drop(session, "re-link")
        address = self.addresses.get(session.peer_id, session.link.address)
        self.connect(session.peer_id, address, None)

    def moved(self, peer_id: str, address: str) -> None:
        """``peer_id`` listens at ``address`` now: link there unless already linked there."""
        self.addresses[peer_id] = address
        core = self.core
        current = core.out_sessions.get(peer_id)
        if current is not None and current.alive and current.link is not None:
            if current.link.address == address:
                return
            self.drop(current, f"peer moved to {address}")
        for link in list(core.links.values()):
            if link.peer_id == peer_id and link.session is None:
                if link.address == address:
                    return  # already linking there
                self._close_link(link)  # a handshake with where it used to be
        self.connect(peer_id, address, None)

    # ---- both sides ---------------------------------------------------------------------
    def on_handshake(
        self,
        msg_type: str,
        h: dict[str, Any],
        identity: bytes | None,
        link: Link | None,
        peer_ip: str = "",
    ) -> None:
        """Route a handshake frame to the side that expects it (``peer_ip``: where an
        inbound connection comes from, for a peer that advertises a wildcard host)."""
        if identity is not None and msg_type == "hello":
            self._on_hello(identity, h)
        elif identity is not None and msg_type == "auth":
            self._on_auth(identity, h, peer_ip)
        elif link is not None and msg_type == "challenge":
            self._on_challenge(link, h)
        elif link is not None and msg_type == "welcome":
            self._on_welcome(link, h)
        else:
            self.core.metrics.reject("unexpected_handshake")

    def _on_challenge(self, link: Link, h: dict[str, Any]) -> None:
        core = self.core
        if link.session is not None or link.peer_hello is not None:
            core.metrics.reject("unexpected_handshake")
            return
        expected = auth.server_proof(
            core.config.secret, link.nonce, h["nonce"], core.engine_id, h["eid"]
        )
        if not auth.verify(expected, h["proof"]):
            core.metrics.auth_failures_total += 1
            self._fail_link(link, StatusCode.AUTH_FAILED, "peer failed to prove the secret")
            return
        if link.peer_id and h["eid"] != link.peer_id:
            self._fail_link(
                link,
                StatusCode.LINK_FAILED,
                f"expected engine {link.peer_id!r}, found {h['eid']!r}",
            )
            return
        link.peer_hello = h
        proof = auth.client_proof(
            core.config.secret, link.nonce, h["nonce"], core.engine_id, h["eid"]
        )
        # the peer proved the secret: only now say who we are and what we hold
        link.socket.send(wire.encode("auth", proof=proof, **self._about_me()), zmq.NOBLOCK)

    def _on_welcome(self, link: Link, h: dict[str, Any]) -> None:
        core = self.core
        hello = link.peer_hello
        if hello is None or link.session is not None:
            core.metrics.reject("unexpected_handshake")
            return
        try:
            regions = self.parse_regions(h["regions"])
            check_data_address(h["da"])
        except wire.FrameError as exc:
            core.metrics.reject(exc.reason)
            self._fail_link(link, StatusCode.FRAME_INVALID, f"bad welcome: {exc}")
            return
        data_address = reachable(h["da"], parse_endpoint(link.address)[0])
        session = Session(
            hello["eid"],
            hello["role"],
            h["host"],
            h["pid"],
            regions,
            h["token"],
            link=link,
            data_address=data_address,
        )
        link.session = session
        old = core.out_sessions.get(session.peer_id)
        if old is not None and old is not session:
            self.drop(old, "replaced by a new link")
        core.out_sessions[session.peer_id] = session
        core.metrics.links_total += 1
        for w in link.waiters:
            if not w.done():
                w.set_result(None)
        link.waiters.clear()
        core.sender.on_linked(session)

    def _on_hello(self, identity: bytes, h: dict[str, Any]) -> None:
        core = self.core
        nonce_s = auth.new_nonce()
        self.pending[identity] = (h, nonce_s)
        while len(self.pending) > MAX_PENDING_HELLOS:
            self.pending.popitem(last=False)
        proof = auth.server_proof(core.config.secret, h["nonce"], nonce_s, h["eid"], core.engine_id)
        reply = wire.encode(
            "challenge", eid=core.engine_id, role=core.role.value, nonce=nonce_s, proof=proof
        )
        self._router_send(identity, reply)

    def _on_auth(self, identity: bytes, h: dict[str, Any], peer_ip: str) -> None:
        core = self.core
        pending = self.pending.pop(identity, None)
        if pending is None:
            core.metrics.reject("unexpected_handshake")
            return
        hello, nonce_s = pending
        expected = auth.client_proof(
            core.config.secret, hello["nonce"], nonce_s, hello["eid"], core.engine_id
        )
        if not auth.verify(expected, h["proof"]):
            core.metrics.auth_failures_total += 1
            core.metrics.reject("auth_failed")
            msg = "authentication failed: the link secrets differ"
            self._router_send(
                identity, wire.encode("error", x="", code=StatusCode.AUTH_FAILED.number, msg=msg)
            )
            return
        try:
            regions = self.parse_regions(h["regions"])
            check_data_address(h["da"])
        except wire.FrameError as exc:
            core.metrics.reject(exc.reason)
            code = StatusCode.FRAME_INVALID.number
            reply = wire.encode("error", x="", code=code, msg=f"link refused: {exc}")
            self._router_send(identity, reply)
            return
        token = auth.new_nonce()
        session = Session(
            hello["eid"],
            hello["role"],
            h["host"],
            h["pid"],
            regions,
            token,
            identity=identity,
            data_address=reachable(h["da"], peer_ip),
        )
        old = core.in_sessions.get(session.peer_id)
        if old is not None:
            self.drop(old, "peer re-linked")
        core.in_sessions[session.peer_id] = session
        core.in_by_identity[identity] = session
        core.metrics.links_total += 1
        self._router_send(identity, wire.encode("welcome", token=token, **self._about_me()))
        core.sender.on_linked(session)

    def on_session_error(self, session: Session, h: dict[str, Any]) -> None:
        """A session-level error (e.g. NOT_LINKED after the peer restarted): re-link."""
        if StatusCode.from_number(h["code"]) is StatusCode.NOT_LINKED and session.outbound:
            self.relink(session)

    def drop(self, session: Session, reason: str) -> None:
        """Forget a session and close its connection (pending frames are discarded)."""
        core = self.core
        session.alive = False
        if core.out_sessions.get(session.peer_id) is session:
            del core.out_sessions[session.peer_id]
        if core.in_sessions.get(session.peer_id) is session:
            del core.in_sessions[session.peer_id]
        if session.identity is not None:
            core.in_by_identity.pop(session.identity, None)
        if session.link is not None:
            self._close_link(session.link)
        session.mapped.clear()
        if core.datachan is not None:
            core.datachan.close_session(session)
        core.sender.on_session_lost(session, reason)

    def _about_me(self) -> dict[str, Any]:
        """What an authenticated peer learns about us: host, pid, data address, regions."""
        core = self.core
        return {
            "host": core.host,
            "pid": core.pid,
            "da": core.data_address,
            "regions": self.my_regions(),
        }

    def my_regions(self) -> list[dict[str, Any]]:
        """Descriptions of our registered regions, for peers."""
        return [r.describe() for r in self.core.regions.values()]

    def announce_regions(self) -> None:
        """Tell every peer about a region registered after linking."""
        for s in list(self.core.out_sessions.values()) + list(self.core.in_sessions.values()):
            self.core.send(s, "regions", wire.encode("regions", s.token, regions=self.my_regions()))

    @staticmethod
    def parse_regions(raw: list[Any]) -> dict[str, dict[str, Any]]:
        """Validate peers' region descriptions."""
        out: dict[str, dict[str, Any]] = {}
        for desc in raw[:64]:
            if not isinstance(desc, dict) or not isinstance(desc.get("name"), str):
                raise wire.FrameError("bad_field", "regions")
            if not isinstance(desc.get("shm"), (str, type(None))):
                raise wire.FrameError("bad_field", "regions.shm")
            for key in ("dt", "dev"):
                if not isinstance(desc.get(key), str):
                    raise wire.FrameError("bad_field", f"regions.{key}")
            for key in ("nl", "tpl", "nb"):
                value = desc.get(key)
                if type(value) is not int or value < 1:
                    raise wire.FrameError("bad_field", f"regions.{key}")
            shape = desc.get("shape")
            if not isinstance(shape, list) or not shape:
                raise wire.FrameError("bad_field", "regions.shape")
            wire.int_list(shape, "regions.shape")
            out[desc["name"]] = desc
        return out

    def _router_send(self, identity: bytes, header: bytes) -> None:
        try:
            self.core.router.send_multipart([identity, header], zmq.NOBLOCK)
        except zmq.ZMQError:
            self.pending.pop(identity, None)


def check_data_address(address: str) -> None:
    """A peer's advertised data address must be empty (none) or ``host:port``."""
    if address:
        try:
            split_host_port(address, "data address")
        except TransferError as exc:
            raise wire.FrameError("bad_field", exc.message) from None
