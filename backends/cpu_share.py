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

Giving it back cannot wait for the windows: two workers' OpenMP threads on one core make
every parallel region wait for a descheduled thread, and a step goes 10-50x slower (two
`both` workers at two threads each on two cores: TPOT 700 ms against 20), so a neighbour's
prompt that arrived while this worker ran above its share waited 0.5-1.2 s for the windows
to agree. Such workers therefore share a :class:`HostBoard` (a small file the launcher
makes, one slot each): before each step a worker says it works and how many threads it
runs, and when it has nothing to step it says it holds no CPU; it grows above its share only
while no neighbour works and drops to its share at its first step after one does, and a
worker about to step waits (at most ``WAIT_S``) until the threads of the working workers
fit the CPUs, i.e. for the grown neighbour's current step. The windows still decide about
every other process: a neighbour's own CPU time (its slot names its pid) is not counted as
the load of others, so once every neighbour has been idle for ``GROW_AFTER_S`` a worker
grows at its next step into the room the others leave, without waiting for two windows
(1P1D at rate inf: the decode worker ran at one thread for 1.3 s after the prefill worker's
last prompt, a step 115 ms where two threads took 85).
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import NamedTuple

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
# How long a worker about to step waits for a grown neighbour to give its CPU back (one of
# the neighbour's steps), and how often it looks.
WAIT_S = 0.5
WAIT_STEP_S = 0.0005
# How long every neighbour on the board must have been idle before a worker grows into
# their CPUs at once: a neighbour between two prompts (low request rates) keeps its CPU.
GROW_AFTER_S = 0.25


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


class Neighbours(NamedTuple):
    """What a worker reads of the other slots on its board before each step."""

    working: bool  # another worker works now
    threads: int  # the threads the working others run
    idle_s: float  # how long every other has been idle (0.0 while one works)


