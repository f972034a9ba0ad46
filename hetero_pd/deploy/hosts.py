"""Bare metal: one host's part of a deployment whose workers are listed by host.

    workers:
      - {role: prefill, device: npu:0, host: 10.0.0.2}
      - {role: decode, device: cuda:0, host: 10.0.0.3}
    router: {host: 10.0.0.1, port: 8000}

    10.0.0.2$ hetero-pd serve deploy.yaml --host-id 10.0.0.2   # prefill-0 on 9000/9001
    10.0.0.3$ hetero-pd serve deploy.yaml --host-id 10.0.0.3   # decode-0 on 9000/9001
    10.0.0.1$ hetero-pd serve deploy.yaml --host-id 10.0.0.1   # router.host: the router

Each worker binds its host's address and advertises the host as the file writes it (checked
before it starts: `hetero_pd.deploy.addresses`); its ports follow the list
(`workers.host_ports`), so the router derives every address from the same file. The host's
workers are supervised here (restart with backoff, `supervisor:`) as on one box.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Callable, Coroutine
from dataclasses import replace
from typing import Any

from backends.cpu import usable_cpus
from hetero_pd import secrets
from hetero_pd.deploy.addresses import bind_address, check_advertised
from hetero_pd.deploy.cpu_board import remove_cpu_board, with_cpu_board
from hetero_pd.deploy.launcher import thread_counts, worker_config
from hetero_pd.deploy.schema import Deployment
from hetero_pd.deploy.supervisor import Supervisor
from hetero_pd.deploy.workers import expand_workers
from hetero_pd.serving.worker.config import WorkerConfig
from hetero_pd.serving.worker.main import READY_LINE, ready_address

log = logging.getLogger("hetero_pd.hosts")
RouterMain = Callable[[], Coroutine[Any, Any, None]]


def host_worker_configs(dep: Deployment, host_id: str) -> list[WorkerConfig]:
    """The configs of the workers the file lists on `host_id`, bound to its address."""
    instances = [w for w in expand_workers(dep.workers) if w.host == host_id]
    if not instances:
        return []
    bind = bind_address(host_id)
    cpus = usable_cpus()
    configs = []
    for w in instances:
        check_advertised(bind, w.host, f"worker {w.worker_id}")
        threads, initial = thread_counts(w, cpus, len(instances))
        configs.append(
            worker_config(dep, w, threads, initial, bind, w.port, w.port + 1, advertise_host=w.host)
        )
    return configs


def run_host(dep: Deployment, host_id: str | None, router_main: RouterMain) -> int:
    """Runs `host_id`'s workers (and the router when `router.host` is `host_id`) until
    SIGINT/SIGTERM."""
    hosts = sorted({w.host for w in dep.workers if w.host})
    if not host_id:
        raise ValueError(
            f"{dep.source} lists workers by host ({', '.join(hosts)}): run "
            "`hetero-pd serve CONFIG --host-id HOST` on each (the router's host too)"
        )
    configs = host_worker_configs(dep, host_id)
    runs_router = dep.router.host == host_id
    if not configs and not runs_router:
        raise ValueError(
            f"--host-id {host_id}: {dep.source} lists no worker there (its hosts: "
            f"{', '.join(hosts)}) and router.host is {dep.router.host}"
        )
    asyncio.run(_run(dep, configs, router_main if runs_router else None))
    return 0


async def _run(dep: Deployment, configs: list[WorkerConfig], router: RouterMain | None) -> None:
    configs, board = with_cpu_board(configs)
    procs = HostWorkers([replace(c, parent_pid=os.getpid()) for c in configs], dep)
    supervisor = Supervisor(procs, procs, dep.supervisor)
    try:
        await procs.start()
        supervisor.watch(list(procs.configs))
        names = ", ".join(f"{c.worker_id} on {c.host}:{c.port}" for c in configs)
        print(f"hetero-pd: this host runs {names or 'no worker'}", flush=True)
        if router is not None:
            await router()  # serves until SIGINT/SIGTERM
        else:
            await _signalled()
    finally:
        await supervisor.stop()
        await procs.stop(dep.supervisor.stop_grace_s)
        remove_cpu_board(board)


def worker_envs(worker_ids: list[str]) -> dict[str, dict[str, str]]:
    """The environment of each of this host's workers: its own credential only, made from the
    deployment secret on the router's host, or taken from the credentials this host was
    given (a host of workers only, which then never holds the secret: `python -m
    hetero_pd.secrets ID...` prints them)."""
    secret = secrets.from_env(required=False)
    if secret:
        return {w: secrets.worker_environment(dict(os.environ), secret, [w]) for w in worker_ids}
    out = {}
    for worker_id in worker_ids:
        try:
            credential = secrets.worker_credential_from_env(worker_id)
        except secrets.SecretError as e:
            raise secrets.SecretError(
                f"{e}; or set {secrets.ENV} (the router's host needs it; a host of workers "
                f"only is better given {secrets.WORKER_ENV}: `python -m hetero_pd.secrets "
                f"{' '.join(worker_ids)}` prints it from the secret)"
            ) from None
        out[worker_id] = {**os.environ, secrets.WORKER_ENV: credential.text()}
    return out


class HostWorkers:
    """This host's worker processes, for the supervisor (`Processes`); no router here, so
    `mark_dead` is nothing: the router notices the missing heartbeats itself."""

    def __init__(self, configs: list[WorkerConfig], dep: Deployment) -> None:
        self.configs = {c.worker_id: c for c in configs}
        self.envs = worker_envs(list(self.configs))
        self.ready_timeout_s = dep.supervisor.ready_timeout_s
        self.procs: dict[str, asyncio.subprocess.Process] = {}
        self.pumps: dict[str, asyncio.Task[None]] = {}

    async def start(self) -> None:
        await asyncio.gather(*(self.respawn(worker_id) for worker_id in self.configs))

    def pid(self, worker_id: str) -> int | None:
        return self.procs[worker_id].pid

    async def wait(self, worker_id: str) -> int:
        return await self.procs[worker_id].wait()

    def mark_dead(self, worker_id: str) -> None:
        pass

    def silent_for(self, worker_id: str) -> float | None:
        return None  # heartbeats go to the router's host; a hung worker is its business

    async def respawn(self, worker_id: str) -> None:
        """A new process for `worker_id`; returns once it printed its READY line."""
        cfg = self.configs[worker_id]
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "hetero_pd.serving.worker.main",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            start_new_session=True,
            env=self.envs[worker_id],
        )
        assert proc.stdin is not None
        proc.stdin.write(cfg.to_json())  # the config on stdin, the credential by environment
        proc.stdin.close()
        self.procs[worker_id] = proc
        line = await asyncio.wait_for(_ready_line(proc), self.ready_timeout_s)
        if not line:
            raise RuntimeError(f"worker {worker_id} exited with code {await proc.wait()}")
        log.info("worker %s ready at %s (pid %s)", worker_id, ready_address(line), proc.pid)
        self.pumps[worker_id] = asyncio.create_task(_pump(proc))

    async def stop(self, grace_s: float) -> None:
        for proc in self.procs.values():
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                await asyncio.wait_for(proc.wait(), grace_s)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        for pump in self.pumps.values():
            pump.cancel()


async def _ready_line(proc: asyncio.subprocess.Process) -> bytes:
    """The worker's READY line, or b"" when it exited first."""
    assert proc.stdout is not None
    while line := await proc.stdout.readline():
        if line.startswith(READY_LINE.encode()):
            return line
    return b""


async def _pump(proc: asyncio.subprocess.Process) -> None:
    """Keeps reading a worker's stdout so its pipe never fills."""
    assert proc.stdout is not None
    while await proc.stdout.readline():
        pass


async def _signalled() -> None:
    event = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, event.set)
    await event.wait()
