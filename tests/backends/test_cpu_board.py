"""Workers sharing one host's CPUs through a board: a worker grown into an idle neighbour's
CPU gives it back at its first step after the neighbour works, never grows while one works,
and a worker about to step waits (bounded) for a grown neighbour to give its CPU back. Two
real boards on one file stand for two worker processes; the /proc windows are faked."""

from __future__ import annotations

import stat
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from backends.cpu_share import GROW_AFTER_S, WAIT_S, HostBoard, ThreadGovernor

from .test_cpu_share import FakeHost


@pytest.fixture
def boards(tmp_path: Path) -> tuple[HostBoard, HostBoard]:
    path = tmp_path / "board"
    HostBoard.create(path, 2)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    return HostBoard(path, 0), HostBoard(path, 1)


def governor(
    host: FakeHost, board: HostBoard, calls: list[int], sleep: Callable[[float], None] = time.sleep
) -> ThreadGovernor:
    gov = host.governor(calls, start=1)
    gov.board, gov._sleep = board, sleep
    return gov


def grown(host: FakeHost, gov: ThreadGovernor) -> None:
    """Two windows of an idle neighbour: the worker takes both CPUs."""
    for _ in range(2):
        host.advance(0.5, ours=1.0, others=0.0)
        gov.tick()
    assert gov.threads == 2


def test_a_grown_worker_gives_the_cpu_back_at_its_next_step(
    boards: tuple[HostBoard, HostBoard],
) -> None:
    mine, neighbour = boards
    host, calls = FakeHost(), []
    gov = governor(host, mine, calls)
    grown(host, gov)
    assert neighbour.others()[:2] == (True, 2)  # the neighbour sees us working at two threads
    neighbour.publish(True, 1)  # it got a prompt
    host.advance(0.25, ours=2.0, others=0.0)  # one step later, inside a window
    assert gov.tick() == 1 and calls == [2, 1]
    assert neighbour.others()[:2] == (True, 1)
    for _ in range(4):  # however idle the windows say the host is, no growth meanwhile
        host.advance(0.5, ours=1.0, others=0.0)
        assert gov.tick() == 1
    neighbour.publish(False, 0)  # its request is done: growth follows the windows again
    grown(host, gov)


def test_a_worker_about_to_step_waits_for_a_grown_neighbour(
    boards: tuple[HostBoard, HostBoard],
) -> None:
    mine, neighbour = boards
    neighbour.publish(True, 2)  # mid-step at two threads
    slept: list[float] = []
    host, calls = FakeHost(), []

    gives_back = [True]

    def sleep(s: float) -> None:
        slept.append(s)
        host.now += s
        if len(slept) == 30 and gives_back[0]:
            neighbour.publish(True, 1)  # its step ended and it gave our CPU back

    gov = governor(host, mine, calls, sleep)
    assert gov.tick() == 1 and len(slept) == 30 and calls == []
    assert neighbour.others()[:2] == (True, 1)
    neighbour.publish(True, 2)  # one that never gives it back: we wait WAIT_S, no longer
    slept.clear()
    gives_back[0] = False
    host.advance(0.25, ours=1.0, others=1.0)
    assert gov.tick() == 1 and sum(slept) == pytest.approx(WAIT_S, abs=0.001)


def test_idle_and_dead_neighbours_hold_no_cpu(
    boards: tuple[HostBoard, HostBoard], monkeypatch: pytest.MonkeyPatch
) -> None:
    mine, neighbour = boards
    host, calls = FakeHost(), []
    gov = governor(host, mine, calls)
    gov.tick()
    gov.idle()
    assert neighbour.others()[:2] == (False, 0)
    mine.publish(True, 2)  # a worker that died mid-step: its slot goes stale
    later = time.monotonic() + HostBoard.STALE_S + 1
    monkeypatch.setattr(time, "monotonic", lambda: later)
    assert neighbour.others()[:2] == (False, 0)


