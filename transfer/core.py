"""The engine's I/O thread: sockets, the poll loop, timers, frame dispatch and sending.

One thread owns every ZMQ socket of an engine. Callers talk to it through a command queue
(woken by a pipe); it completes handles and queues them for :meth:`TransferEngine.progress`.
Heavy work (gathers, checksums, copies) runs here in bounded slices between polls, so a big
transfer never stops the engine from answering ACKs and handshakes.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import heapq
import itertools
import logging
import math
import os
import socket as pysocket
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import zmq

from transfer import wire
from transfer.addresses import endpoint
from transfer.config import EngineConfig, Role
from transfer.datachan import DataChannel
from transfer.errors import StatusCode, TransferError
from transfer.faults import FaultInjector
from transfer.handle import TransferHandle, TransferState
from transfer.hashing import Hasher
from transfer.ledger import Ledger
from transfer.metrics import Metrics
from transfer.offers import OfferBook
from transfer.pulls import PullServer
from transfer.region import KVRegion
from transfer.session import Link, Session

if TYPE_CHECKING:
    from transfer.movers import OutTransfer

T = TypeVar("T")
log = logging.getLogger(__name__)
Part = bytes | memoryview
#: Engines of this process by id, for the in-process ("local") transport.
LOCAL_ENGINES: weakref.WeakValueDictionary[str, Core] = weakref.WeakValueDictionary()


@dataclass(slots=True, frozen=True)
class Route:
    """Where a frame goes: the session's ZMQ link, or its data channel (``via_data``)."""

    session: Session
    via_data: bool = False
    #: The transfer whose source blocks the frame views (data channel accounting).
    owner: OutTransfer | None = None


def _peer_ip(frame: zmq.Frame) -> str:
    """The address an inbound ZMQ message came from ("" if unknown)."""
    try:
        return str(frame.get("Peer-Address"))
    except (zmq.ZMQError, AttributeError, TypeError):
        return ""