class HostBoard:
    """Workers sharing one host's CPUs, a slot each in one small file: whether the worker
    works now, how many threads it runs, when it said so (CLOCK_MONOTONIC, one clock for
    the whole host) and its pid. Each worker writes its own slot only; a slot not renewed
    for ``STALE_S`` (its worker died mid-step) counts as idle."""

    SLOT = struct.Struct("<IIdI")
    STALE_S = 2.0

    def __init__(self, path: str | os.PathLike[str], slot: int, pid: int | None = None) -> None:
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), 0)
        self.slots = len(self._map) // self.SLOT.size
        if not 0 <= slot < self.slots:
            raise ValueError(f"cpu board {path}: slot {slot} of {self.slots}")
        self.slot = slot
        self._others = [i for i in range(self.slots) if i != slot]
        self.pid = os.getpid() if pid is None else pid
        self.publish(False, 0)

    @classmethod
    def create(cls, path: str | os.PathLike[str], slots: int) -> None:
        """A board of ``slots`` idle slots at ``path`` (readable and writable by us only)."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, bytes(cls.SLOT.size * slots))
        finally:
            os.close(fd)

    def publish(self, working: bool, threads: int) -> None:
        at = self.slot * self.SLOT.size
        self.SLOT.pack_into(self._map, at, int(working), threads, time.monotonic(), self.pid)

    def others(self) -> Neighbours:
        now, working, threads, since = time.monotonic(), False, 0, 0.0
        for i in self._others:
            busy, n, stamp, _pid = self.SLOT.unpack_from(self._map, i * self.SLOT.size)
            if busy and now - stamp < self.STALE_S:
                working, threads = True, threads + n
            else:  # idle, or died mid-step: when the last of the others stopped working.
                # A NaN stamp never wins a max; an infinite one leaves no idle time.
                since = max(since, stamp)
        return Neighbours(working, threads, 0.0 if working else max(0.0, now - since))

    def pids(self) -> set[int]:
        """The other workers' processes (slots not taken yet name none)."""
        at = self.SLOT.size
        pids = {self.SLOT.unpack_from(self._map, i * at)[3] for i in self._others}
        return pids - {0, self.pid}

    def close(self) -> None:
        self._map.close()


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
        board: HostBoard | None = None,
        sleep: Callable[[float], None] = time.sleep,
        read_pid: Callable[[int], str] = lambda pid: Path(f"/proc/{pid}/stat").read_text(),
    ) -> None:
        self.max_threads = max_threads
        self.cpus = sorted(affinity_cpus() if cpus is None else cpus)
        self.window_s = window_s
        self._read_stat, self._read_self = read_stat, read_self
        self._clock, self._set, self._sleep, self._read_pid = clock, set_threads, sleep, read_pid
        #: The count in force (the caller set it: ``start_threads``, else ``max_threads``).
        self.threads = min(max_threads, start_threads or max_threads)
        #: Our share of a host we share through ``board``: above it only while no one else
        #: on the board works.
        self.share = self.threads
        self.board = board
        self._published: tuple[bool, int] | None = None
        #: Other processes' load on our CPUs (board neighbours' left out), last window; None
        #: before the first.
        self.others_cpus: float | None = None
        self._proposal: int | None = None
        self._last = self._sample()

    def _sample(self) -> tuple[float, int, int, dict[int, int]] | None:
        try:
            busy = cpus_busy_ticks(self._read_stat(), self.cpus)
            ours = process_ticks(self._read_self())
        except (OSError, ValueError, IndexError):
            return None  # no /proc (or an odd one): keep the threads we have
        return self._clock(), busy, ours, self._neighbour_ticks()

    def _neighbour_ticks(self) -> dict[int, int]:
        """CPU ticks of each board neighbour's process (none we cannot read: its load then
        counts as others')."""
        ticks: dict[int, int] = {}
        if self.board is None:
            return ticks
        for pid in self.board.pids():
            try:
                ticks[pid] = process_ticks(self._read_pid(pid))
            except (OSError, ValueError, IndexError):
                continue
        return ticks

    def tick(self) -> int:
        """Before a step: measures once a window has passed, and (sharing a board) gives
        a neighbour that works its CPU back at once and waits for a grown one to give ours
        back. Returns the thread count in force."""
        if self.board is None:
            return self._measure()
        others = self.board.others()
        if others.working and self.threads > self.share:
            self._change(self.share, "a neighbour on this host works")
        self._measure(cap=self.share if others.working else None)
        if others.idle_s >= GROW_AFTER_S and self.others_cpus is not None:
            room = threads_for(len(self.cpus), self.others_cpus, self.max_threads)
            if self.threads < room:
                self._change(room, f"the neighbours on this host idle {others.idle_s:.2f}s")
        self._publish(True)
        deadline = self._clock() + WAIT_S  # by the clock: a busy host stretches each sleep
        while self.board.others().threads + self.threads > len(self.cpus):
            if self._clock() >= deadline:
                break
            self._sleep(WAIT_STEP_S)
        return self.threads

    def idle(self) -> None:
        """No step to run: the board hears that we neither work nor hold CPUs."""
        if self.board is not None:
            self._publish(False)

    def _publish(self, working: bool) -> None:
        assert self.board is not None
        state = (working, self.threads if working else 0)
        if working or state != self._published:  # a working slot's time is renewed
            self.board.publish(*state)
            self._published = state

    def _change(self, threads: int, why: str) -> None:
        log.info("%s: %d -> %d threads", why, self.threads, threads)
        self._set(threads)
        self.threads, self._proposal = threads, None

    def _measure(self, cap: int | None = None) -> int:
        """The windows: once one has passed, the count the load on our CPUs calls for
        (never above ``cap``)."""
        now = self._clock()
        if self._last is not None and now - self._last[0] < self.window_s:
            return self.threads
        sample = self._sample()
        if sample is None or self._last is None or now - self._last[0] > STALE_S:
            self._last = sample  # after a long idle spell, start afresh: decide on the load
            self._proposal = None  # of now, not an average over minutes or an old proposal
            return self.threads
        (t0, busy0, ours0, near0), (t1, busy1, ours1, near1) = self._last, sample
        self._last = sample
        near = sum(near1[pid] - near0[pid] for pid in near1.keys() & near0.keys())
        others = max(0, (busy1 - busy0) - (ours1 - ours0) - near) / TICKS_PER_S / (t1 - t0)
        self.others_cpus = others
        want = threads_for(len(self.cpus), others, self.max_threads)
        if cap is not None:
            want = min(want, cap)
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
            self._change(
                want, f"other processes keep {others:.1f} of our {len(self.cpus)} CPUs busy"
            )
        return self.threads
