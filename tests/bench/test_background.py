"""`--background-load`: busy processes that the bench starts, stops, and cannot leak."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from hetero_pd.bench.background import MAX_PROCESSES, background_load, check_count

pytestmark = pytest.mark.timeout(120)


def _cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    """Pids still running at the deadline (a zombie nobody reaped yet counts as gone)."""
    deadline = time.monotonic() + timeout_s
    while (left := [p for p in pids if _state(p) not in ("gone", "Z", "X")]) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.02)
    return left


def _wait_busy(pid: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while _cpu_ticks(pid) < 5:  # 50 ms of CPU at the usual 100 ticks/s
        assert time.monotonic() < deadline, f"process {pid} did not burn CPU in {timeout_s}s"
        time.sleep(0.05)


def test_processes_spin_and_stop_with_the_block() -> None:
    with background_load(2) as pids:
        assert len(pids) == 2
        for pid in pids:
            _wait_busy(pid)
    assert wait_gone(pids, 10.0) == []


def test_no_process_outlives_a_killed_bench() -> None:
    code = (
        "import sys, time\n"
        "from hetero_pd.bench.background import background_load\n"
        "with background_load(1) as pids:\n"
        "    print(pids[0], flush=True)\n"
        "    time.sleep(600)\n"
    )
    bench = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert bench.stdout is not None
        child = int(bench.stdout.readline())
        _wait_busy(child)
    finally:
        bench.send_signal(signal.SIGKILL)
        bench.wait(timeout=10)
    assert wait_gone([child], 10.0) == [], "a busy process outlived its bench"


def test_the_count_is_bounded() -> None:
    assert check_count(0) == 0 and check_count(MAX_PROCESSES) == MAX_PROCESSES
    for n in (-1, MAX_PROCESSES + 1):
        with pytest.raises(ValueError, match="--background-load must be in"):
            check_count(n)
    with pytest.raises(ValueError), background_load(MAX_PROCESSES + 1):
        pass
