"""`hetero-pd render k8s CONFIG`: the deployment as Kubernetes manifests.

    ConfigMap   <name>-config            the deployment YAML, mounted at /etc/hetero-pd
    Deployment  <name>-router            1 replica: router + REST API on router.port
    Service     <name>-router            ClusterIP/NodePort/LoadBalancer to the API
    StatefulSet <name>-<role>            one per role (prefill, decode, both), N replicas,
                                         one accelerator each (huawei.com/Ascend910 or
                                         nvidia.com/gpu), node selector per device kind
    Service     <name>-<role>            headless: stable DNS for each worker pod

Workers find each other by name, never by a hand-written address: worker `decode-1` is pod
`<name>-decode-1`, reachable as `<name>-decode-1.<name>-decode.<ns>.svc` on
`kubernetes.base_port` (control) and `base_port + 1` (KV transfer). The router is told
the replica counts and derives every address from them (`worker_addresses`).

Probes: the router's are HTTP on `/health` (readiness: a decode worker is up) and
`/health?live=1` (liveness: the process answers). A worker touches `ALIVE_FILE` on every
heartbeat of its main loop; its exec probes fail when the file is older than 15 s, so a
hung loop is restarted even though its ports stay open.
"""

from __future__ import annotations

from typing import Any

import yaml

from backends import parse_device_spec
from hetero_pd.deploy.schema import Deployment, worker_ids
from hetero_pd.deploy.sections import DEVICE_RESOURCES, NODE_SELECTORS

CONFIG_DIR = "/etc/hetero-pd"
CONFIG_PATH = f"{CONFIG_DIR}/deployment.yaml"
MODEL_DIR = "/models"
ALIVE_FILE = "/tmp/hetero-pd/alive"
ALIVE_PROBE = f"test $(( $(date +%s) - $(stat -c %Y {ALIVE_FILE}) )) -lt 15"


def role_counts(dep: Deployment) -> dict[str, int]:
    """Workers per role, in the order roles first appear."""
    counts: dict[str, int] = {}
    for w in dep.workers:
        counts[w.role] = counts.get(w.role, 0) + w.count
    return counts


def role_kind(dep: Deployment, role: str) -> str:
    """The device kind of `role`'s workers (validation makes it one kind per role)."""
    spec = next(w for w in dep.workers if w.role == role)
    return parse_device_spec(spec.devices[0] if spec.devices else spec.device)[0]


def service_name(dep: Deployment, role: str) -> str:
    """The StatefulSet and headless Service of `role`'s workers."""
    return f"{dep.kubernetes.name}-{role}"


def pod_host(dep: Deployment, worker_id: str) -> str:
    """The DNS name of worker `worker_id`'s pod (`prefill-0` -> `<name>-prefill-0.<svc>...`)."""
    role = worker_id.rsplit("-", 1)[0]
    k = dep.kubernetes
    return f"{k.name}-{worker_id}.{service_name(dep, role)}.{k.namespace}.svc"


def worker_addresses(dep: Deployment, counts: dict[str, int]) -> dict[str, str]:
    """Control address of every worker, from the replica count of each role."""
    port = dep.kubernetes.base_port
    ids = [f"{role}-{i}" for role, n in counts.items() for i in range(n)]
    return {wid: f"tcp://{pod_host(dep, wid)}:{port}" for wid in ids}


def worker_id_of_pod(dep: Deployment, pod_name: str) -> str:
    """`<name>-decode-1` (or `decode-1`) -> `decode-1`."""
    prefix = f"{dep.kubernetes.name}-"
    return pod_name[len(prefix) :] if pod_name.startswith(prefix) else pod_name


def _labels(dep: Deployment, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "hetero-pd",
        "app.kubernetes.io/instance": dep.kubernetes.name,
        "app.kubernetes.io/component": component,
    }


def _meta(dep: Deployment, name: str, component: str) -> dict[str, Any]:
    labels = _labels(dep, component)
    return {"name": name, "namespace": dep.kubernetes.namespace, "labels": labels}


def _volumes(dep: Deployment) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    k = dep.kubernetes
    model: dict[str, Any] = (
        {"persistentVolumeClaim": {"claimName": k.model_pvc}} if k.model_pvc else {"emptyDir": {}}
    )
    volumes = [
        {"name": "config", "configMap": {"name": f"{k.name}-config"}},
        {"name": "models", **model},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "models", "mountPath": MODEL_DIR},
    ]
    return volumes, mounts


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


