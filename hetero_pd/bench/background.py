"""`--background-load N`: N busy processes beside a measurement, so the effect of a shared
host is measured rather than guessed.

Each process spins a pure-Python loop (one core's worth of demand) on every CPU this
process was allowed when the load started, until the bench stops it. They are bounded three
ways: at most ``MAX_PROCESSES``, each ends by itself after ``max_s`` seconds, and each ends
as soon as its parent (the bench) is gone, so a killed bench leaves nothing spinning.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator

MAX_PROCESSES = 64

_SPIN = """
import os, sys, time
parent, deadline = int(sys.argv[1]), time.monotonic() + float(sys.argv[2])
os.sched_setaffinity(0, [int(c) for c in sys.argv[3].split(",")])
x = 0
while time.monotonic() < deadline and os.getppid() == parent:
    for _ in range(20000):
        x += 1
"""


def check_count(n: int) -> int:
    """``n`` itself, or a ValueError naming the allowed range."""
    if not 0 <= n <= MAX_PROCESSES:
        raise ValueError(f"--background-load must be in [0, {MAX_PROCESSES}], got {n}")
    return n


@contextlib.contextmanager
def background_load(
    n: int, cpus: list[int] | None = None, max_s: float = 6 * 3600
) -> Iterator[list[int]]:
    """Runs ``n`` busy processes (spread over ``cpus``, default: this process's CPUs) for
    the duration of the ``with`` block; yields their pids and stops them on the way out."""
    check_count(n)
    allowed = sorted(cpus if cpus else os.sched_getaffinity(0))
    argv = [sys.executable, "-c", _SPIN, str(os.getpid()), str(max_s), ",".join(map(str, allowed))]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(n):
            procs.append(subprocess.Popen(argv, stdin=subprocess.DEVNULL))
        if procs:
            print(f"background load: {n} busy processes on CPUs {allowed}", file=sys.stderr)
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
