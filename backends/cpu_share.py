"""Threads that fit a busy host: the engine runs as many OpenMP threads as its CPUs have room
for, measured while it runs.

An OpenMP parallel region ends at a barrier, so a step with T threads goes at the speed of
the slowest: when another process keeps one of our CPUs busy, the thread placed there gets
part of that CPU and every region waits for it (2 threads under a busy neighbour ran
3.6-8x slower than 1, docs/BENCHMARKS.md section 1). With the CPUs to ourselves, threads
that spin briefly between regions instead of sleeping go 25-35% faster (on a VM a halted
vCPU is descheduled and its wake-up is paid in steal time), so hetero-pd lets them spin
(`GOMP_SPINCOUNT`, see hetero_pd/__init__.py) and this governor drops threads whenever
something else wants the CPUs, which is also when spinning would hurt.

How: every `window_s` (checked between steps) it reads how busy our CPUs were
(/proc/stat, the CPUs we are pinned to) and how much of that was us (/proc/self/stat);
the rest is other processes. Threads = our CPUs minus the others' share, rounded, at least
1 and at most what we were given; a new count is taken only when two windows in a row
agree on it, so one noisy window changes nothing, or at once when the window was at least
twice as long and we worked through it (a long step: its window is an average already).

Workers that share a box unpinned (the launcher's default on one host) are each given every
CPU and start at their fair share (CPUs / workers): a decode worker whose prefill neighbour
has gone idle then grows into the idle core, and gives it back when the neighbour is busy.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from backends.cpu import affinity_cpus

log = logging.getLogger(__name__)

PROC_STAT = Path("/proc/stat")
PROC_SELF_STAT = Path("/proc/self/stat")
# /proc times are in USER_HZ ticks.
TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
# A window longer than this (the engine sat idle) is not used to decide.
STALE_S = 10.0
# CPUs we kept busy over a long window for it to count as one long step, not an idle gap.
BUSY_THROUGH = 0.8


def cpus_busy_ticks(stat_text: str, cpus: Iterable[int]) -> int:
    """Ticks the CPUs `cpus` spent running anything (user, nice, system, irq, softirq; not
    idle, iowait or steal, which is the hypervisor's) since boot, from /proc/stat's text."""
    wanted = {f"cpu{c}" for c in cpus}
    total = 0
    for line in stat_text.splitlines():
        fields = line.split()
        if fields and fields[0] in wanted:
            user, nice, system, _idle, _iowait, irq, softirq = (int(f) for f in fields[1:8])
            total += user + nice + system + irq + softirq
    return total


def process_ticks(self_stat_text: str) -> int:
    """utime + stime (all threads) from /proc/<pid>/stat's text. The command name (field 2)
    may hold spaces and parentheses, so fields are counted from its closing parenthesis."""
    rest = self_stat_text[self_stat_text.rindex(")") + 2 :].split()
    return int(rest[11]) + int(rest[12])  # fields 14 and 15 of the whole line


def threads_for(cpus: int, others_cpus: float, max_threads: int) -> int:
    """Threads for `cpus` CPUs of which other processes keep `others_cpus` busy."""
    return max(1, min(max_threads, int(cpus - others_cpus + 0.5)))


class ThreadGovernor:
    """Call `tick()` between steps; it sets torch's thread count when the host's load on our
    CPUs calls for another one. Readers, clock and setter are injectable for tests."""

    def __init__(
        self,
        max_threads: int,
        start_threads: int | None = None,
        cpus: Iterable[int] | None = None,
        window_s: float = 0.5,
        read_stat: Callable[[], str] = PROC_STAT.read_text,
        read_self: Callable[[], str] = PROC_SELF_STAT.read_text,
        clock: Callable[[], float] = time.monotonic,
        set_threads: Callable[[int], None] = torch.set_num_threads,
    ) -> None:
        self.max_threads = max_threads
        self.cpus = sorted(affinity_cpus() if cpus is None else cpus)
        self.window_s = window_s
        self._read_stat, self._read_self = read_stat, read_self
        self._clock, self._set = clock, set_threads
        #: The count in force (the caller set it: ``start_threads``, else ``max_threads``).
        self.threads = min(max_threads, start_threads or max_threads)
        self.others_cpus = 0.0  # other processes' load on our CPUs, last window
        self._proposal: int | None = None
        self._last = self._sample()

    def _sample(self) -> tuple[float, int, int] | None:
        try:
            busy = cpus_busy_ticks(self._read_stat(), self.cpus)
            ours = process_ticks(self._read_self())
        except (OSError, ValueError, IndexError):
            return None  # no /proc (or an odd one): keep the threads we have
        return self._clock(), busy, ours

    def tick(self) -> int:
        """Measures once a window has passed; returns the thread count in force."""
        now = self._clock()
        if self._last is not None and now - self._last[0] < self.window_s:
            return self.threads
        sample = self._sample()
        if sample is None or self._last is None or now - self._last[0] > STALE_S:
            self._last = sample  # after a long idle spell, start afresh: decide on the load
            self._proposal = None  # of now, not an average over minutes or an old proposal
            return self.threads
        (t0, busy0, ours0), (t1, busy1, ours1) = self._last, sample
        self._last = sample
        others = max(0, (busy1 - busy0) - (ours1 - ours0)) / TICKS_PER_S / (t1 - t0)
        self.others_cpus = others
        want = threads_for(len(self.cpus), others, self.max_threads)
        # A window spanning two or more, all of it spent working (a step of a second or
        # more, e.g. at one thread), is already an average: it needs no second opinion,
        # which would delay a change by two such steps. One with an idle gap does: the
        # load it saw while we waited is not the load we step into.
        ours_cpus = (ours1 - ours0) / TICKS_PER_S / (t1 - t0)
        settled = t1 - t0 >= 2 * self.window_s and ours_cpus >= BUSY_THROUGH
        if want == self.threads:
            self._proposal = None
        elif want != self._proposal and not settled:
            self._proposal = want  # a second window must agree
        else:
            log.info(
                "other processes keep %.1f of our %d CPUs busy: %d -> %d threads",
                others,
                len(self.cpus),
                self.threads,
                want,
            )
            self._set(want)
            self.threads, self._proposal = want, None
        return self.threads
