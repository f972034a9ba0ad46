"""Asynchronous transfer handles and their state machine.

::

                 ┌──────────── cancel() ─────────────┐
                 │                                   v
    PENDING ──> IN_FLIGHT ──(ACK ok)──────────> DONE          terminal states
       │            │ ╲──(non-recoverable/attempts)─> FAILED     never change
       │            │  ╲─(deadline / lease)────────> TIMED_OUT
       └────────────┴──── cancel() / release() ────> CANCELLED
                    ↻ recoverable error: backoff, re-link, resend (same transfer id)

A handle is completed by the engine's I/O thread. ``wait``/``done`` work from any thread;
callbacks run in whichever thread calls :meth:`TransferEngine.progress` (so a synchronous
worker loop keeps a single thread), and ``await handle.wait_async()`` suits asyncio loops.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from transfer.errors import StatusCode, TransferError
from transfer.messages import RemoteBlocks

log = logging.getLogger(__name__)


class TransferState(enum.Enum):
    """Where a transfer is in its life."""

    PENDING = "pending"
    IN_FLIGHT = "in_flight"
    DONE = "done"
    FAILED = "failed"
    TIMED_OUT = "timed_out"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        """True once the state can no longer change."""
        return self not in (TransferState.PENDING, TransferState.IN_FLIGHT)


Callback = Callable[["TransferHandle"], None]


@dataclass(slots=True, eq=False)
class TransferHandle:
    """A push, a pull, or a reservation waiting for pushes (``kind`` says which).

    ``released`` (push only) tells why the sender's hold on its source blocks ended:
    ``"ack"`` (the receiver verified the data), ``"lease"`` (the lease expired first),
    ``"error"`` (the transfer failed before any data could still be read) or ``"cancel"``.
    The source blocks may be freed once the handle is terminal.
    """

    transfer_id: str
    kind: str
    peer: str
    request_id: str
    nbytes: int = 0
    blocks: RemoteBlocks | None = None
    state: TransferState = TransferState.PENDING
    error: TransferError | None = None
    released: str | None = None
    attempts: int = 0
    created: float = field(default_factory=time.monotonic)
    finished: float | None = None
    _event: threading.Event = field(default_factory=threading.Event, repr=False)
    _callbacks: list[Callback] = field(default_factory=list, repr=False)
    _waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = field(
        default_factory=list, repr=False
    )
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _cancel: Callable[[TransferHandle], object] | None = field(default=None, repr=False)

    @property
    def epoch(self) -> int:
        """Epoch of a reservation handle (0 for pushes and pulls)."""
        return self.blocks.epoch if self.blocks is not None else 0

    def done(self) -> bool:
        """True once the handle reached a terminal state."""
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> TransferState:
        """Block until terminal or ``timeout`` seconds; return the current state."""
        self._event.wait(timeout)
        return self.state

    def result(self, timeout: float | None = None) -> None:
        """Wait, then raise :class:`TransferError` unless the transfer is DONE."""
        if not self._event.wait(timeout):
            raise TransferError(StatusCode.TIMEOUT, f"{self.transfer_id}: still {self.state.value}")
        if self.state is not TransferState.DONE:
            assert self.error is not None
            raise self.error

    async def wait_async(self) -> TransferState:
        """Await completion from an asyncio event loop."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        with self._lock:
            if not self._event.is_set():
                self._waiters.append((loop, fut))
                fut_pending = True
            else:
                fut_pending = False
        if fut_pending:
            await fut
        return self.state

    def add_done_callback(self, fn: Callback) -> None:
        """Run ``fn(handle)`` from :meth:`TransferEngine.progress` once terminal."""
        self._callbacks.append(fn)

    def cancel(self) -> None:
        """Stop the transfer (a no-op once terminal)."""
        if self._cancel is not None and not self.done():
            self._cancel(self)

    def cancel_with(self, cancel: Callable[[TransferHandle], object]) -> None:
        """What `cancel()` does for this handle (set by the engine that made it)."""
        self._cancel = cancel

    @property
    def latency_s(self) -> float | None:
        """Seconds from creation to completion (None while running)."""
        return None if self.finished is None else self.finished - self.created

    def _finish(
        self, state: TransferState, error: TransferError | None = None, released: str | None = None
    ) -> bool:
        """Move to a terminal state (engine side). Returns False if already terminal."""
        with self._lock:
            if self._event.is_set():
                return False
            self.state, self.error, self.finished = state, error, time.monotonic()
            if released is not None:
                self.released = released
            self._event.set()
            waiters, self._waiters = self._waiters, []
        for loop, fut in waiters:
            loop.call_soon_threadsafe(_resolve, fut)
        return True

    def _run_callbacks(self) -> int:
        """Runs the callbacks, each contained (a caller's bug must not end the caller's
        loop nor skip the other callbacks); returns how many raised."""
        callbacks, self._callbacks = self._callbacks, []
        failed = 0
        for fn in callbacks:
            try:
                fn(self)
            except Exception:
                failed += 1
                log.exception(
                    "transfer %s %s: a done callback raised (contained)", self.kind, self.request_id
                )
        return failed


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
