"""The router's handle on one worker: an authenticated DEALER socket, heartbeats, load and
liveness."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from hetero_pd.serving.control import protocol as P
from hetero_pd.serving.control import values as V
from hetero_pd.serving.control.auth import RouterKeys, secure_client
from hetero_pd.serving.router.prefix_index import HeldBlocks

log = logging.getLogger("hetero_pd.router")


@dataclass(frozen=True, slots=True)
class WorkerGone:
    """Put in a request's queue when a worker it involves dies (not a wire message)."""

    worker: str


class WorkerUnreachable(Exception):
    """A worker's control socket takes no more frames: it is not reading."""


class WorkerClient:
    """Messages for a request go to `on_message(client, msg)`; heartbeats update `load`.

    A worker is alive while heartbeats keep coming within `heartbeat_timeout_s`; once it
    misses them (or says bye) it is marked dead, `on_dead(client)` runs and it stays out of
    rotation until it is heard from again (a new hello is sent while it is silent)."""

    def __init__(
        self,
        worker_id: str,
        address: str,
        ctx: zmq.asyncio.Context,
        keys: RouterKeys,
        on_message: Callable[[WorkerClient, Any], None],
        on_dead: Callable[[WorkerClient], None],
        heartbeat_timeout_s: float = 3.0,
    ) -> None:
        self.worker_id = worker_id
        self.address = address
        self.on_message = on_message
        self.on_dead = on_dead
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.keys = keys
        self.sock: Any = ctx.socket(zmq.DEALER)
        secure_client(self.sock, keys, worker_id)
        self.sock.setsockopt(zmq.SNDHWM, 100_000)
        self.sock.connect(address)
        self.codec = P.router_codec()
        self.encoder = msgspec.msgpack.Encoder()
        self.role = "unknown"
        self.info = V.WorkerInfo()
        self.load = V.WorkerLoad()
        self.last_seen = 0.0
        self.alive = False
        self.dead_at = 0.0
        self.gone = False  # its process exited or it said bye: back only after a new hello
        self.invalid_frames = 0
        #: The router's requests here -> for those that decode here, the count of
        #: `prompt_tokens_given` at which the prompts computed beside them have stalled them
        #: as much as their output absorbs (policy.Chooser.stall_until); None for the others
        #: (a prompt to prefill, an embedding).
        self.inflight: dict[str, int | None] = {}
        #: Prompt tokens the router gave this worker to compute beside what it decodes, total.
        self.prompt_tokens_given = 0
        #: Prompt tokens the router sent here to compute and has not seen done yet.
        self.pending_tokens = 0
        #: The prefix blocks its KV cache holds, as far as the router knows.
        self.held = HeldBlocks()
        self._ready = asyncio.Event()
        self._integrity: asyncio.Queue[P.Integrity] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self, timeout_s: float = 60.0) -> None:
        """Says hello and waits for `ready`."""
        self._tasks = [
            asyncio.create_task(self._reader()),
            asyncio.create_task(self._watchdog()),
        ]
        self.send(P.Hello())
        try:
            await asyncio.wait_for(self._ready.wait(), timeout_s)
        except TimeoutError:
            raise TimeoutError(
                f"worker {self.worker_id} at {self.address} did not answer within {timeout_s}s"
            ) from None

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.sock.close()

    async def switch_role(self, role: str, timeout_s: float) -> None:
        """Asks the worker to drain and serve as `role`; returns once it says `ready` again."""
        self._ready.clear()
        self.send(P.SwitchRole(role=role))  # type: ignore[arg-type]
        try:
            await asyncio.wait_for(self._ready.wait(), timeout_s)
        except TimeoutError:
            message = f"worker {self.worker_id} did not switch to {role} within {timeout_s}s"
            raise TimeoutError(message) from None
        finally:
            self._ready.set()  # never leave a later start() waiting on this switch
        if self.role != role:
            raise RuntimeError(f"worker {self.worker_id} answered as {self.role}, not {role}")

    def send(self, msg: msgspec.Struct) -> None:
        """Sends `msg`, after the keys the worker's transfer engine needs for the peers it
        names (PeerKeys; see `P.named_peers`). Raises WorkerUnreachable when the worker's
        pipe is full (it is not reading)."""
        peers = [p for p in P.named_peers(msg) if p != self.worker_id]
        try:
            if peers:
                keys = [P.PeerKey(peer=p, key=self.keys.link_key(self.worker_id, p)) for p in peers]
                self.sock.send(self.encoder.encode(P.PeerKeys(keys=keys)), zmq.NOBLOCK)
            self.sock.send(self.encoder.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            raise WorkerUnreachable(
                f"worker {self.worker_id} is not reading its control socket"
            ) from None

    def try_send(self, msg: msgspec.Struct) -> None:
        """`send` for messages whose loss only delays cleanup (aborts): logged, not raised."""
        try:
            self.send(msg)
        except WorkerUnreachable as e:
            log.warning("%s; %s dropped", e, type(msg).__name__)

    async def check_integrity(self, timeout_s: float = 10.0) -> P.Integrity:
        """Asks the worker to verify its block pool (tests and /health?deep use it)."""
        self.send(P.Check())
        return await asyncio.wait_for(self._integrity.get(), timeout_s)

    async def flush(self, timeout_s: float) -> bool:
        """Waits until the worker has read everything sent to it so far (a round trip),
        at most `timeout_s`; False (logged) if it did not answer in time."""
        try:
            await self.check_integrity(timeout_s)
            return True
        except (TimeoutError, WorkerUnreachable) as e:
            log.warning(
                "worker %s did not confirm the router's last messages: %s", self.worker_id, e
            )
            return False

    @property
    def start_layer(self) -> int:
        return self.info.start_layer

    @property
    def backlog_tokens(self) -> int:
        """Prompt tokens queued here: the router's count or the last heartbeat's, the larger."""
        return max(self.pending_tokens, self.load.waiting_tokens)

    @property
    def load_score(self) -> float:
        """Work queued on the worker, in tokens, plus what the router has in flight there."""
        return self.load.waiting_tokens + 16.0 * self.load.running + 64.0 * len(self.inflight)

    async def _reader(self) -> None:
        while True:
            frame = await self.sock.recv(copy=False)
            try:
                msg = self.codec.decode(frame.buffer)
            except V.MessageError as e:
                self.invalid_frames += 1
                log.warning("worker %s: bad frame: %s", self.worker_id, e)
                continue
            self.last_seen = time.monotonic()
            match msg:
                case P.Heartbeat(load=load, cached=cached):
                    stopping = load.draining and not self.load.draining
                    self.load = load
                    if cached is not None:
                        self.held.report(cached)
                    self.alive = self.usable
                    if stopping:  # it started draining: the router moves its requests
                        self.on_message(self, msg)
                case P.Ready(role=role, info=info):
                    self.role, self.info = role, info
                    self.held.clear()  # a restarted worker's cache is empty
                    self.alive, self.gone = True, False
                    self._ready.set()
                case P.Integrity():
                    self._integrity.put_nowait(msg)
                case P.Bye():
                    self.mark_gone("said bye")
                case _:
                    self.on_message(self, msg)

    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_timeout_s / 4)
            silent = time.monotonic() - self.last_seen
            if self.alive and silent > self.heartbeat_timeout_s:
                self._mark_dead(f"no heartbeat for {silent:.1f}s")
            elif self._came_back(silent):
                log.info("worker %s is back", self.worker_id)
                self.alive = True
            elif not self.alive and self._ready.is_set() and silent > self.heartbeat_timeout_s:
                # Marked down: greet it again now and then; a restarted process at the same
                # address answers with Ready and is back in rotation.
                with contextlib.suppress(WorkerUnreachable):
                    self.send(P.Hello())

    def _came_back(self, silent: float) -> bool:
        # Only a message heard after it was marked dead brings it back.
        recent = silent < self.heartbeat_timeout_s and self.last_seen > self.dead_at
        return not self.alive and self._ready.is_set() and self.usable and recent

    @property
    def usable(self) -> bool:
        """Not gone, not draining, and its transfer engine works (a worker whose transfer
        engine died can neither send nor receive KV: no request is routed to it)."""
        return not self.gone and not self.load.draining and self.load.transfer_healthy

    def mark_gone(self, why: str) -> None:
        """The worker will not answer again (its process exited, or it said bye)."""
        self.gone = True
        self._mark_dead(why)

    def _mark_dead(self, why: str) -> None:
        if self.alive or self.inflight:
            log.warning("worker %s out of rotation: %s", self.worker_id, why)
        self.alive = False
        self.dead_at = time.monotonic()
        self.held.clear()
        self.on_dead(self)
