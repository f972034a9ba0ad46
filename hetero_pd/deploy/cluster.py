"""A deployment across hosts, where the router spawns nothing and finds its workers:

- on Kubernetes (`StatefulSetDNS`): each role's pods are `<name>-<role>-0, -1, ...` behind a
  headless Service; the router resolves those names, ordinal after ordinal, so a
  `kubectl scale` is seen without rendering again, and a name that stops resolving is a pod
  that is gone;
- on bare metal (`HostList`): the file lists each worker's host; its ports follow the list.

`watch_workers` connects the router to whatever discovery finds and connects again when a
worker is replaced (a new process knows no router until it is greeted). `pod_worker_config`
is a pod's own side: the worker binds its pod's IP and advertises its pod's DNS name, both
checked before it starts (`hetero_pd.deploy.addresses`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from backends import parse_device_spec
from backends.cpu import usable_cpus
from hetero_pd.deploy import k8s
from hetero_pd.deploy.addresses import check_advertised
from hetero_pd.deploy.launcher import worker_config
from hetero_pd.deploy.schema import Deployment
from hetero_pd.deploy.workers import WorkerInstance, expand_workers, role_speculative_config
from hetero_pd.models.config import ModelConfig
from hetero_pd.serving.router.router import Router
from hetero_pd.serving.worker.config import WorkerConfig

log = logging.getLogger("hetero_pd.cluster")
Discover = Callable[[], Awaitable[dict[str, str]]]
Serve = Callable[[Deployment, Discover], Coroutine[Any, Any, None]]
#: Ordinals probed past the last pod found (Parallel scale-up creates them all at once).
LOOKAHEAD = 4
#: Rounds a worker must stay unresolvable before it counts as gone (DNS hiccups).
GONE_AFTER = 3


def role_device_kind(dep: Deployment, role: str) -> str:
    """The device kind `role`'s pods run on."""
    if dep.pd is not None:
        return parse_device_spec(getattr(dep.pd, f"{role}_device"))[0]
    return k8s.role_kind(dep, role)


def pod_worker_config(
    dep: Deployment, pod_or_worker_id: str, alive_file: str, host: str
) -> WorkerConfig:
    """The config of worker `<role>-<n>` of `dep` in its own pod, bound to `host` (its pod's
    IP) on the ports derived from `kubernetes.base_port`."""
    worker_id = k8s.worker_id_of_pod(dep, pod_or_worker_id)
    role, _, n = worker_id.rpartition("-")
    if role not in ("prefill", "decode", "both") or not n.isdigit():
        raise ValueError(f"--worker-id {pod_or_worker_id!r} is not <role>-<n> (or its pod name)")
    kind = role_device_kind(dep, role)
    device = "cpu" if kind == "cpu" else f"{kind}:0"  # the pod's one device
    base = dep.kubernetes.base_port
    return worker_config(
        dep,
        WorkerInstance(
            worker_id,
            role,
            device,
            tensor_parallel_size=k8s.role_tensor_parallel_size(dep, role),
            speculative_config=role_speculative_config(dep.workers, role),
        ),
        usable_cpus(),  # its affinity and its CPU limit (cgroup quota)
        host=host,
        port=base,
        transfer_port=base + 1,
        data_port=base + 2,
        advertise_host=k8s.pod_host(dep, worker_id),
        alive_file=alive_file,
    )


def run_pod_worker(dep: Deployment, pod_or_worker_id: str, alive_file: str, host: str) -> int:
    """Runs that worker in this process until SIGTERM, once its addresses check out."""
    from hetero_pd.serving.worker.main import run

    cfg = pod_worker_config(dep, pod_or_worker_id, alive_file, host)
    check_advertised(cfg.host, cfg.advertise_host, f"worker {cfg.worker_id}")
    return run(cfg)


class StatefulSetDNS:
    """Kubernetes: worker id -> control address of every pod whose DNS name resolves."""

    def __init__(self, dep: Deployment) -> None:
        self.dep = dep
        self.roles = list(k8s.role_counts(dep))

    async def __call__(self) -> dict[str, str]:
        found: dict[str, str] = {}
        for role in self.roles:
            n, misses = 0, 0
            while misses <= LOOKAHEAD and n < 256:
                worker_id = f"{role}-{n}"
                if await _resolves(k8s.pod_host(self.dep, worker_id)):
                    found[worker_id] = k8s.worker_address(self.dep, worker_id)
                    misses = 0
                else:
                    misses += 1
                n += 1
        return found