def test_a_slot_outside_the_board_is_refused(tmp_path: Path) -> None:
    HostBoard.create(tmp_path / "board", 2)
    with pytest.raises(ValueError, match="slot 2 of 2"):
        HostBoard(tmp_path / "board", 2)


def test_a_garbled_board_costs_at_most_the_wait_and_never_raises(
    boards: tuple[HostBoard, HostBoard],
) -> None:
    """Whatever bytes a neighbour's slot holds (huge thread counts, a NaN or future time),
    a worker reads them without error and waits no longer than ``WAIT_S`` per step."""
    mine, neighbour = boards
    slept: list[float] = []
    host, calls = FakeHost(), []

    def sleep(s: float) -> None:
        slept.append(s)
        host.now += s

    gov = governor(host, mine, calls, sleep)
    for stamp in (float("nan"), float("inf"), time.monotonic() + 1e9):
        huge = 0xFFFFFFFF  # a thread count, and a pid no process has
        HostBoard.SLOT.pack_into(neighbour._map, HostBoard.SLOT.size, huge, huge, stamp, huge)
        slept.clear()
        host.advance(0.25, ours=1.0, others=1.0)
        assert gov.tick() == 1 and sum(slept) <= WAIT_S + 0.001


def test_a_neighbours_cpu_is_not_others_load_and_its_idle_cpu_is_taken_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The windows leave a board neighbour's own CPU time out of the load of "other
    processes" (its slot names its pid); once every neighbour has idled GROW_AFTER_S, a
    worker grows at its next step into the room those others leave, without two windows;
    not sooner, and not into a CPU a stranger keeps busy."""
    clock = [time.monotonic()]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    HostBoard.create(tmp_path / "board", 2)
    mine, neighbour = HostBoard(tmp_path / "board", 0), HostBoard(tmp_path / "board", 1, 4243)
    host, calls = FakeHost(), []
    gov = governor(host, mine, calls)
    neighbour.publish(True, 1)
    for _ in range(2):  # the neighbour busy on the other CPU: not others' load, no growth
        host.advance(0.5, ours=1.0, others=0.0, near=1.0)
        assert gov.tick() == 1
    assert gov.others_cpus == pytest.approx(0.0, abs=0.05) and calls == []

    neighbour.publish(False, 0)  # its last prompt is done
    clock[0] += GROW_AFTER_S / 2
    host.advance(0.1, ours=1.0, others=0.0)
    assert gov.tick() == 1 and calls == []  # idle too briefly: it may be between prompts
    clock[0] += GROW_AFTER_S
    host.advance(0.1, ours=1.0, others=0.0)  # inside the same window: no window decides
    assert gov.tick() == 2 and calls == [2]

    neighbour.publish(True, 1)  # back to work: ours again at our next step
    host.advance(0.1, ours=2.0, others=0.0)
    assert gov.tick() == 1 and calls == [2, 1]
    for _ in range(2):  # a stranger keeps a CPU busy as well
        host.advance(0.5, ours=1.0, others=1.0, near=1.0)
        gov.tick()
    assert gov.others_cpus == pytest.approx(1.0, abs=0.05)
    neighbour.publish(False, 0)
    clock[0] += 2 * GROW_AFTER_S
    host.advance(0.1, ours=1.0, others=1.0)
    assert gov.tick() == 1 and calls == [2, 1]  # the stranger's CPU is not room


def test_the_pids_a_board_names_leave_out_ours_and_untaken_slots(tmp_path: Path) -> None:
    """The windows subtract the CPU time of the pids the other slots name: never our own
    (counted as ours already) nor 0 (a slot no worker took), whatever a slot holds."""
    HostBoard.create(tmp_path / "board", 4)
    mine = HostBoard(tmp_path / "board", 0)
    HostBoard(tmp_path / "board", 1, 4243)
    HostBoard(tmp_path / "board", 2, mine.pid)  # a garbled slot naming us
    assert mine.pids() == {4243}  # slot 3 never taken: pid 0
