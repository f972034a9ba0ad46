"""The pods of a rendered deployment: the router's Deployment and one StatefulSet per role.

Every container runs as the image's non-root user with a read-only root filesystem; what it
writes goes to emptyDirs (`/tmp`, and `/dev/shm` backed by memory for the shm transport).
A worker binds its pod's IP (`--host $(POD_IP)`), which is also the address its transfer
data channel advertises, and is reached by its stable DNS name for control. Accelerator
pods add the device resource, node selector, toleration, `runtimeClassName` and the
driver's host paths (`kubernetes.host_mounts`) of their kind.
"""

from __future__ import annotations

import math
from typing import Any

from hetero_pd.deploy import k8s_secrets
from hetero_pd.deploy.schema import Deployment
from hetero_pd.deploy.sections import DEVICE_RESOURCES, NODE_SELECTORS

CONFIG_DIR = "/etc/hetero-pd"
CONFIG_PATH = f"{CONFIG_DIR}/deployment.yaml"
MODEL_DIR = "/models"
ALIVE_FILE = "/tmp/hetero-pd/alive"
PRIVATE_DIR = "/tmp"
COMPILE_CACHE_DIR = f"{PRIVATE_DIR}/hetero-pd/compile"
ALIVE_PROBE = f"test $(( $(date +%s) - $(stat -c %Y {ALIVE_FILE}) )) -lt 15"
#: The image's user (docker/Dockerfile.*); Ascend's driver group HwHiAiUser is 1000 too.
USER_ID = 1000
#: A worker pod's termination grace beyond `supervisor.stop_grace_s` (its worker's time to
#: drain), for the process's own exit; and the least grace a worker pod gets.
STOP_SLACK_S, MIN_GRACE_S = 30, 60


def worker_grace_s(dep: Deployment) -> int:
    """terminationGracePeriodSeconds of a worker pod. Its SIGTERM makes the worker drain:
    it takes no new request and says so in its heartbeat, on which the router live-migrates
    its decoding requests to the other decode workers (no preStop hook calling the router's
    /admin/drain: that would put an operator key, able to drain every worker, in every
    worker pod); requests that cannot move (n > 1, edge) finish there within
    `supervisor.stop_grace_s`, after which the pod's process kills the worker."""
    return max(MIN_GRACE_S, math.ceil(dep.supervisor.stop_grace_s) + STOP_SLACK_S)


def image(dep: Deployment, kind: str) -> str:
    """The image for the router (`kind="router"`) or for workers on device `kind`."""
    return dep.kubernetes.images.get(kind, dep.kubernetes.image)


def container(
    dep: Deployment, name: str, kind: str, args: list[str], env: list[dict[str, Any]]
) -> dict[str, Any]:
    k = dep.kubernetes
    return {
        "name": name,
        "image": image(dep, kind),
        "imagePullPolicy": k.image_pull_policy,
        "command": ["hetero-pd", "serve", CONFIG_PATH, *args],
        "env": [
            *_field_env("POD_NAME", "metadata.name"),
            {"name": "HETERO_PD_CACHE_DIR", "value": MODEL_DIR},
            {"name": "HOME", "value": "/tmp"},  # the root filesystem is read-only
            # compiled code each pod loads stays its own (every pod is one uid on /models)
            {"name": "HETERO_PD_COMPILE_CACHE_DIR", "value": COMPILE_CACHE_DIR},
            # the pod's own /tmp (an emptyDir: 0777, not sticky, no other uid in the pod)
            {"name": "HETERO_PD_PRIVATE_DIR", "value": PRIVATE_DIR},
            *env,
        ],
        "volumeMounts": _mounts(dep, kind),
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]},
        },
    }


def edge_port(dep: Deployment) -> list[int]:
    """The router's edge listener port (`edge.tls`), if it has one: edge sessions over TLS.
    On a cluster give `edge.tls_cert` / `edge.tls_key` (a certificate for the name devices
    dial): a generated one names only the pod."""
    edge = dep.edge
    return [edge.port] if edge is not None and edge.enabled and edge.tls else []


