"""Delayed engine steps: a fault injection that stands in for a slower device (tests and
drills only; the "step" rules of the deployment's `transfer.faults`, transfer/faults.py).

A delayed step starts `delay_s` after the previous step started, at the earliest: each step
then takes `delay_s` at least, as on a device that much slower (a step that took longer
itself waits no more). Meanwhile the worker loop blocks in its control socket's poll, so it
answers messages and progresses transfers as quickly as ever and spends no CPU on the wait.
The rules count steps as they do frames (`nth`, `count`): which steps are delayed is fixed
by their order, not by a clock.
"""

from __future__ import annotations

import math

from transfer import FaultPlan
from transfer.faults import STEP, FaultInjector


class StepFaults:
    """When the worker's next engine step may run, under `plan` (None: at once, always)."""

    def __init__(self, plan: FaultPlan | None) -> None:
        self.injector: FaultInjector | None = FaultInjector(plan) if plan else None
        #: When the next step may start (monotonic seconds), once it was counted.
        self._due: float | None = None
        self._last_start: float = -math.inf

    def wait_s(self, now: float) -> float:
        """Seconds until the next step may run (0: now). The first call after a step counts
        the next one against the rules."""
        if self.injector is None:
            return 0.0
        if self._due is None:
            rule = self.injector.match(STEP)
            self._due = self._last_start + rule.delay_s if rule is not None else now
        return max(0.0, self._due - now)

    def wait_ms(self, now: float) -> int:
        """`wait_s` rounded up to whole milliseconds (a poll timeout)."""
        return math.ceil(self.wait_s(now) * 1000)

    def stepped(self, started: float) -> None:
        """A step ran from `started` on: the next one is counted when it is asked about."""
        self._due, self._last_start = None, started