def host_id() -> str:
    """Identifies this machine (and boot), so peers can tell they share /dev/shm."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{pysocket.gethostname()}/{boot}"


class Core:
    """State owned by the I/O thread of one engine."""

    def __init__(self, engine_id: str, role: Role, config: EngineConfig) -> None:
        from transfer.linker import Linker
        from transfer.receiver import Receiver
        from transfer.sender import Sender

        self.engine_id, self.role, self.config = engine_id, role, config
        self.host, self.pid = host_id(), os.getpid()
        self.regions: dict[str, KVRegion] = {}
        self.ledger = Ledger(config.dedup_capacity)
        self.metrics = Metrics()
        self.hasher = Hasher(engine_id)
        self.injector = FaultInjector(config.faults) if config.faults else None
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.router: zmq.Socket[bytes] = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.router.setsockopt(zmq.MAXMSGSIZE, config.max_frame_bytes + wire.MAX_HEADER_BYTES)
        self.router.setsockopt(zmq.SNDHWM, 0)
        self.router.setsockopt(zmq.RCVHWM, 0)
        if config.port:
            self.router.bind(f"tcp://{config.host}:{config.port}")
            port = config.port
        else:
            port = self.router.bind_to_random_port(f"tcp://{config.host}")
        self.address = endpoint(config.advertise_host or config.host, port)
        self.poller = zmq.Poller()
        self.poller.register(self.router, zmq.POLLIN)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self.poller.register(self._wake_r, zmq.POLLIN)
        self.datachan = DataChannel(self) if config.data_channel else None
        if self.datachan is not None:
            self.datachan.on_unusable = self._on_data_unusable
            self.datachan.on_peer_closed = self.ping
        #: Where peers reach our data channel (advertised in the handshake; "" if off).
        self.data_address = self.datachan.address if self.datachan is not None else ""
        self.commands: deque[Callable[[], None]] = deque()
        self.completed: deque[TransferHandle] = deque()
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._tick = itertools.count()
        self.closing = False
        #: Why the I/O thread died (None while it runs or after a normal close).
        self.fatal: str | None = None
        self.links: dict[zmq.Socket[bytes], Link] = {}
        self.out_sessions: dict[str, Session] = {}
        self.in_sessions: dict[str, Session] = {}
        self.in_by_identity: dict[bytes, Session] = {}
        self.linker = Linker(self)
        self.sender = Sender(self)
        self.receiver = Receiver(self)
        self.offers = OfferBook()
        self.pulls = PullServer(self, self.offers)
        self.thread = threading.Thread(target=self._run, name=f"transfer-{engine_id}", daemon=True)
        LOCAL_ENGINES[engine_id] = self
        self.thread.start()

    # ---- called from user threads -------------------------------------------------------
    def check_open(self) -> None:
        """Raise ENGINE_CLOSED (with the reason if the I/O thread died) once closed."""
        if self.closing:
            why = f": its I/O thread died ({self.fatal})" if self.fatal else ""
            raise TransferError(StatusCode.ENGINE_CLOSED, f"engine {self.engine_id} is closed{why}")

    def call(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the I/O thread soon."""
        self.check_open()
        self.commands.append(fn)
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass  # the pipe is full of wake-ups already
        except OSError as exc:  # the loop ended and closed the pipe meanwhile
            if fn not in self.commands:
                return  # it ran ``fn`` before ending (e.g. the close command itself)
            raise TransferError(StatusCode.ENGINE_CLOSED, f"engine {self.engine_id}") from exc

    def call_wait(self, fn: Callable[[], T], timeout: float) -> T:
        """Run ``fn`` on the I/O thread and return its result (re-raises its exception)."""
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()

        def run() -> None:
            try:
                fut.set_result(fn())
            except BaseException as exc:
                fut.set_exception(exc)

        self.call(run)
        return fut.result(timeout)

    # ---- I/O thread helpers -------------------------------------------------------------
    def at(self, delay: float, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the I/O thread after ``delay`` seconds."""
        heapq.heappush(self._timers, (time.monotonic() + delay, next(self._tick), fn))

    def session_for(self, peer: str) -> Session | None:
        """The live session to ``peer`` (our own link first)."""
        for table in (self.out_sessions, self.in_sessions):
            s = table.get(peer)
            if s is not None and s.alive:
                return s
        return None

    def finish(
        self,
        handle: TransferHandle,
        state: TransferState,
        error: TransferError | None = None,
        released: str | None = None,
    ) -> None:
        """Complete a handle and queue it for ``progress()`` callbacks.

        Queued before waiters wake, so ``progress()`` after ``wait()`` always returns it.
        """
        if not handle.done():
            self.completed.append(handle)
            handle._finish(state, error, released)

    def send(
        self,
        session: Session,
        msg_type: str,
        header: bytes,
        payload: Part | None = None,
        track: bool = False,
        via_data: bool = False,
        owner: OutTransfer | None = None,
    ) -> zmq.MessageTracker | bool:
        """Send one frame to ``session`` through fault injection; False if it could not go.

        ``via_data``: ``header`` is a data-channel header (:mod:`transfer.dataframe`) and the
        frame goes on the session's data channel; ``owner`` is the transfer whose source
        blocks ``payload`` views (held until the kernel took it).
        """
        parts: list[Part] = [header] if payload is None else [header, payload]
        route = Route(session, via_data, owner)
        if self.injector is None:
            return self._send_raw(route, parts, track)
        # With faults on, the sender never hands out views of its source blocks, so frames
        # can be delayed or duplicated safely; trackers are not needed.
        for out in self.injector.apply(msg_type, parts, Route(session, via_data)):
            self.metrics.faults_injected_total = self.injector.fired
            if out.disconnect_first:
                self.linker.drop(out.target.session, "fault: disconnect")
            if out.delay_s > 0:
                self.at(out.delay_s, functools.partial(self._send_raw_none, out.target, out.parts))
            else:
                self._send_raw(out.target, out.parts, False)
        return True

    def _send_raw_none(self, route: Route, parts: list[Part]) -> None:
        self._send_raw(route, parts, False)

    def flush_faults(self) -> None:
        """Send frames the reorder fault held back when nothing came after them."""
        if self.injector is not None and self.injector.held:
            for out in self.injector.flush():
                self._send_raw(out.target, out.parts, False)

    def _send_raw(self, route: Route, parts: list[Part], track: bool) -> zmq.MessageTracker | bool:
        session = route.session
        if not session.alive:
            return False
        if route.via_data:
            if self.datachan is None or not session.data_address:
                return False
            return self.datachan.send(session, parts, route.owner)
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
            self.linker.drop(session, f"send failed: {exc}")
            return False

    # ---- the loop -----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self.closing:
                self._contained(self._iterate, "loop")
        except BaseException as exc:  # not a bug in one step: the thread cannot go on
            self.fatal = f"{type(exc).__name__}: {exc}"
            log.critical("engine %s: I/O thread died: %s", self.engine_id, self.fatal)
        finally:
            self.closing = True
            self._contained(self._shutdown, "shutdown")

    def _contained(self, fn: Callable[[], None], what: str) -> None:
        """Run one step; an exception there is a bug: log and count it, the thread goes on."""
        try:
            fn()
        except Exception:
            self.metrics.internal_errors_total += 1
            log.exception("engine %s: %s failed (contained)", self.engine_id, what)

    def _iterate(self) -> None:
        hint = self.sender.wait_hint()
        wait = 0.05 if hint is None else hint
        if self._timers:
            wait = min(wait, self._timers[0][0] - time.monotonic())
        timeout_ms = max(0, math.ceil(wait * 1e3))
        for sock, events in self.poller.poll(timeout_ms):
            if sock == self._wake_r:
                while True:
                    try:
                        if not os.read(self._wake_r, 4096):
                            break
                    except BlockingIOError:
                        break
            elif sock is self.router:
                self._drain(self.router, inbound=True)
            elif isinstance(sock, int):
                if self.datachan is not None and self.datachan.owns(sock):
                    try:
                        self.datachan.on_event(sock, events)
                    except Exception:  # never let one connection kill the I/O thread
                        log.exception("engine %s: data channel event failed", self.engine_id)
                        self.metrics.reject("internal_error")
                        self.datachan.close_fd(sock)
            else:
                self._drain(sock, inbound=False)
        while self.commands:
            self._contained(self.commands.popleft(), "command")
        now = time.monotonic()
        while self._timers and self._timers[0][0] <= now:
            self._contained(heapq.heappop(self._timers)[2], "timer")
        self._contained(self.sender.pump, "sending")
        self._contained(lambda: self.receiver.tick(time.monotonic()), "receiver deadlines")
        self._contained(lambda: self.pulls.tick(time.monotonic()), "offer leases")
        if self.datachan is not None:
            datachan = self.datachan
            self._contained(lambda: datachan.tick(time.monotonic()), "data channel")
        self._contained(self.flush_faults, "faults")

    def _drain(self, sock: zmq.Socket[bytes], inbound: bool) -> None:
        for _ in range(256):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            except zmq.ZMQError:
                return
            if inbound:
                identity, parts = frames[0].bytes, frames[1:]
                self.dispatch(parts, identity=identity)
                del parts
            else:
                link = self.links.get(sock)
                if link is not None:
                    self.dispatch(frames, link=link)
            # drop the payload now, not at the next receive: ZMQ then reuses one buffer
            del frames

    def dispatch(
        self, parts: list[zmq.Frame], identity: bytes | None = None, link: Link | None = None
    ) -> None:
        """Validate one incoming message and route it; bad frames are counted, not raised."""
        if not parts or len(parts) > 2:
            self.metrics.reject("bad_parts")
            return
        try:
            msg_type, h = wire.decode(parts[0].buffer, len(parts))
        except wire.FrameError as exc:
            self.metrics.reject(exc.reason)
            return
        if len(parts) == 2 and len(parts[1]) > self.config.max_frame_bytes:
            self.metrics.reject("oversized")
            return
        if msg_type in wire.HANDSHAKE:
            try:
                peer_ip = _peer_ip(parts[0]) if msg_type == "auth" else ""
                self.linker.on_handshake(msg_type, h, identity, link, peer_ip)
            except wire.FrameError as exc:
                self.metrics.reject(exc.reason)
            except Exception:  # never let one frame kill the I/O thread
                self.metrics.internal_errors_total += 1
                log.exception("engine %s: handshake %s failed", self.engine_id, msg_type)
                self.metrics.reject("internal_error")
            return
        session = self.in_by_identity.get(identity) if identity is not None else None
        if link is not None:
            session = link.session
            if session is None and msg_type == "error":
                self.linker.on_link_error(link, h)
                return
            if (
                session is not None
                and msg_type == "error"
                and not h["x"]
                and h["sid"] != session.token
            ):
                # the engine at our link's address does not know our session (it restarted):
                # all this can make us do is link again, so it needs no token
                self.linker.on_session_error(session, h)
                return
        if session is None or not session.alive or h["sid"] != session.token:
            self.metrics.reject("unauthenticated")
            if identity is not None and msg_type != "error":
                hdr = wire.encode(
                    "error",
                    x="",
                    code=StatusCode.NOT_LINKED.number,
                    msg="not linked: link (authenticate) first",
                )
                with contextlib.suppress(zmq.ZMQError):
                    self.router.send_multipart([identity, hdr], zmq.NOBLOCK)
            return
        payload = parts[1].buffer if len(parts) == 2 else None
        try:
            self._route(msg_type, h, session, payload)
        except wire.FrameError as exc:
            self.metrics.reject(exc.reason)
        except Exception:  # never let one frame kill the I/O thread
            log.exception(
                "engine %s: handling %s from %s failed", self.engine_id, msg_type, session.peer_id
            )
            self.metrics.internal_errors_total += 1
            self.metrics.reject("internal_error")

    def _route(
        self, msg_type: str, h: dict[str, Any], session: Session, payload: memoryview | None
    ) -> None:
        if msg_type == "begin":
            self.receiver.on_begin(session, h)
        elif msg_type == "data":
            assert payload is not None
            self.receiver.on_data(session, h, payload)
        elif msg_type == "end":
            self.receiver.on_end(session, h)
        elif msg_type == "pull":
            self.pulls.serve(session, h)
        elif msg_type in ("grant", "ack"):
            self.sender.on_reply(session, msg_type, h)
        elif msg_type == "error":
            if not h["x"]:
                self.linker.on_session_error(session, h)
            elif not self.receiver.on_error(h):
                self.sender.on_reply(session, msg_type, h)
        elif msg_type == "regions":
            session.regions = self.linker.parse_regions(h["regions"])
        elif msg_type == "ping":
            pass  # proves the session is known; an unknown one is answered NOT_LINKED
        elif msg_type == "renew":
            self._on_renew(session, h)
        elif msg_type == "bye":
            self.linker.drop(session, "peer said bye")

    def _on_data_unusable(self, session: Session) -> None:
        self.sender.on_data_unusable(session)

    def ping(self, session: Session) -> None:
        """Probe a session on its link: a restarted peer answers NOT_LINKED (we re-link), a
        dead one makes the send fail (we drop the session)."""
        if session.alive:
            self.send(session, "ping", wire.encode("ping", session.token))

    def _on_renew(self, session: Session, h: dict[str, Any]) -> None:
        """A peer keeps our reservation (it writes) or our offer (it reads) alive."""
        now, rid, epoch, peer = time.monotonic(), h["rid"], h["ep"], session.peer_id
        try:
            if not self.ledger.renew(rid, now, epoch=epoch, writer=peer):
                self.pulls.renew(rid, now, epoch=epoch, reader=peer)
        except TransferError:
            self.metrics.reject("not_granted")

    def _shutdown(self) -> None:
        why = f": its I/O thread died ({self.fatal})" if self.fatal else ""
        closed = TransferError(StatusCode.ENGINE_CLOSED, f"engine {self.engine_id} closed{why}")
        self.sender.abort_all(closed)
        self.receiver.abort_all(closed)
        self.pulls.abort_all(closed)
        for session in list(self.out_sessions.values()) + list(self.in_sessions.values()):
            if session.alive:
                self.send(session, "bye", wire.encode("bye", session.token))
        if self.datachan is not None:
            self.datachan.shutdown()
        for sock in list(self.links):
            sock.close(0)
        self.links.clear()
        self.router.close(0)
        os.close(self._wake_r)
        os.close(self._wake_w)
        self.hasher.close()
