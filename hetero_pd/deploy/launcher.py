"""Starts a deployment's workers as processes, connects the router to them, supervises them.

Each worker prints one READY line with the addresses it bound (ports chosen by the OS), so
no port is configured by hand. A worker that exits is taken out of rotation at once and
restarted with backoff; stopping SIGTERMs, then SIGKILLs, and reaps every worker.

A worker gets its config as JSON on stdin and its credential in its environment
(`HETERO_PD_WORKER_KEY`; never the deployment secret): nothing secret is ever on a command
line.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from backends.cpu import usable_cpus
from hetero_pd import envs, omp_wait_defaults, secrets
from hetero_pd.deploy.cpu_board import remove_cpu_board, with_cpu_board
from hetero_pd.deploy.forkserver import ForkedProcess, start_worker
from hetero_pd.deploy.formats import worker_format
from hetero_pd.deploy.schema import Deployment
from hetero_pd.deploy.sections import SupervisorSpec
from hetero_pd.deploy.supervisor import Supervisor
from hetero_pd.deploy.workers import WorkerInstance, expand_workers
from hetero_pd.models.fetch import resolve_model
from hetero_pd.serving.router.migration import summary
from hetero_pd.serving.router.router import Router
from hetero_pd.serving.worker.config import WorkerConfig
from hetero_pd.serving.worker.main import READY_LINE, ready_address

log = logging.getLogger("hetero_pd.launcher")


@dataclass(slots=True)
class WorkerProcess:
    config: WorkerConfig
    proc: asyncio.subprocess.Process | ForkedProcess
    address: str = ""
    pump: asyncio.Task[None] | None = None


def worker_configs(dep: Deployment) -> list[WorkerConfig]:
    """One WorkerConfig per worker process, ids like `prefill-0`, `decode-0`, `both-1`, each
    on the device the deployment assigns it (`cuda` -> the next free `cuda:N`)."""
    instances = expand_workers(dep.workers)
    cpus = usable_cpus()
    return [worker_config(dep, w, *thread_counts(w, cpus, len(instances))) for w in instances]


def thread_counts(w: WorkerInstance, cpus: int, workers: int) -> tuple[int, int | None]:
    """Worker `w`'s threads at most and at first (None: the same), one of `workers` on a
    host where this process may use `cpus` CPUs. A pinned worker's threads are its cores:
    more would fight over them. Unpinned workers share the host's CPUs: each starts at its
    share and may use them all while the others leave them idle (a decode worker once the
    prompts are in), backends/cpu_share.py."""
    if w.cpus:
        return len(w.cpus), None
    return cpus, max(1, cpus // workers)


def worker_config(
    dep: Deployment,
    w: WorkerInstance,
    threads: int,
    initial_threads: int | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    transfer_port: int = 0,
    data_port: int = 0,
    **extra: Any,
) -> WorkerConfig:
    """The WorkerConfig of worker `w` of `dep` (`extra` sets fields such as alive_file):
    `threads` at most, `initial_threads` at first (None: `threads`)."""
    e = dep.engine
    if e.num_threads is not None:  # a count the deployment sets is what the workers run
        threads, initial_threads = e.num_threads, None
    if e.initial_threads is not None:
        initial_threads = e.initial_threads
    elif initial_threads == threads:
        initial_threads = None
    fmt = worker_format(dep, w.worker_id, w.role)
    if e.num_threads is None and w.tensor_parallel_size > 1:  # the ranks share the share
        threads = max(1, threads // w.tensor_parallel_size)
        initial_threads = initial_threads and max(1, initial_threads // w.tensor_parallel_size)
    engine = e.engine_config(
        dep.model,
        w.device,
        num_threads=threads,
        initial_threads=initial_threads,
        dtype=fmt.dtype,
        kv_layout=fmt.kv_layout,
        tensor_parallel_size=w.tensor_parallel_size,
        speculative_config=w.speculative_config,
        # layers [k, L) on hidden states: the workers then serve edge sessions only
        start_layer=dep.edge.split_layer if dep.edge and dep.edge.enabled else e.start_layer,
    )
    return WorkerConfig(
        worker_id=w.worker_id,
        role=w.role,  # type: ignore[arg-type]
        engine=engine,
        transfer=dep.transfer.transfer_config(w.worker_id, host, transfer_port, data_port),
        host=host,
        port=port,
        layerwise=dep.transfer.layerwise,
        remote_kv_timeout_s=dep.transfer.remote_kv_timeout_s,
        cpus=w.cpus,
        step_faults=dep.transfer.step_faults(w.worker_id),
        **extra,
    )


def forks(spec: SupervisorSpec) -> bool:
    """Whether workers are forked from the fork server: `supervisor.fork_server` where the
    deployment says, else $HETERO_PD_FORK_SERVER (the test suite's default)."""
    return envs.fork_server() if spec.fork_server is None else spec.fork_server


class Launcher:
    """Starts the workers, then supervises them (`hetero_pd.deploy.supervisor`): a worker
    that exits is taken out of rotation at once and restarted with backoff."""

    def __init__(
        self,
        dep: Deployment,
        router: Router,
        secret: bytes,
        ready_timeout_s: float | None = None,
    ):
        self.dep = dep
        self.router = router
        self.secret = secret
        self.ready_timeout_s = ready_timeout_s or dep.supervisor.ready_timeout_s
        self.procs: dict[str, WorkerProcess] = {}
        self.supervisor = Supervisor(self, router, dep.supervisor)
        router.follow_supervision(self.supervisor.states)
        self._cpu_board: Path | None = None

    async def start(self) -> None:
        resolve_model(self.dep.model)  # fetch once here, not in every worker at the same time
        configs, self._cpu_board = with_cpu_board(worker_configs(self.dep))
        try:
            for cfg in configs:
                await self._spawn(cfg)
            await asyncio.gather(*(self._connect(wp) for wp in self.procs.values()))
        except BaseException:
            await self.stop()
            raise
        self.supervisor.watch(list(self.procs))

    async def _spawn(self, cfg: WorkerConfig) -> None:
        """Starts worker `cfg`: `python -m hetero_pd.serving.worker.main`, or forked from
        this process's fork server (supervisor.fork_server, hetero_pd/deploy/forkserver.py).
        Either way it watches its parent's pid and stops when that parent is gone."""
        env = secrets.worker_environment(dict(os.environ), self.secret, [cfg.worker_id])
        # how idle OpenMP threads wait (hetero_pd/__init__.py; set in the environment so a
        # worker's log of it is true)
        omp_wait_defaults(env)
        if forks(self.dep.supervisor):
            forked, parent = await start_worker(
                env, lambda pid: replace(cfg, parent_pid=pid).to_json(), (secrets.WORKER_ENV,)
            )
            self.procs[cfg.worker_id] = WorkerProcess(replace(cfg, parent_pid=parent), forked)
            return
        cfg = replace(cfg, parent_pid=os.getpid())
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "hetero_pd.serving.worker.main",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            start_new_session=True,
            env=env,
        )
        assert proc.stdin is not None
        proc.stdin.write(cfg.to_json())
        proc.stdin.close()
        self.procs[cfg.worker_id] = WorkerProcess(cfg, proc)

    async def _connect(self, wp: WorkerProcess) -> None:
        assert wp.proc.stdout is not None
        worker_id = wp.config.worker_id

        async def ready_line() -> str:
            assert wp.proc.stdout is not None
            while True:
                line = (await wp.proc.stdout.readline()).decode()
                if not line:
                    raise RuntimeError(
                        f"worker {worker_id} exited with code {await wp.proc.wait()} before it was "
                        "ready (its log is above)"
                    )
                if line.startswith(READY_LINE):
                    return line

        line = await asyncio.wait_for(ready_line(), self.ready_timeout_s)
        wp.address = ready_address(line)
        wp.pump = asyncio.create_task(self._pump(wp))
        await self.router.add_worker(worker_id, wp.address)  # replaces a previous client
        log.info(
            "worker %s (%s) ready at %s, pid %s", worker_id, wp.config.role, wp.address, wp.proc.pid
        )

    async def _pump(self, wp: WorkerProcess) -> None:
        """Keeps reading a worker's stdout so its pipe never fills."""
        assert wp.proc.stdout is not None
        while await wp.proc.stdout.readline():
            pass

    # -- what the supervisor uses --------------------------------------------------------
    def pid(self, worker_id: str) -> int | None:
        return self.procs[worker_id].proc.pid

    async def wait(self, worker_id: str) -> int:
        return await self.procs[worker_id].proc.wait()

    async def respawn(self, worker_id: str) -> None:
        """A fresh process for `worker_id` (same config), connected in place of the old one."""
        old = self.procs[worker_id]
        if old.pump is not None:
            old.pump.cancel()
        await self._spawn(old.config)
        wp = self.procs[worker_id]
        try:
            await self._connect(wp)
        except BaseException:
            await _terminate(wp, 0.0)
            raise

    async def switch_role(self, worker_id: str, role: str) -> None:
        """Drains `worker_id` and switches it to `role`; a later restart keeps the new role."""
        await self.router.switch_role(worker_id, role)
        wp = self.procs[worker_id]
        wp.config = replace(wp.config, role=role)  # type: ignore[arg-type]

    async def restart(self, worker_id: str, timeout_s: float = 300.0) -> dict[str, Any]:
        """Restarts `worker_id` without ending a request: new requests keep off it, its
        decoding requests move to other decode workers (live migration) and its prompts
        in flight finish, then it stops and a fresh process takes its place. Raises
        RuntimeError when requests could not leave it within `timeout_s` (it keeps serving)."""
        return await self._leave(worker_id, timeout_s, restart=True)

    async def remove(self, worker_id: str, timeout_s: float = 300.0) -> dict[str, Any]:
        """Scale-down: `worker_id` leaves for good once its requests moved (as `restart`,
        without the fresh process). Raises ValueError for the last decode-capable worker."""
        others = [w for w in self.router.live("decode", "both") if w.worker_id != worker_id]
        client = self.router.workers.get(worker_id)
        if client is not None and client.role in ("decode", "both") and not others:
            raise ValueError(f"{worker_id} is the last decode-capable worker")
        return await self._leave(worker_id, timeout_s, restart=False)

    async def _leave(self, worker_id: str, timeout_s: float, restart: bool) -> dict[str, Any]:
        migrator = self.router.migrator
        wp = self.procs.get(worker_id)
        if wp is None or wp.proc.returncode is not None:
            raise ValueError(f"no running worker {worker_id!r} in this deployment")
        try:
            moved = await migrator.drain(worker_id, timeout_s)
            left = migrator.on_worker(worker_id)
            if left:
                raise RuntimeError(f"{len(left)} requests could not leave {worker_id}")
            old = wp.proc.pid
            if restart:
                self.supervisor.expect_exit(worker_id)
            else:
                self.supervisor.expect_removal(worker_id)
            with contextlib.suppress(ProcessLookupError):
                wp.proc.send_signal(signal.SIGTERM)  # drained: it exits at once
            deadline = time.monotonic() + timeout_s
            while not (self._back(worker_id, old) if restart else wp.proc.returncode is not None):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{worker_id} did not stop or come back in {timeout_s}s")
                await asyncio.sleep(0.05)
        finally:
            if restart:
                migrator.undrain(worker_id)
        return {"worker": worker_id, **summary(moved)}

    def _back(self, worker_id: str, old_pid: int) -> bool:
        client = self.router.workers.get(worker_id)
        wp = self.procs[worker_id]
        return wp.proc.pid != old_pid and client is not None and client.alive

    async def rolling_restart(self, timeout_s: float = 300.0) -> list[dict[str, Any]]:
        """Restarts every worker, one at a time (`restart`)."""
        return [await self.restart(worker_id, timeout_s) for worker_id in list(self.procs)]

    async def restart_any(self, worker_id: str | None, timeout_s: float) -> Any:
        """`restart(worker_id)`, or with None `rolling_restart` (the admin API's)."""
        if worker_id is None:
            return await self.rolling_restart(timeout_s)
        return await self.restart(worker_id, timeout_s)

    def pids(self) -> dict[str, int]:
        return {worker_id: wp.proc.pid for worker_id, wp in self.procs.items()}

    async def stop(self, grace_s: float | None = None) -> None:
        """Stops supervising, SIGTERMs every worker (they drain), SIGKILLs any left after
        `grace_s` (default: supervisor.stop_grace_s) and reaps them all: no orphan is left."""
        await self.supervisor.stop()
        grace = self.dep.supervisor.stop_grace_s if grace_s is None else grace_s
        for wp in self.procs.values():
            if wp.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    wp.proc.send_signal(signal.SIGTERM)
        await asyncio.gather(*(_terminate(wp, grace) for wp in self.procs.values()))
        remove_cpu_board(self._cpu_board)


async def _terminate(wp: WorkerProcess, grace_s: float) -> None:
    """Waits up to `grace_s` for `wp` to exit after its SIGTERM, then kills and reaps it."""
    try:
        await asyncio.wait_for(wp.proc.wait(), grace_s)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            wp.proc.kill()
        await wp.proc.wait()
    if wp.pump is not None:
        wp.pump.cancel()
