"""The engine's I/O thread: one poller, a command queue, timers, and containment.

Callers talk to the thread through :meth:`IOLoop.call` (woken by a pipe); everything else
registers with it: sockets and file descriptors with a handler for their events, and
per-iteration steps (pumping bytes, checking deadlines). Every command, timer, handler and
step runs *contained*: an exception there is a bug in that one step; it is logged and
counted and the thread goes on. Only a fatal ``BaseException`` ends the thread; then
:attr:`IOLoop.fatal` says why and the shutdown hook fails every handle::

    while not closing:
        poll(sockets, timeout = next timer / busy hint)  -> handlers
        commands (from callers)                           -> contained
        due timers                                        -> contained
        steps (send, deadlines, leases, ...)              -> contained
"""

from __future__ import annotations

import concurrent.futures
import heapq
import itertools
import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

import zmq

from transfer.errors import StatusCode, TransferError
from transfer.handle import TransferHandle, TransferState
from transfer.metrics import Metrics

T = TypeVar("T")
log = logging.getLogger(__name__)
#: Longest poll when nothing is due (seconds).
IDLE_WAIT_S = 0.05
Watched = zmq.Socket[bytes] | int


class IOLoop:
    """The I/O thread of one engine and what runs on it."""

    def __init__(self, name: str, metrics: Metrics) -> None:
        self.name, self.metrics = name, metrics
        self.poller = zmq.Poller()
        self._handlers: dict[Any, Callable[[int], None]] = {}
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self.poller.register(self._wake_r, zmq.POLLIN)
        self._commands: deque[Callable[[], None]] = deque()
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._tick = itertools.count()
        self._steps: list[tuple[Callable[[], None], str]] = []
        #: Handles completed and not yet returned by ``TransferEngine.progress()``.
        self.completed: deque[TransferHandle] = deque()
        self.busy_hint: Callable[[], float | None] = lambda: None
        self.on_shutdown: Callable[[TransferError], None] = lambda err: None
        self.closing = False
        #: Why the thread died (None while it runs or after a normal close).
        self.fatal: str | None = None
        self.thread = threading.Thread(target=self._run, name=f"transfer-{name}", daemon=True)

    # ---- from any thread ----------------------------------------------------------------
    def check_open(self) -> None:
        """Raise ENGINE_CLOSED (naming why the thread died, if it did) once closed."""
        if self.closing:
            why = f": its I/O thread died ({self.fatal})" if self.fatal else ""
            raise TransferError(StatusCode.ENGINE_CLOSED, f"engine {self.name} is closed{why}")

    def call(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the I/O thread soon."""
        self.check_open()
        self._commands.append(fn)
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass  # the pipe is full of wake-ups already
        except OSError as exc:  # the loop ended and closed the pipe meanwhile
            if fn not in self._commands:
                return  # it ran ``fn`` before ending (e.g. the close command itself)
            raise TransferError(StatusCode.ENGINE_CLOSED, f"engine {self.name}") from exc

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

    def finish(
        self,
        handle: TransferHandle,
        state: TransferState,
        error: TransferError | None = None,
        released: str | None = None,
    ) -> None:
        """Complete a handle and queue it for ``progress()`` (before waiters wake, so
        ``progress()`` after ``wait()`` always returns it)."""
        if not handle.done():
            self.completed.append(handle)
            handle._finish(state, error, released)

    # ---- on the I/O thread --------------------------------------------------------------
    def at(self, delay: float, fn: Callable[[], None]) -> None:
        """Run ``fn`` after ``delay`` seconds."""
        heapq.heappush(self._timers, (time.monotonic() + delay, next(self._tick), fn))

    def watch(self, target: Watched, flags: int, handler: Callable[[int], None]) -> None:
        """Poll ``target`` (a ZMQ socket or a file descriptor) for ``flags``; ``handler``
        gets the events. Calling it again changes the flags."""
        self.poller.register(target, flags)
        self._handlers[target] = handler

    def unwatch(self, target: Watched) -> None:
        """Stop polling ``target``."""
        if self._handlers.pop(target, None) is not None:
            self.poller.unregister(target)

    def every_iteration(self, step: Callable[[], None], what: str) -> None:
        """Run ``step`` once per loop iteration (contained; ``what`` names it in logs)."""
        self._steps.append((step, what))

    def contained(self, fn: Callable[[], None], what: str) -> None:
        """Run one step; an exception there is a bug: log and count it, the thread goes on."""
        try:
            fn()
        except Exception:
            self.metrics.internal_errors_total += 1
            log.exception("engine %s: %s failed (contained)", self.name, what)

    def start(self) -> None:
        """Start the thread (once everything is registered)."""
        self.thread.start()

    def _run(self) -> None:
        try:
            while not self.closing:
                self.contained(self._iterate, "loop")
        except BaseException as exc:  # not a bug in one step: the thread cannot go on
            self.fatal = f"{type(exc).__name__}: {exc}"
            log.critical("engine %s: I/O thread died: %s", self.name, self.fatal)
        finally:
            self.closing = True
            why = f": its I/O thread died ({self.fatal})" if self.fatal else ""
            closed = TransferError(StatusCode.ENGINE_CLOSED, f"engine {self.name} closed{why}")
            self.contained(lambda: self.on_shutdown(closed), "shutdown")
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _iterate(self) -> None:
        hint = self.busy_hint()
        wait = IDLE_WAIT_S if hint is None else hint
        if self._timers:
            wait = min(wait, self._timers[0][0] - time.monotonic())
        for target, events in self.poller.poll(max(0, math.ceil(wait * 1e3))):
            if target == self._wake_r:
                self._drain_wakeups()
                continue
            handler = self._handlers.get(target)
            if handler is not None:
                self.contained(lambda h=handler, e=events: h(e), "socket event")  # type: ignore[misc]
        while self._commands:
            self.contained(self._commands.popleft(), "command")
        now = time.monotonic()
        while self._timers and self._timers[0][0] <= now:
            self.contained(heapq.heappop(self._timers)[2], "timer")
        for step, what in self._steps:
            self.contained(step, what)

    def _drain_wakeups(self) -> None:
        while True:
            try:
                if not os.read(self._wake_r, 4096):
                    return
            except BlockingIOError:
                return
