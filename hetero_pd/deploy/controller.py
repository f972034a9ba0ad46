"""Role switching: move a worker between prefill and decode when the load mix shifts.

Every `switch_interval_s` the controller reads the workers' heartbeat loads and compares
the two queues, each in the unit of the work it waits for:

    prefill pressure = prompt tokens waiting per prefill worker / max_num_batched_tokens
                       (full prefill steps queued on each P)
    decode pressure  = requests waiting to join a decode batch per decode worker
                       (waiting + waiting for remote KV)

When one side's pressure is at least `switch_imbalance` times the other's (and at least 1),
the least busy worker of the other side is drained and switched (`Router.switch_role`).
Each role keeps at least one worker, and after a switch the controller waits
`COOLDOWN_INTERVALS` intervals, so it never flaps.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from hetero_pd.deploy.sections import SupervisorSpec
from hetero_pd.serving.control import values as V

log = logging.getLogger("hetero_pd.controller")
COOLDOWN_INTERVALS = 3


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """One live worker's role and queues, as its heartbeat reported them."""

    worker_id: str
    role: str
    waiting_tokens: int = 0
    waiting: int = 0
    remote: int = 0
    running: int = 0

    @classmethod
    def of(cls, worker_id: str, role: str, load: V.WorkerLoad) -> WorkerLoad:
        """From a worker's heartbeat load."""
        return cls(worker_id, role, load.waiting_tokens, load.waiting, load.remote, load.running)


@dataclass(frozen=True, slots=True)
class Switch:
    """Move `worker_id` to `to_role`, and why."""

    worker_id: str
    to_role: str
    reason: str


def decide(loads: list[WorkerLoad], chunk_tokens: int, imbalance: float) -> Switch | None:
    """The one switch the load mix calls for, if any (see the module docstring)."""
    prefill = [w for w in loads if w.role == "prefill"]
    decode = [w for w in loads if w.role == "decode"]
    if not prefill or not decode:
        return None
    p = sum(w.waiting_tokens for w in prefill) / len(prefill) / chunk_tokens
    d = sum(w.waiting + w.remote for w in decode) / len(decode)
    if p >= 1 and p >= imbalance * d and len(decode) > 1:
        w = min(decode, key=lambda w: (w.running + w.waiting + w.remote, w.worker_id))
        why = f"prefill pressure {p:.1f} steps/worker vs decode {d:.1f} requests/worker"
        return Switch(w.worker_id, "prefill", why)
    if d >= 1 and d >= imbalance * p and len(prefill) > 1:
        w = min(prefill, key=lambda w: (w.waiting_tokens + w.running, w.worker_id))
        why = f"decode pressure {d:.1f} requests/worker vs prefill {p:.1f} steps/worker"
        return Switch(w.worker_id, "decode", why)
    return None


class RoleController:
    """Runs `decide` every interval against live loads and applies the switch it returns."""

    def __init__(
        self,
        loads: Callable[[], list[WorkerLoad]],
        switch: Callable[[str, str], Awaitable[None]],
        spec: SupervisorSpec,
        chunk_tokens: int,
    ) -> None:
        self.loads, self.switch, self.spec, self.chunk_tokens = loads, switch, spec, chunk_tokens
        self.history: list[Switch] = []
        self._cooldown = 0

    async def run(self) -> None:
        """Ticks every `switch_interval_s` until cancelled."""
        while True:
            await asyncio.sleep(self.spec.switch_interval_s)
            await self.tick()

    async def tick(self) -> Switch | None:
        """One interval: the switch made, if any."""
        if self._cooldown:
            self._cooldown -= 1
            return None
        choice = decide(self.loads(), self.chunk_tokens, self.spec.switch_imbalance)
        if choice is None:
            return None
        log.info("switching %s to %s: %s", choice.worker_id, choice.to_role, choice.reason)
        try:
            await self.switch(choice.worker_id, choice.to_role)
        except (RuntimeError, TimeoutError, ValueError) as e:
            log.warning("switching %s failed: %s", choice.worker_id, e)
            return None
        self.history.append(choice)
        self._cooldown = COOLDOWN_INTERVALS
        return choice
