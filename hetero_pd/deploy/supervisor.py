"""Supervision of a local deployment's worker processes: restart with backoff.

    worker exits ──> router takes it out of rotation (mark_dead)
                 ──> wait backoff_s · 2^n (capped at backoff_max_s)
                 ──> respawn: a new process, READY, router.add_worker() replaces the client
                 ──> back in rotation
    more than max_restarts exits within window_s: it stays down (and /health says so)
    a planned exit (`expect_exit`: a drained worker restarted on purpose)
                 ──> respawn at once, outside the restart budget
    a removal (`expect_removal`: scale-down of a drained worker) ──> stays down: "removed"
    worker alive but silent (no heartbeat for hang_timeout_s: SIGSTOPped, deadlocked)
                 ──> SIGKILL, then the same restart path


Each worker has its own task waiting on its process, so nothing polls. The state of every
worker (pid, restarts, running / restarting / down) is kept in `states` for /health.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from hetero_pd.deploy.sections import SupervisorSpec

log = logging.getLogger("hetero_pd.supervisor")


@dataclass(slots=True)
class RestartPolicy:
    """When (and whether) a worker that exited is restarted."""

    spec: SupervisorSpec
    history: dict[str, list[float]] = field(default_factory=dict)

    def delay(self, worker_id: str, now: float) -> float | None:
        """Seconds to wait before restarting `worker_id`, or None to leave it down."""
        if not self.spec.restart:
            return None
        recent = [t for t in self.history.get(worker_id, []) if now - t < self.spec.window_s]
        self.history[worker_id] = recent
        if len(recent) >= self.spec.max_restarts:
            return None
        return min(self.spec.backoff_s * 2 ** len(recent), self.spec.backoff_max_s)

    def record(self, worker_id: str, now: float) -> None:
        """Notes a restart of `worker_id` at `now`."""
        self.history.setdefault(worker_id, []).append(now)


class Processes(Protocol):
    """What the supervisor needs from a launcher."""

    def pid(self, worker_id: str) -> int | None: ...

    async def wait(self, worker_id: str) -> int: ...

    async def respawn(self, worker_id: str) -> None: ...


class Router(Protocol):
    def mark_dead(self, worker_id: str) -> None: ...

    def silent_for(self, worker_id: str) -> float | None: ...


class Supervisor:
    """Restarts crashed workers of `procs` per `spec`; `stop()` before stopping them."""

    def __init__(
        self,
        procs: Processes,
        router: Router,
        spec: SupervisorSpec,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.procs, self.router, self.clock = procs, router, clock
        self.policy = RestartPolicy(spec)
        self.states: dict[str, dict[str, Any]] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._stopping = False
        self._planned: set[str] = set()
        self._removing: set[str] = set()

    def expect_exit(self, worker_id: str) -> None:
        """`worker_id` is about to exit on purpose (drained, to restart): respawn it at once,
        without backoff and without spending its restart budget."""
        self._planned.add(worker_id)

    def expect_removal(self, worker_id: str) -> None:
        """`worker_id` is about to exit for good (scale-down): do not restart it."""
        self._removing.add(worker_id)

    def watch(self, worker_ids: list[str]) -> None:
        """Starts supervising these (running) workers."""
        for worker_id in worker_ids:
            self.states[worker_id] = {
                "state": "running",
                "restarts": 0,
                "pid": self.procs.pid(worker_id),
            }
            self._tasks[worker_id] = asyncio.create_task(self._supervise(worker_id))
        self._tasks["<hangs>"] = asyncio.create_task(self._watch_hangs())

    async def _watch_hangs(self) -> None:
        """Kills a running worker that stopped talking (it then restarts as if it crashed):
        a stopped or deadlocked process would otherwise hold its slot forever."""
        limit = self.policy.spec.hang_timeout_s
        while True:
            await asyncio.sleep(limit / 4)
            for worker_id, state in self.states.items():
                silent = self.router.silent_for(worker_id)
                pid = self.procs.pid(worker_id)
                if state["state"] != "running" or silent is None or silent < limit or not pid:
                    continue
                log.error(
                    "worker %s (pid %s) silent for %.1f s; killing it", worker_id, pid, silent
                )
                state["state"] = "hung"
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    async def _supervise(self, worker_id: str) -> None:
        state = self.states[worker_id]
        while True:
            code = await self.procs.wait(worker_id)
            if self._stopping:
                return
            self.router.mark_dead(worker_id)
            if worker_id in self._removing:
                state["state"] = "removed"
                log.info("worker %s removed (code %s)", worker_id, code)
                return
            planned = worker_id in self._planned
            self._planned.discard(worker_id)
            delay = 0.0 if planned else self.policy.delay(worker_id, self.clock())
            if delay is None:
                state["state"] = "down"
                log.error("worker %s exited (code %s); not restarting it", worker_id, code)
                return
            state["state"] = f"restarting (exit code {code})"
            log.warning("worker %s exited (code %s); restarting in %.1f s", worker_id, code, delay)
            await asyncio.sleep(delay)
            if not planned:
                self.policy.record(worker_id, self.clock())
            state["restarts"] += 1
            try:
                await self.procs.respawn(worker_id)
            except (RuntimeError, TimeoutError, OSError) as e:
                log.error("worker %s failed to restart: %s", worker_id, e)
                continue  # its process has exited: the next wait() returns at once
            state.update(state="running", pid=self.procs.pid(worker_id))
            log.info("worker %s is back (pid %s)", worker_id, state["pid"])

    async def stop(self) -> None:
        """Stop supervising (the processes are stopped by their launcher afterwards)."""
        self._stopping = True
        for task in self._tasks.values():
            task.cancel()
        for task in self._tasks.values():
            with contextlib.suppress(asyncio.CancelledError):
                await task
