"""The thread governor: fewer OpenMP threads while other processes keep the engine's CPUs
busy, all of them again once the CPUs are free (fake /proc text and clock), and the same
decision from the real /proc while a real busy process shares our CPU."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from backends.cpu_share import (
    TICKS_PER_S,
    ThreadGovernor,
    cpus_busy_ticks,
    process_ticks,
    threads_for,
)

STAT = """cpu  900 0 100 5000 0 0 0 7 0 0
cpu0 {0} 0 10 1000 3 1 2 5 0 0
cpu1 {1} 0 20 1000 4 1 2 2 0 0
intr 12345
"""


def self_stat(ticks: int) -> str:
    # fields after the name: state ppid pgrp session tty tpgid flags minflt cminflt majflt
    # cmajflt utime stime ...; the name holds a space and a parenthesis, as names may
    return f"4242 (py (x) y) R 1 1 1 0 -1 0 0 0 0 0 {ticks} 0 0 0 20 0 3\n"


def test_parsers_read_the_fields_that_count() -> None:
    text = STAT.format(100, 200)
    assert cpus_busy_ticks(text, [0]) == 100 + 10 + 1 + 2  # steal and iowait left out
    assert cpus_busy_ticks(text, [0, 1]) == 113 + 223
    assert cpus_busy_ticks(text, [5]) == 0
    assert process_ticks(self_stat(77)) == 77


@pytest.mark.parametrize(
    ("others", "want"), [(0.0, 2), (0.4, 2), (0.6, 1), (1.0, 1), (2.0, 1), (3.5, 1)]
)
def test_threads_for_the_room_left(others: float, want: int) -> None:
    assert threads_for(2, others, max_threads=2) == want


def test_threads_never_exceed_what_was_given() -> None:
    assert threads_for(8, 0.0, max_threads=4) == 4
    assert threads_for(8, 3.0, max_threads=8) == 5


class FakeHost:
    """Two CPUs; each `advance` runs `dt` seconds in which we use `ours` CPUs, a neighbour
    worker (process NEIGHBOUR) `near` and other processes `others` (in /proc's ticks)."""

    NEIGHBOUR = 4243

    def __init__(self) -> None:
        self.now, self.busy, self.ours, self.near = 0.0, [0, 0], 0, 0

    def advance(self, dt: float, ours: float, others: float, near: float = 0.0) -> None:
        self.now += dt
        per_cpu = (ours + others + near) * TICKS_PER_S * dt / 2
        self.busy = [int(b + per_cpu) for b in self.busy]
        self.ours += int(ours * TICKS_PER_S * dt)
        self.near += int(near * TICKS_PER_S * dt)

    def read_pid(self, pid: int) -> str:
        if pid != self.NEIGHBOUR:
            raise FileNotFoundError(f"/proc/{pid}/stat")
        return self_stat(self.near)

    def governor(self, calls: list[int], start: int | None = None) -> ThreadGovernor:
        return ThreadGovernor(
            2,
            start,
            cpus=[0, 1],
            window_s=0.5,
            read_stat=lambda: STAT.format(*self.busy),
            read_self=lambda: self_stat(self.ours),
            clock=lambda: self.now,
            set_threads=calls.append,
            read_pid=self.read_pid,
        )


def test_a_busy_neighbour_takes_a_thread_away_and_gives_it_back() -> None:
    host, calls = FakeHost(), []
    gov = host.governor(calls)
    for _ in range(4):  # alone: both threads stay
        host.advance(0.5, ours=2.0, others=0.0)
        assert gov.tick() == 2
    host.advance(0.5, ours=1.3, others=0.7)  # a neighbour wants a CPU: one window is noise
    assert gov.tick() == 2 and calls == []
    host.advance(0.5, ours=1.0, others=1.0)  # the second window agrees
    assert gov.tick() == 1 and calls == [1]
    assert gov.others_cpus == pytest.approx(1.0, abs=0.05)
    host.advance(0.5, ours=1.0, others=0.0)
    assert gov.tick() == 1
    host.advance(0.5, ours=1.0, others=0.1)
    assert gov.tick() == 2 and calls == [1, 2]


def test_a_worker_started_at_its_share_grows_into_an_idle_neighbours_cpu() -> None:
    """Two workers sharing two CPUs each start at one thread; while the neighbour is busy
    nothing changes, once it idles (the prompts are in) the decoder takes both CPUs, and it
    gives one back when the neighbour works again."""
    host, calls = FakeHost(), []
    gov = host.governor(calls, start=1)
    for _ in range(3):
        host.advance(0.5, ours=1.0, others=1.0)
        assert gov.tick() == 1
    host.advance(0.5, ours=1.0, others=0.05)
    gov.tick()
    host.advance(0.5, ours=1.0, others=0.0)
    assert gov.tick() == 2 and calls == [2]
    host.advance(0.5, ours=1.2, others=0.8)
    gov.tick()
    host.advance(0.5, ours=1.0, others=1.0)
    assert gov.tick() == 1 and calls == [2, 1]
    assert ThreadGovernor(2, 4, cpus=[0]).threads == 2  # never more than the maximum


def test_a_window_of_two_or_more_decides_alone() -> None:
    """A step of a second or more (one thread, a long prefill chunk) spans two windows: its
    average needs no second window, so the idle neighbour's CPU is taken a step sooner."""
    host, calls = FakeHost(), []
    gov = host.governor(calls, start=1)
    host.advance(0.9, ours=1.0, others=0.0)  # under two windows: only a proposal
    assert gov.tick() == 1 and calls == []
    host.advance(1.0, ours=1.0, others=1.0)  # two windows long: decides alone, and the
    assert gov.tick() == 1 and calls == []  # old proposal (2) is not what it says
    host.advance(1.2, ours=1.0, others=0.0)
    assert gov.tick() == 2 and calls == [2]


def test_a_long_window_with_an_idle_gap_still_needs_a_second() -> None:
    """Waiting 3 s for work while the neighbour was busy is not a long step: the first step
    after it does not drop a thread on that load alone."""
    host, calls = FakeHost(), []
    gov = host.governor(calls)
    host.advance(0.5, ours=2.0, others=0.0)
    assert gov.tick() == 2
    host.advance(3.0, ours=0.1, others=1.0)  # idle, the neighbour busy
    assert gov.tick() == 2 and calls == []
    host.advance(0.5, ours=2.0, others=0.0)  # the neighbour idles now: nothing changes
    assert gov.tick() == 2 and calls == []


def test_between_windows_and_after_idle_spells_nothing_is_decided() -> None:
    host, calls = FakeHost(), []
    gov = host.governor(calls)
    host.advance(0.2, ours=0.0, others=2.0)
    assert gov.tick() == 2  # window not over yet
    host.advance(0.5, ours=1.0, others=1.0)
    assert gov.tick() == 2  # a proposal of 1 thread, not yet agreed
    host.advance(60.0, ours=0.0, others=2.0)  # idle a minute: start a fresh window
    assert gov.tick() == 2
    host.advance(0.5, ours=1.0, others=1.0)  # one window after the idle spell: the old
    assert gov.tick() == 2 and calls == []  # proposal is gone, this one needs a second
    host.advance(0.5, ours=1.0, others=1.0)
    gov.tick()
    host.advance(0.5, ours=1.0, others=1.0)
    assert gov.tick() == 1 and calls == [1]


def test_an_unreadable_proc_keeps_the_threads() -> None:
    def broken() -> str:
        raise OSError("no /proc here")

    calls: list[int] = []
    clock = iter(range(0, 100, 1))
    gov = ThreadGovernor(
        2, cpus=[0], read_stat=broken, clock=lambda: float(next(clock)), set_threads=calls.append
    )
    for _ in range(5):
        assert gov.tick() == 2
    assert calls == []


@pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs Linux /proc and two CPUs",
)
def test_the_real_proc_sees_a_busy_process_on_our_cpus() -> None:
    """A busy child pinned to one of two CPUs of ours: the real /proc shows about one CPU
    of others' load, and the governor takes one of the two threads away."""
    cpus = sorted(os.sched_getaffinity(0))[:2]
    spin = (
        f"import os, sys, time\nos.sched_setaffinity(0, {{{cpus[1]}}})\n"
        "print('spinning', flush=True)\nend = time.monotonic() + 20\n"
        "while time.monotonic() < end: pass\n"
    )
    child = subprocess.Popen([sys.executable, "-c", spin], stdout=subprocess.PIPE, text=True)
    calls: list[int] = []
    try:
        assert child.stdout is not None and child.stdout.readline() == "spinning\n"
        gov = ThreadGovernor(2, cpus=cpus, window_s=0.3, set_threads=calls.append)
        deadline = time.monotonic() + 15
        while not calls and time.monotonic() < deadline:
            time.sleep(0.1)  # we stay idle: the load is the child's
            gov.tick()
        assert calls == [1], f"others {gov.others_cpus:.2f} CPUs"
    finally:
        child.kill()
        child.wait()
