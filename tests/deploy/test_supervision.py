"""Restart policy, the supervisor's restart loop (with fake processes), role-switch decisions
and the status table; and a real stopped worker process, killed and replaced."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path

import openai
import pytest

from hetero_pd.deploy.controller import RoleController, WorkerLoad, decide
from hetero_pd.deploy.sections import SupervisorSpec
from hetero_pd.deploy.status import format_status
from hetero_pd.deploy.supervisor import RestartPolicy, Supervisor
from hetero_pd.deploy.testing import deployment, running_stack


def test_backoff_doubles_up_to_the_cap_and_gives_up_after_max_restarts() -> None:
    policy = RestartPolicy(SupervisorSpec(backoff_s=0.5, backoff_max_s=3.0, max_restarts=4))
    delays = []
    for t in range(5):
        delays.append(policy.delay("p-0", float(t)))
        policy.record("p-0", float(t))
    assert delays == [0.5, 1.0, 2.0, 3.0, None]
    assert policy.delay("p-1", 5.0) == 0.5  # per worker


def test_restarts_outside_the_window_are_forgotten() -> None:
    policy = RestartPolicy(SupervisorSpec(backoff_s=1.0, max_restarts=1, window_s=10.0))
    policy.record("w", 0.0)
    assert policy.delay("w", 5.0) is None
    assert policy.delay("w", 10.5) == 1.0


def test_no_restart_when_disabled() -> None:
    assert RestartPolicy(SupervisorSpec(restart=False)).delay("w", 0.0) is None


class FakeProcs:
    """Processes that exit when told; respawn makes a new one."""

    def __init__(self) -> None:
        self.exits: dict[str, asyncio.Future[int]] = {}
        self.pids = {"prefill-0": 100}
        self.respawned = asyncio.Event()

    def pid(self, worker_id: str) -> int | None:
        return self.pids[worker_id]

    async def wait(self, worker_id: str) -> int:
        fut = self.exits.setdefault(worker_id, asyncio.get_running_loop().create_future())
        return await fut

    async def respawn(self, worker_id: str) -> None:
        self.pids[worker_id] += 1
        self.exits.pop(worker_id)
        self.respawned.set()

    def crash(self, worker_id: str) -> None:
        self.exits[worker_id].set_result(-9)


class FakeRouter:
    def __init__(self) -> None:
        self.dead: list[str] = []

    def mark_dead(self, worker_id: str) -> None:
        self.dead.append(worker_id)

    def silent_for(self, worker_id: str) -> float | None:
        return None


def test_supervisor_takes_a_crashed_worker_out_and_restarts_it() -> None:
    async def scenario() -> None:
        procs, router = FakeProcs(), FakeRouter()
        sup = Supervisor(procs, router, SupervisorSpec(backoff_s=0.0))
        sup.watch(["prefill-0"])
        await asyncio.sleep(0)
        procs.crash("prefill-0")
        await asyncio.wait_for(procs.respawned.wait(), 5)
        await asyncio.sleep(0)
        assert router.dead == ["prefill-0"]
        assert sup.states["prefill-0"] == {"state": "running", "restarts": 1, "pid": 101}
        await sup.stop()

    asyncio.run(scenario())


def test_supervisor_leaves_a_worker_down_after_too_many_restarts() -> None:
    async def scenario() -> None:
        procs, router = FakeProcs(), FakeRouter()
        sup = Supervisor(procs, router, SupervisorSpec(backoff_s=0.0, max_restarts=0))
        sup.watch(["prefill-0"])
        await asyncio.sleep(0)
        procs.crash("prefill-0")
        await asyncio.wait_for(sup._tasks["prefill-0"], 5)
        assert sup.states["prefill-0"]["state"] == "down"
        assert not procs.respawned.is_set()

    asyncio.run(scenario())


P = "prefill"
D = "decode"


@pytest.mark.parametrize(
    ("loads", "expected"),
    [
        # prompts pile up on prefill, decode idle -> the idlest decode worker becomes prefill
        ([WorkerLoad("p0", P, 8192), WorkerLoad("d0", D, running=3), WorkerLoad("d1", D)], "d1"),
        # requests wait for decode, prefill idle -> a prefill worker becomes decode
        (
            [
                WorkerLoad("p0", P),
                WorkerLoad("p1", P, 0, running=1),
                WorkerLoad("d0", D, waiting=6),
            ],
            "p0",
        ),
        # balanced enough: nothing
        (
            [
                WorkerLoad("p0", P, 2048),
                WorkerLoad("d0", D, waiting=2),
                WorkerLoad("d1", D, waiting=2),
            ],
            None,
        ),
        # never leave a role empty
        ([WorkerLoad("p0", P, 99999), WorkerLoad("d0", D)], None),
        # colocated workers are not switched
        ([WorkerLoad("b0", "both", 99999), WorkerLoad("b1", "both")], None),
    ],
)
def test_decide(loads: list[WorkerLoad], expected: str | None) -> None:
    choice = decide(loads, chunk_tokens=512, imbalance=4.0)
    assert (choice.worker_id if choice else None) == expected
    if choice:
        assert choice.to_role != next(w.role for w in loads if w.worker_id == expected)


def test_controller_switches_once_then_cools_down() -> None:
    switched: list[tuple[str, str]] = []
    loads = [WorkerLoad("p0", P, 8192), WorkerLoad("d0", D), WorkerLoad("d1", D)]

    async def switch(worker_id: str, role: str) -> None:
        switched.append((worker_id, role))

    async def scenario() -> list[bool]:
        spec = SupervisorSpec(role_switch=True)
        ctl = RoleController(lambda: loads, switch, spec, chunk_tokens=512)
        return [await ctl.tick() is not None for _ in range(6)]

    assert asyncio.run(scenario()) == [True, False, False, False, True, False]
    assert switched == [("d0", "prefill"), ("d0", "prefill")]


def test_status_table() -> None:
    body = {
        "status": "ok",
        "workers": {
            "decode-0": {
                "role": "decode",
                "device": "cpu",
                "alive": True,
                "pid": 7,
                "restarts": 0,
                "load": {"waiting": 1, "running": 2, "kv_usage": 0.25},
            },
            "prefill-0": {
                "role": "prefill",
                "device": "npu:0",
                "alive": False,
                "pid": 9,
                "restarts": 2,
                "state": "restarting (exit code -9)",
                "load": {},
            },
        },
    }
    lines = format_status(body).splitlines()
    assert lines[0] == "status: ok"
    assert lines[1].split() == [
        "worker",
        "role",
        "device",
        "health",
        "pid",
        "restarts",
        "waiting",
        "running",
        "kv",
    ]
    assert lines[2].split() == ["decode-0", "decode", "cpu", "up", "7", "0", "1", "2", "25.0%"]
    assert lines[3].split()[:4] == ["prefill-0", "prefill", "npu:0", "restarting"]


def test_a_stopped_worker_is_killed_restarted_and_routed_around(tiny_llama_dir: Path) -> None:
    """SIGSTOP the prefill worker: the router takes it out of rotation (prompts are then
    prefilled on the decode worker), the supervisor sees a live process that stopped
    talking, kills it and starts a new one, which rejoins. On `python -m` workers, which the
    launcher reaps itself (test_forkserver covers restarts through the fork server)."""
    dep = deployment(
        tiny_llama_dir,
        router={"heartbeat_timeout_s": 1.0, "local_prefill_max_tokens": 0},
        supervisor={"hang_timeout_s": 3.0, "backoff_s": 0.1, "fork_server": False},
    )
    with running_stack(dep) as stack:
        assert stack.router is not None and stack.launcher is not None
        client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0)

        def complete() -> str:
            r = client.completions.create(
                model=dep.model, prompt=[5, 6, 7, 8], max_tokens=4, temperature=0
            )
            return r.choices[0].text

        answer = complete()
        old = stack.launcher.pid("prefill-0")
        assert old is not None
        os.kill(old, signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 60
            while stack.router.workers["prefill-0"].alive:
                assert time.monotonic() < deadline, "the stopped worker stayed in rotation"
                time.sleep(0.05)
            assert complete() == answer  # prefilled on the decode worker meanwhile
            # Events, not timing: the supervisor reports it running under a new pid.
            while (state := stack.router.supervision_of("prefill-0"))["state"] != "running" or (
                state["pid"] == old or not stack.router.live("prefill")
            ):
                assert time.monotonic() < deadline, "the stopped worker was never replaced"
                time.sleep(0.1)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(old, signal.SIGKILL)
        # At least one restart, not exactly one: a slow machine may see the new process
        # outlast hang_timeout_s before its first heartbeat and replace it once more.
        assert state["restarts"] >= 1, state
        assert complete() == answer
        stack.wait_idle()