def _container(dep: Deployment, name: str, args: list[str]) -> dict[str, Any]:
    k = dep.kubernetes
    return {
        "name": name,
        "image": k.image,
        "imagePullPolicy": k.image_pull_policy,
        "command": ["hetero-pd", "serve", CONFIG_PATH, *args],
        "env": [
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "HETERO_PD_CACHE_DIR", "value": MODEL_DIR},
        ],
        "volumeMounts": _volumes(dep)[1],
    }


def _router(dep: Deployment, counts: dict[str, int]) -> list[dict[str, Any]]:
    k, port = dep.kubernetes, dep.router.port
    replicas = ",".join(f"{role}={n}" for role, n in counts.items())
    c = _container(dep, "router", ["--role", "router", "--host", "0.0.0.0", "--replicas", replicas])
    c["ports"] = [{"name": "http", "containerPort": port}]
    c["resources"] = {
        "requests": {"cpu": k.router_cpu, "memory": k.router_memory},
        "limits": {"memory": k.router_memory},
    }
    c["startupProbe"] = _http_probe("/health?live=1", 5, 120)
    c["readinessProbe"] = _http_probe("/health", 5, 2)
    c["livenessProbe"] = _http_probe("/health?live=1", 10, 3)
    name = f"{k.name}-router"
    labels = _labels(dep, "router")
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(dep, name, "router"),
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {"containers": [c], "volumes": _volumes(dep)[0]},
            },
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(dep, name, "router"),
        "spec": {
            "type": k.service_type,
            "selector": labels,
            "ports": [{"name": "http", "port": port, "targetPort": "http"}],
        },
    }
    return [deployment, service]


def _workers(dep: Deployment, role: str, replicas: int) -> list[dict[str, Any]]:
    k = dep.kubernetes
    kind = role_kind(dep, role)
    name = service_name(dep, role)
    labels = _labels(dep, role)
    args = ["--role", "worker", "--worker-id", "$(POD_NAME)", "--alive-file", ALIVE_FILE]
    c = _container(dep, "worker", args)
    c["ports"] = [
        {"name": "control", "containerPort": k.base_port},
        {"name": "transfer", "containerPort": k.base_port + 1},
    ]
    requests: dict[str, Any] = {"cpu": k.worker_cpu, "memory": k.worker_memory}
    limits: dict[str, Any] = {"memory": k.worker_memory}
    pod: dict[str, Any] = {"terminationGracePeriodSeconds": 60}
    if kind != "cpu":
        resource = {**DEVICE_RESOURCES, **k.device_resources}[kind]
        requests[resource] = limits[resource] = 1
        pod["nodeSelector"] = {**NODE_SELECTORS, **k.node_selectors}.get(kind, {})
        pod["tolerations"] = [{"key": resource, "operator": "Exists", "effect": "NoSchedule"}]
    c["resources"] = {"requests": requests, "limits": limits}
    c["startupProbe"] = _exec_probe(10, 60)
    c["readinessProbe"] = _exec_probe(5, 2)
    c["livenessProbe"] = _exec_probe(10, 3)
    pod.update({"containers": [c], "volumes": _volumes(dep)[0]})
    ports = [
        {"name": "control", "port": k.base_port, "targetPort": "control"},
        {"name": "transfer", "port": k.base_port + 1, "targetPort": "transfer"},
    ]
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(dep, name, role),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": labels,
            "ports": ports,
        },
    }
    statefulset = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _meta(dep, name, role),
        "spec": {
            "serviceName": name,
            "replicas": replicas,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": pod},
        },
    }
    return [service, statefulset]


def render(dep: Deployment) -> list[dict[str, Any]]:
    """Every manifest of `dep` (whose worker counts must be concrete: see plan.resolve)."""
    if dep.automatic:
        raise ValueError(f"{dep.source}: resolve the automatic P/D counts before rendering")
    if not dep.text:
        raise ValueError(f"{dep.source}: rendering needs the deployment's YAML text")
    counts = role_counts(dep)
    assert sum(counts.values()) == len(worker_ids(dep.workers))
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(dep, f"{dep.kubernetes.name}-config", "config"),
        "data": {"deployment.yaml": dep.text},
    }
    out = [config_map, *_router(dep, counts)]
    for role, n in counts.items():
        out += _workers(dep, role, n)
    return out


class _Dumper(yaml.SafeDumper):
    """No anchors/aliases (shared label dicts), and multi-line strings as `|` blocks."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _str(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
    style = "|" if "\n" in text else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


_Dumper.add_representer(str, _str)


def dump(manifests: list[dict[str, Any]]) -> str:
    """Manifests as one multi-document YAML stream (`kubectl apply -f -` reads it)."""
    return yaml.dump_all(manifests, Dumper=_Dumper, sort_keys=False, default_flow_style=False)