def router_container(dep: Deployment) -> dict[str, Any]:
    k, port = dep.kubernetes, dep.router.port
    env = k8s_secrets.secret_env(dep, "router")
    c = container(dep, "router", "router", ["--role", "router", "--host", "0.0.0.0"], env)
    c["ports"] = [{"name": "http", "containerPort": port}]
    c["ports"] += [{"name": "edge", "containerPort": p} for p in edge_port(dep)]
    c["resources"] = {
        "requests": {"cpu": k.router_cpu, "memory": k.router_memory},
        "limits": {"memory": k.router_memory},
    }
    c["startupProbe"] = _http_probe("/health?live=1", 5, 120)
    c["readinessProbe"] = _http_probe("/health", 5, 2)
    c["livenessProbe"] = _http_probe("/health?live=1", 10, 3)
    return c


def worker_pod(dep: Deployment, role: str, kind: str, devices: int = 1) -> dict[str, Any]:
    """The pod template spec of a `role` worker on `devices` devices of `kind` (more than
    one: a tensor-parallel worker, its ranks in the pod)."""
    k = dep.kubernetes
    args = ["--role", "worker", "--worker-id", "$(POD_NAME)", "--host", "$(POD_IP)"]
    args += ["--alive-file", ALIVE_FILE]
    env = [*_field_env("POD_IP", "status.podIP"), *k8s_secrets.secret_env(dep, role)]
    c = container(dep, "worker", kind, args, env)
    c["ports"] = [
        {"name": "control", "containerPort": k.base_port},
        {"name": "transfer", "containerPort": k.base_port + 1},
        {"name": "data", "containerPort": k.base_port + 2},
    ]
    requests: dict[str, Any] = {"cpu": k.worker_cpu, "memory": k.worker_memory}
    limits: dict[str, Any] = {"memory": k.worker_memory}
    pod: dict[str, Any] = {"terminationGracePeriodSeconds": worker_grace_s(dep)}
    if kind != "cpu":
        resource = {**DEVICE_RESOURCES, **k.device_resources}[kind]
        requests[resource] = limits[resource] = devices
        pod["nodeSelector"] = {**NODE_SELECTORS, **k.node_selectors}.get(kind, {})
        pod["tolerations"] = [{"key": resource, "operator": "Exists", "effect": "NoSchedule"}]
    if kind in k.runtime_classes:
        pod["runtimeClassName"] = k.runtime_classes[kind]
    c["resources"] = {"requests": requests, "limits": limits}
    c["startupProbe"] = _exec_probe(10, 60)
    c["readinessProbe"] = _exec_probe(5, 2)
    c["livenessProbe"] = _exec_probe(10, 3)
    return {**pod, **pod_defaults(dep, kind), "containers": [c]}


def pod_defaults(dep: Deployment, kind: str) -> dict[str, Any]:
    """What every pod spec of the deployment shares: user, volumes, no API token."""
    return {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": USER_ID,
            "runAsGroup": USER_ID,
            "fsGroup": USER_ID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "volumes": _volumes(dep, kind),
    }


def _field_env(name: str, path: str) -> list[dict[str, Any]]:
    return [{"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}]


def _host_paths(dep: Deployment, kind: str) -> tuple[str, ...]:
    return dep.kubernetes.host_mounts.get(kind, ()) if kind != "router" else ()


def _volumes(dep: Deployment, kind: str) -> list[dict[str, Any]]:
    k = dep.kubernetes
    model: dict[str, Any] = (
        {"persistentVolumeClaim": {"claimName": k.model_pvc}} if k.model_pvc else {"emptyDir": {}}
    )
    volumes = [
        {"name": "config", "configMap": {"name": f"{k.name}-config"}},
        {"name": "models", **model},
        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": k.shm_size}},
        {"name": "tmp", "emptyDir": {}},
    ]
    for i, path in enumerate(_host_paths(dep, kind)):
        volumes.append({"name": f"host-{i}", "hostPath": {"path": path}})
    return volumes


def _mounts(dep: Deployment, kind: str) -> list[dict[str, Any]]:
    mounts: list[dict[str, Any]] = [
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "models", "mountPath": MODEL_DIR},
        {"name": "shm", "mountPath": "/dev/shm"},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    for i, path in enumerate(_host_paths(dep, kind)):
        mounts.append({"name": f"host-{i}", "mountPath": path, "readOnly": True})
    return mounts


def _exec_probe(period: int, failures: int) -> dict[str, Any]:
    return {
        "exec": {"command": ["sh", "-c", ALIVE_PROBE]},
        "periodSeconds": period,
        "failureThreshold": failures,
    }


def _http_probe(path: str, period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period,
        "failureThreshold": failures,
    }
