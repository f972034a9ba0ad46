"""The router's handle on one worker: a ZMQ DEALER socket, heartbeats, load and liveness."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from hetero_pd.serving import messages as M

log = logging.getLogger("hetero_pd.router")


class WorkerClient:
    """Messages for a request go to `on_message(client, msg)`; heartbeats update `load`.

    A worker is alive while heartbeats keep coming within `heartbeat_timeout_s`; once it
    misses them (or says bye) it is marked dead, `on_dead(client)` runs and it stays out of
    rotation until it answers a new hello."""

    def __init__(
        self,
        worker_id: str,
        address: str,
        ctx: zmq.asyncio.Context,
        on_message: Callable[[WorkerClient, dict[str, Any]], None],
        on_dead: Callable[[WorkerClient], None],
        heartbeat_timeout_s: float = 3.0,
    ) -> None:
        self.id = worker_id
        self.address = address
        self.on_message = on_message
        self.on_dead = on_dead
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.sock: Any = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.role = "unknown"
        self.info: dict[str, Any] = {}
        self.load: dict[str, Any] = {}
        self.last_seen = 0.0
        self.alive = False
        self.dead_at = 0.0
        self.gone = False  # its process exited or it said bye: back only after a new hello
        self.inflight: set[str] = set()
        self._ready = asyncio.Event()
        self._integrity: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self, timeout_s: float = 60.0) -> None:
        """Says hello and waits for `ready`."""
        self._tasks = [
            asyncio.create_task(self._reader()),
            asyncio.create_task(self._watchdog()),
        ]
        self.send("hello")
        try:
            await asyncio.wait_for(self._ready.wait(), timeout_s)
        except TimeoutError:
            raise TimeoutError(
                f"worker {self.id} at {self.address} did not answer within {timeout_s}s"
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
        self.send("switch_role", role=role)
        try:
            await asyncio.wait_for(self._ready.wait(), timeout_s)
        except TimeoutError:
            message = f"worker {self.id} did not switch to {role} within {timeout_s}s"
            raise TimeoutError(message) from None
        finally:
            self._ready.set()  # never leave a later start() waiting on this switch
        if self.role != role:
            raise RuntimeError(f"worker {self.id} answered as {self.role}, not {role}")

    def send(self, msg_type: str, **fields: Any) -> None:
        try:
            self.sock.send(M.encode(msg_type, **fields), zmq.NOBLOCK)
        except zmq.Again:
            log.warning("worker %s: send queue full, %s dropped", self.id, msg_type)

    async def check_integrity(self, timeout_s: float = 10.0) -> dict[str, Any]:
        """Asks the worker to verify its block pool (tests and /health?deep use it)."""
        self.send("check")
        return await asyncio.wait_for(self._integrity.get(), timeout_s)

    @property
    def load_score(self) -> float:
        """Work queued on the worker, in tokens, plus what the router has in flight there."""
        load = self.load
        return (
            float(load.get("waiting_tokens", 0))
            + 16.0 * float(load.get("running", 0))
            + 64.0 * len(self.inflight)
        )

    async def _reader(self) -> None:
        while True:
            frame = await self.sock.recv()
            try:
                msg = M.decode(frame)
            except M.MessageError as e:
                log.warning("worker %s: bad frame: %s", self.id, e)
                continue
            self.last_seen = time.monotonic()
            kind = msg["t"]
            if kind == "heartbeat":
                self.load = msg["load"]
                self.alive = not msg["load"].get("draining", False) and not self.gone
            elif kind == "ready":
                self.role, self.info = msg["role"], msg["info"]
                self.alive, self.gone = True, False
                self._ready.set()
            elif kind == "integrity":
                self._integrity.put_nowait(msg)
            elif kind == "bye":
                self.mark_gone("said bye")
            else:
                self.on_message(self, msg)

    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_timeout_s / 4)
            silent = time.monotonic() - self.last_seen
            if self.alive and silent > self.heartbeat_timeout_s:
                self._mark_dead(f"no heartbeat for {silent:.1f}s")
            elif self._came_back(silent):
                log.info("worker %s is back", self.id)
                self.alive = True

    def _came_back(self, silent: float) -> bool:
        # Only a message heard after it was marked dead brings it back.
        recent = silent < self.heartbeat_timeout_s and self.last_seen > self.dead_at
        draining = bool(self.load.get("draining", False))
        usable = self._ready.is_set() and not self.gone and not draining
        return not self.alive and usable and recent

    def mark_gone(self, why: str) -> None:
        """The worker will not answer again (its process exited, or it said bye)."""
        self.gone = True
        self._mark_dead(why)

    def _mark_dead(self, why: str) -> None:
        if self.alive or self.inflight:
            log.warning("worker %s out of rotation: %s", self.id, why)
        self.alive = False
        self.dead_at = time.monotonic()
        self.on_dead(self)
