"""The two halves of a cluster (Kubernetes) deployment, where nothing is spawned locally:

- `run_pod_worker`: one worker in this process (one pod), bound to 0.0.0.0 on the ports
  derived from `kubernetes.base_port`, advertising its pod's DNS name;
- `keep_connected`: the router's side, connecting to every worker by the address derived
  from the replica counts and reconnecting when a worker pod is replaced.

Addresses come from `hetero_pd.deploy.k8s`; nobody writes one by hand.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

from backends import parse_device_spec
from hetero_pd.deploy import k8s
from hetero_pd.deploy.schema import Deployment
from hetero_pd.deploy.workers import WorkerInstance
from hetero_pd.models.config import ModelConfig
from hetero_pd.serving.launcher import worker_config
from hetero_pd.serving.router import Router
from hetero_pd.serving.worker_config import WorkerConfig

log = logging.getLogger("hetero_pd.cluster")


def parse_replicas(text: str) -> dict[str, int]:
    """`prefill=2,decode=6` -> {"prefill": 2, "decode": 6}."""
    out: dict[str, int] = {}
    for part in filter(None, text.split(",")):
        role, _, count = part.partition("=")
        if role not in ("prefill", "decode", "both") or not count.isdigit():
            raise ValueError(
                f"--replicas: {part!r} is not ROLE=COUNT (roles: prefill, decode, both)"
            )
        out[role] = int(count)
    if not out:
        raise ValueError("--replicas: give at least one ROLE=COUNT")
    return out


def role_device_kind(dep: Deployment, role: str) -> str:
    """The device kind `role`'s pods run on."""
    if dep.pd is not None:
        return parse_device_spec(getattr(dep.pd, f"{role}_device"))[0]
    return k8s.role_kind(dep, role)


def pod_worker_config(dep: Deployment, pod_or_worker_id: str, alive_file: str) -> WorkerConfig:
    """The config of worker `<role>-<n>` of `dep` running in its own pod."""
    wid = k8s.worker_id_of_pod(dep, pod_or_worker_id)
    role, _, n = wid.rpartition("-")
    if role not in ("prefill", "decode", "both") or not n.isdigit():
        raise ValueError(f"--worker-id {pod_or_worker_id!r} is not <role>-<n> (or its pod name)")
    kind = role_device_kind(dep, role)
    device = "cpu" if kind == "cpu" else f"{kind}:0"  # the pod's one device
    base = dep.kubernetes.base_port
    return worker_config(
        dep,
        WorkerInstance(wid, role, device),
        os.cpu_count() or 1,
        host="0.0.0.0",
        port=base,
        transfer_port=base + 1,
        advertise_host=k8s.pod_host(dep, wid),
        alive_file=alive_file,
    )


def run_pod_worker(dep: Deployment, pod_or_worker_id: str, alive_file: str) -> int:
    """Runs that worker in this process until SIGTERM."""
    from hetero_pd.serving.worker import run

    return run(pod_worker_config(dep, pod_or_worker_id, alive_file))


async def keep_connected(router: Router, worker_id: str, address: str) -> None:
    """Connects the router to `worker_id` and connects again whenever its pod is replaced
    (a new process knows no router until it is greeted again)."""
    silent_limit = 2 * router.cfg.heartbeat_timeout_s
    while True:
        client = router.workers.get(worker_id)
        if client is None or client.gone or time.monotonic() - client.last_seen > silent_limit:
            try:
                await router.add_worker(worker_id, address, timeout_s=silent_limit)
                log.info("connected to %s at %s", worker_id, address)
            except TimeoutError:
                log.info("waiting for %s at %s", worker_id, address)
                continue
        await asyncio.sleep(router.cfg.heartbeat_timeout_s)


def max_model_len(dep: Deployment, cfg: ModelConfig) -> int:
    """What the workers will allow, known before any of them answers (the engine's rule)."""
    from hetero_pd.engine.llm_engine import MAX_DEFAULT_MODEL_LEN

    configured = dep.engine.get("max_model_len")
    if configured:
        return int(configured)
    limit = cfg.max_position_embeddings
    if cfg.sliding_window:
        limit = min(limit, cfg.sliding_window)
    return min(limit, MAX_DEFAULT_MODEL_LEN)
