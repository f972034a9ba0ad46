"""`hetero-pd render k8s CONFIG`: the deployment as Kubernetes manifests.

    ConfigMap     <name>-config    the deployment YAML (without secrets), at /etc/hetero-pd
    Secret        <name>-secrets   deployment secret + API keys (hetero_pd.deploy.k8s_secrets)
    Deployment    <name>-router    1 replica: router + REST API on router.port (+ the edge
                                   sessions' TLS listener on edge.port, with an edge section)
    Service       <name>-router    ClusterIP/NodePort/LoadBalancer to the API
    StatefulSet   <name>-<role>    one per role (prefill, decode, both), N replicas, one
                                   accelerator each, node selector per device kind, the image
                                   of that kind (`kubernetes.images`)
    Service       <name>-<role>    headless: stable DNS for each worker pod
    NetworkPolicy <name>-workers   worker ports: only this deployment's pods may connect

Workers find each other by name, never by a hand-written address: worker `decode-1` is pod
`<name>-decode-1`, reachable as `<name>-decode-1.<name>-decode.<ns>.svc` on
`kubernetes.base_port` (control), `base_port + 1` (KV transfer) and `base_port + 2` (the
transfer's data channel). The router discovers
the workers by resolving those names (ordinals 0, 1, ... of each StatefulSet), so
`kubectl scale` is seen without rendering again (`hetero_pd.deploy.cluster`).

Probes: the router's are HTTP on `/health` (readiness: a decode worker is up) and
`/health?live=1` (liveness: the process answers). A worker touches `ALIVE_FILE` on every
heartbeat of its main loop; its exec probes fail when the file is older than 15 s, so a
hung loop is restarted even though its ports stay open. Every pod template carries a
checksum of the file and the secrets, so a change rolls the pods.
"""

from __future__ import annotations

from typing import Any

import yaml

from backends import parse_device_spec
from hetero_pd.deploy import k8s_pods, k8s_secrets
from hetero_pd.deploy.k8s_pods import ALIVE_FILE, CONFIG_PATH, MODEL_DIR
from hetero_pd.deploy.k8s_secrets import SecretValues
from hetero_pd.deploy.schema import Deployment
from hetero_pd.deploy.workers import worker_ids

__all__ = ["ALIVE_FILE", "CONFIG_PATH", "MODEL_DIR", "render"]


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


def role_tensor_parallel_size(dep: Deployment, role: str) -> int:
    """The tensor_parallel_size of `role`'s workers: the devices each pod requests."""
    return next(w.tensor_parallel_size for w in dep.workers if w.role == role)


def service_name(dep: Deployment, role: str) -> str:
    """The StatefulSet and headless Service of `role`'s workers."""
    return f"{dep.kubernetes.name}-{role}"


def pod_host(dep: Deployment, worker_id: str) -> str:
    """The DNS name of worker `worker_id`'s pod (`prefill-0` -> `<name>-prefill-0.<svc>...`)."""
    role = worker_id.rsplit("-", 1)[0]
    k = dep.kubernetes
    return f"{k.name}-{worker_id}.{service_name(dep, role)}.{k.namespace}.svc"


def worker_address(dep: Deployment, worker_id: str) -> str:
    """The control address of worker `worker_id`'s pod (by DNS name)."""
    return f"tcp://{pod_host(dep, worker_id)}:{dep.kubernetes.base_port}"


def worker_id_of_pod(dep: Deployment, pod_name: str) -> str:
    """`<name>-decode-1` (or `decode-1`) -> `decode-1`."""
    prefix = f"{dep.kubernetes.name}-"
    return pod_name[len(prefix) :] if pod_name.startswith(prefix) else pod_name


def pod_name(dep: Deployment, worker_id: str) -> str:
    """`decode-1` -> `<name>-decode-1` (StatefulSet `<name>-decode`, ordinal 1)."""
    return f"{dep.kubernetes.name}-{worker_id}"


def labels(dep: Deployment, component: str) -> dict[str, str]:
    return {**_instance(dep), "app.kubernetes.io/component": component}


def _instance(dep: Deployment) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "hetero-pd",
        "app.kubernetes.io/instance": dep.kubernetes.name,
    }


def _meta(dep: Deployment, name: str, component: str) -> dict[str, Any]:
    return {"name": name, "namespace": dep.kubernetes.namespace, "labels": labels(dep, component)}


def _template(dep: Deployment, component: str, spec: dict[str, Any], sum_: str) -> dict[str, Any]:
    meta = {
        "labels": labels(dep, component),
        "annotations": {k8s_secrets.CHECKSUM_ANNOTATION: sum_},
    }
    return {"metadata": meta, "spec": spec}


def _router(dep: Deployment, checksum: str) -> list[dict[str, Any]]:
    k, port = dep.kubernetes, dep.router.port
    name = f"{k.name}-router"
    spec = {**k8s_pods.pod_defaults(dep, "router"), "containers": [k8s_pods.router_container(dep)]}
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(dep, name, "router"),
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels(dep, "router")},
            "template": _template(dep, "router", spec, checksum),
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(dep, name, "router"),
        "spec": {
            "type": k.service_type,
            "selector": labels(dep, "router"),
            "ports": [{"name": "http", "port": port, "targetPort": "http"}]
            + [{"name": "edge", "port": p, "targetPort": "edge"} for p in k8s_pods.edge_port(dep)],
        },
    }
    return [deployment, service]


def _workers(dep: Deployment, role: str, replicas: int, checksum: str) -> list[dict[str, Any]]:
    k = dep.kubernetes
    name = service_name(dep, role)
    ports = [
        {"name": "control", "port": k.base_port, "targetPort": "control"},
        {"name": "transfer", "port": k.base_port + 1, "targetPort": "transfer"},
        {"name": "data", "port": k.base_port + 2, "targetPort": "data"},
    ]
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(dep, name, role),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": labels(dep, role),
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
            "selector": {"matchLabels": labels(dep, role)},
            "template": _template(
                dep,
                role,
                k8s_pods.worker_pod(
                    dep, role, role_kind(dep, role), role_tensor_parallel_size(dep, role)
                ),
                checksum,
            ),
        },
    }
    return [service, statefulset]


def render(dep: Deployment, values: SecretValues | None = None) -> list[dict[str, Any]]:
    """Every manifest of `dep` (whose worker counts must be concrete: see plan.resolve).
    `values`: the Secret's content (default: `k8s_secrets.secret_values(dep)`)."""
    if dep.automatic:
        raise ValueError(f"{dep.source}: resolve the automatic P/D counts before rendering")
    if not dep.text:
        raise ValueError(f"{dep.source}: rendering needs the deployment's YAML text")
    k = dep.kubernetes
    counts = role_counts(dep)
    assert sum(counts.values()) == len(worker_ids(dep.workers))
    text = k8s_secrets.config_text(dep)
    if k.existing_secret:
        values = None
    elif values is None:
        values = k8s_secrets.secret_values(dep)
    checksum = k8s_secrets.checksum(text, values)
    out: list[dict[str, Any]] = [
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": _meta(dep, f"{k.name}-config", "config"),
            "data": {"deployment.yaml": text},
        }
    ]
    if values is not None:
        meta = _meta(dep, k8s_secrets.secret_name(dep), "secrets")
        out.append(k8s_secrets.secret_manifest(dep, values, meta))
    out += _router(dep, checksum)
    for role, n in counts.items():
        out += _workers(dep, role, n, checksum)
    if k.network_policy:
        meta = _meta(dep, f"{k.name}-workers", "network-policy")
        out.append(k8s_secrets.network_policy(dep, meta, _instance(dep)))
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