class HostList:
    """Bare metal: every worker the file lists, at its host's address."""

    def __init__(self, dep: Deployment) -> None:
        self.addresses = {w.worker_id: w.address for w in expand_workers(dep.workers)}

    async def __call__(self) -> dict[str, str]:
        return dict(self.addresses)


async def watch_workers(router: Router, discover: Discover, interval_s: float) -> None:
    """Keeps the router connected to every worker `discover` finds, until cancelled."""
    tasks: dict[str, asyncio.Task[None]] = {}
    missing: dict[str, int] = {}
    try:
        while True:
            found = await discover()
            for worker_id, address in found.items():
                missing.pop(worker_id, None)
                if worker_id not in tasks:
                    log.info("found worker %s at %s", worker_id, address)
                    tasks[worker_id] = asyncio.create_task(
                        keep_connected(router, worker_id, address)
                    )
            for worker_id in [w for w in tasks if w not in found]:
                missing[worker_id] = missing.get(worker_id, 0) + 1
                if missing[worker_id] >= GONE_AFTER:
                    log.info("worker %s is gone (its name no longer resolves)", worker_id)
                    tasks.pop(worker_id).cancel()
                    router.mark_dead(worker_id)
            await asyncio.sleep(interval_s)
    finally:
        for task in tasks.values():
            task.cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)


async def keep_connected(router: Router, worker_id: str, address: str) -> None:
    """Connects the router to `worker_id` and connects again whenever it is replaced."""
    silent_limit = 2 * router.cfg.heartbeat_timeout_s
    while True:
        client = router.workers.get(worker_id)
        if client is None or client.gone or time.monotonic() - client.last_seen > silent_limit:
            try:
                await router.add_worker(worker_id, address, timeout_s=silent_limit)
            except TimeoutError:
                log.info("waiting for %s at %s", worker_id, address)
                continue
            claimed = router.workers[worker_id].info.address
            if claimed != address:  # another worker answered: a name leads to the wrong host
                log.error(
                    "%s: %s answered as %s; a DNS record or an advertised address is wrong, "
                    "so it stays out of rotation",
                    worker_id,
                    address,
                    claimed,
                )
                router.mark_dead(worker_id)
            else:
                log.info("connected to %s at %s", worker_id, address)
        await asyncio.sleep(router.cfg.heartbeat_timeout_s)


async def _resolves(name: str) -> bool:
    loop = asyncio.get_running_loop()
    with contextlib.suppress(OSError, UnicodeError):
        await loop.getaddrinfo(name, None, type=socket.SOCK_STREAM)
        return True
    return False


def max_model_len(dep: Deployment, cfg: ModelConfig) -> int:
    """What the workers will allow, known before any of them answers (the engine's rule)."""
    from hetero_pd.engine.loading import MAX_DEFAULT_MODEL_LEN

    if dep.engine.max_model_len is not None:
        return dep.engine.max_model_len
    limit = cfg.max_position_embeddings
    if cfg.sliding_window:
        limit = min(limit, cfg.sliding_window)
    return min(limit, MAX_DEFAULT_MODEL_LEN)


def run_part(dep: Deployment, args: argparse.Namespace, serve: Serve) -> int:
    """`hetero-pd serve` of one part of a deployment across hosts: a pod's worker
    (`--role worker`), the router (`--role router`), or a bare-metal host's part
    (`--host-id`). Secrets come by environment (a Secret, or the operator): the API keys
    through `serve`'s own HETERO_PD_API_KEY reading, the deployment secret read by every
    process itself (`hetero_pd.secrets`)."""
    if args.role == "worker":
        return run_pod_worker(dep, args.worker_id, args.alive_file, args.host)
    if args.role == "router":
        asyncio.run(serve(dep, discovery(dep)))
        return 0
    from hetero_pd.deploy.hosts import run_host

    return run_host(dep, args.host_id, lambda: serve(dep, discovery(dep)))


def discovery(dep: Deployment) -> Discover:
    """How the router finds `dep`'s workers: the host list, else the StatefulSets' DNS."""
    return HostList(dep) if any(w.host for w in dep.workers) else StatefulSetDNS(dep)
