"""Starts a deployment's workers as processes, connects the router to them, watches them.

Each worker prints one READY line with the addresses it bound (ports chosen by the OS), so
no port is configured by hand. A worker that exits is taken out of rotation at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
from dataclasses import dataclass

from hetero_pd.models.fetch import resolve_model
from hetero_pd.serving.deploy_config import Deployment, worker_ids
from hetero_pd.serving.router import Router
from hetero_pd.serving.worker import READY_LINE, WorkerConfig

log = logging.getLogger("hetero_pd.launcher")


@dataclass(slots=True)
class WorkerProcess:
    config: WorkerConfig
    proc: asyncio.subprocess.Process
    address: str = ""
    pump: asyncio.Task[None] | None = None


def worker_configs(dep: Deployment) -> list[WorkerConfig]:
    """One WorkerConfig per worker process, ids like `prefill-0`, `decode-0`, `both-1`."""
    ids = iter(worker_ids(dep.workers))
    threads = max(1, (os.cpu_count() or 1) // sum(w.count for w in dep.workers))
    out = []
    for spec in dep.workers:
        for _ in range(spec.count):
            wid = next(ids)
            engine = {
                "model": dep.model,
                "dtype": dep.dtype,
                "device": spec.device,
                "num_threads": threads,
                **dep.engine,
            }
            out.append(
                WorkerConfig(
                    worker_id=wid,
                    role=spec.role,
                    engine=engine,
                    layerwise=dep.transfer.layerwise,
                    checksum=dep.transfer.checksum,
                    transfer_transports=dep.transfer.transports,
                    transfer_timeout_s=dep.transfer.timeout_s,
                    transfer_grant_s=dep.transfer.grant_s,
                    remote_kv_timeout_s=dep.transfer.remote_kv_timeout_s,
                    transfer_secret=dep.transfer.secret,
                    cpus=spec.cpus,
                    transfer_faults=dep.transfer.faults.get(wid, ()),
                )
            )
    return out


class Launcher:
    def __init__(self, dep: Deployment, router: Router, ready_timeout_s: float = 300.0) -> None:
        self.dep = dep
        self.router = router
        self.ready_timeout_s = ready_timeout_s
        self.procs: dict[str, WorkerProcess] = {}
        self._watch: asyncio.Task[None] | None = None

    async def start(self) -> None:
        resolve_model(self.dep.model)  # fetch once here, not in every worker at the same time
        configs = worker_configs(self.dep)
        try:
            for cfg in configs:
                await self._spawn(cfg)
            await asyncio.gather(*(self._connect(wp) for wp in self.procs.values()))
        except BaseException:
            await self.stop()
            raise
        self._watch = asyncio.create_task(self._watch_processes())

    async def _spawn(self, cfg: WorkerConfig) -> None:
        cmd = [sys.executable, "-m", "hetero_pd.serving.worker", "--config-json", cfg.to_json()]
        proc = await asyncio.create_subprocess_exec(
            *cmd, stdout=asyncio.subprocess.PIPE, start_new_session=True
        )
        self.procs[cfg.worker_id] = WorkerProcess(cfg, proc)

    async def _connect(self, wp: WorkerProcess) -> None:
        assert wp.proc.stdout is not None
        wid = wp.config.worker_id

        async def ready_line() -> str:
            assert wp.proc.stdout is not None
            while True:
                line = (await wp.proc.stdout.readline()).decode()
                if not line:
                    raise RuntimeError(
                        f"worker {wid} exited with code {await wp.proc.wait()} before it was "
                        "ready (its log is above)"
                    )
                if line.startswith(READY_LINE):
                    return line

        line = await asyncio.wait_for(ready_line(), self.ready_timeout_s)
        info = json.loads(line[len(READY_LINE) :])
        wp.address = info["address"]
        wp.pump = asyncio.create_task(self._pump(wp))
        await self.router.add_worker(wid, wp.address)
        log.info("worker %s (%s) ready at %s, pid %s", wid, wp.config.role, wp.address, wp.proc.pid)

    async def _pump(self, wp: WorkerProcess) -> None:
        """Keeps reading a worker's stdout so its pipe never fills."""
        assert wp.proc.stdout is not None
        while await wp.proc.stdout.readline():
            pass

    async def _watch_processes(self) -> None:
        while True:
            await asyncio.sleep(0.2)
            for wid, wp in self.procs.items():
                if wp.proc.returncode is not None:
                    self.router.mark_dead(wid)

    def pids(self) -> dict[str, int]:
        return {wid: wp.proc.pid for wid, wp in self.procs.items()}

    async def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM (workers drain), then SIGKILL whatever is left after `grace_s`."""
        if self._watch is not None:
            self._watch.cancel()
        for wp in self.procs.values():
            if wp.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    wp.proc.send_signal(signal.SIGTERM)
        for wp in self.procs.values():
            try:
                await asyncio.wait_for(wp.proc.wait(), grace_s)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    wp.proc.kill()
                await wp.proc.wait()
            if wp.pump is not None:
                wp.pump.cancel()
