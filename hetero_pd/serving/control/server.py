"""A worker's control endpoint: one authenticated ROUTER socket, typed frames in and out,
nothing dropped silently.

Inbound, a frame reaches the worker only if its sender passed the CurveZMQ handshake
(`auth`) and it decodes to one `protocol.ToWorker` message; everything else is
dropped and counted (`rejected`). A router is this process's only once it said hello:
until then its frames are dropped too (`ungreeted`), and it hears nothing. Outbound, the
socket is ROUTER_MANDATORY: a router that is not reading makes sends fail with EAGAIN
instead of vanishing at the high-water mark, and what could not go yet waits in a bounded
per-router queue, flushed every loop. A router that stays unreachable, or lets its queue
pass the bound, is given up (`lost()`), so the worker can end that router's requests
instead of computing them for nobody.
"""

from __future__ import annotations

import collections
import errno
import logging
from collections.abc import Iterator
from typing import Any

import msgspec
import zmq

from hetero_pd.serving.control import protocol as P
from hetero_pd.serving.control import values as V
from hetero_pd.serving.control.auth import Gatekeeper, WorkerKeys, secure_server

log = logging.getLogger("hetero_pd.worker")
#: Frames queued for one router before it is given up.
MAX_QUEUED_FRAMES = 200_000
MAX_QUEUED_BYTES = 512 * 2**20


class ControlServer:
    def __init__(self, host: str, port: int, keys: WorkerKeys) -> None:
        self.ctx: Any = zmq.Context()
        self.sock: Any = self.ctx.socket(zmq.ROUTER)
        secure_server(self.sock, keys)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.SNDHWM, 10_000)
        self.gate = Gatekeeper(self.ctx, self.sock, keys)  # before the bind: no early peer
        if port:
            self.sock.bind(f"tcp://{host}:{port}")
            self.port = port
        else:
            self.port = self.sock.bind_to_random_port(f"tcp://{host}")
        self.poller = zmq.Poller()
        for s in (self.sock, *self.gate.sockets()):
            self.poller.register(s, zmq.POLLIN)
        self.codec = P.worker_codec()
        self.encoder = msgspec.msgpack.Encoder()
        self.routers: set[bytes] = set()  # those that said hello to this process
        self.invalid = 0
        self.ungreeted = 0  # frames dropped from routers that had not said hello
        self._queues: dict[bytes, collections.deque[bytes]] = {}
        self._queued_bytes: dict[bytes, int] = {}
        self._lost: list[bytes] = []

    @property
    def rejected(self) -> int:
        """Peers refused at the handshake plus frames that were not valid messages."""
        return self.gate.rejected + self.invalid

    def poll(self, timeout_ms: int) -> bool:
        """Waits up to `timeout_ms`; serves authentication; True when frames are waiting."""
        events = dict(self.poller.poll(timeout_ms))
        if any(s in events for s in self.gate.sockets()):
            self.gate.handle()
        return self.sock in events

    def receive(self) -> Iterator[tuple[bytes, Any]]:
        """Every waiting (router identity, message); invalid frames, and frames of a router
        that has not said hello to this process, are counted and skipped."""
        while True:
            try:
                parts = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if len(parts) != 2:
                self.invalid += 1
                continue
            ident = parts[0].bytes
            try:
                msg = self.codec.decode(parts[1].buffer)
            except V.MessageError as e:
                self.invalid += 1
                log.warning("rejected a control frame: %s", e)
                continue
            if ident not in self.routers:
                if not isinstance(msg, P.Hello):
                    # Not greeted by it: a router's socket reconnects by itself to a new
                    # process at the address it knew and delivers what it queued for the
                    # old one. Taken as ours, it would hear our heartbeats and think the
                    # old worker back; its hello (answered with Ready) makes it ours.
                    self.ungreeted += 1
                    continue
                self.routers.add(ident)
            yield ident, msg

    def send(self, ident: bytes, msg: msgspec.Struct) -> None:
        """Queues `msg` for router `ident` and sends what its socket takes now."""
        if ident not in self.routers:
            return
        frame = self.encoder.encode(msg)
        queue = self._queues.setdefault(ident, collections.deque())
        queue.append(frame)
        self._queued_bytes[ident] = self._queued_bytes.get(ident, 0) + len(frame)
        if len(queue) > MAX_QUEUED_FRAMES or self._queued_bytes[ident] > MAX_QUEUED_BYTES:
            self._give_up(ident, f"{len(queue)} frames queued, it is not reading")
            return
        self._flush_one(ident)

    def broadcast(self, msg: msgspec.Struct, only_idle: bool = False) -> None:
        """`msg` to every router (with `only_idle`, only those with nothing queued)."""
        for ident in list(self.routers):
            if not (only_idle and self._queues.get(ident)):
                self.send(ident, msg)

    def flush(self) -> None:
        for ident in list(self._queues):
            self._flush_one(ident)

    def lost(self) -> list[bytes]:
        """Routers given up since the last call."""
        lost, self._lost = self._lost, []
        return lost

    def _flush_one(self, ident: bytes) -> None:
        queue = self._queues.get(ident)
        while queue:
            try:
                self.sock.send_multipart([ident, queue[0]], zmq.NOBLOCK)
            except zmq.Again:
                return  # its pipe is full: the rest waits for the next flush
            except zmq.ZMQError as e:
                if e.errno == errno.EHOSTUNREACH:
                    self._give_up(ident, "disconnected")
                    return
                raise
            self._queued_bytes[ident] -= len(queue.popleft())

    def _give_up(self, ident: bytes, why: str) -> None:
        log.error("router %r given up: %s; its requests end", ident, why)
        self.routers.discard(ident)
        self._queues.pop(ident, None)
        self._queued_bytes.pop(ident, None)
        self._lost.append(ident)

    def close(self) -> None:
        self.gate.close()
        self.sock.close()
        self.ctx.term()
