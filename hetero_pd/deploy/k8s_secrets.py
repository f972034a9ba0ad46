"""What guards a deployment on Kubernetes: its Secret, the NetworkPolicy on worker ports, and
the checksum that rolls the pods when either the file or the secrets change.

    Secret <name>-secrets   secret             the deployment secret (HETERO_PD_SECRET, router)
                            worker-key-<role>  the credential of `role`'s workers (its
                                               StatefulSet's pods share it), made from the
                                               secret (HETERO_PD_WORKER_KEY, those pods
                                               only: they never hold the secret, so none can
                                               act as the router nor as another role's worker)
                            api-keys           comma-separated API keys (HETERO_PD_API_KEY, router)
                            priority-api-keys  those of them that may set `priority`
                                               (HETERO_PD_PRIORITY_API_KEY, router; optional)
                            admin-keys         the operators' keys for /admin/* (drain,
                                               restart; HETERO_PD_ADMIN_KEY, router; optional)

The values come from the file (`transfer.secret`, `router.api_keys`,
`router.priority_api_keys`, `router.admin_keys`; all are then taken out of the ConfigMap's
copy), else from HETERO_PD_SECRET / HETERO_PD_API_KEY / HETERO_PD_PRIORITY_API_KEY /
HETERO_PD_ADMIN_KEY when rendering,
else the secret is generated (keep it by exporting HETERO_PD_SECRET before rendering again).
With `kubernetes.existing_secret` the operator manages the Secret and none is rendered; it
needs the same keys (`python -m hetero_pd.secrets --group ROLE` prints worker-key-ROLE for
$HETERO_PD_SECRET).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from hetero_pd import envs
from hetero_pd.deploy.schema import Deployment
from hetero_pd.secrets import WORKER_ENV, WorkerCredential

SECRET_KEY, API_KEYS_KEY, PRIORITY_KEY = "secret", "api-keys", "priority-api-keys"
ADMIN_KEY = "admin-keys"
SECRET_ENV, API_KEYS_ENV = "HETERO_PD_SECRET", "HETERO_PD_API_KEY"
PRIORITY_ENV, ADMIN_ENV = "HETERO_PD_PRIORITY_API_KEY", "HETERO_PD_ADMIN_KEY"
CHECKSUM_ANNOTATION = "hetero-pd/config-checksum"


def worker_key(role: str) -> str:
    """The Secret's key holding the credential of `role`'s workers (one StatefulSet)."""
    return f"worker-key-{role}"


@dataclass(frozen=True, slots=True)
class SecretValues:
    """The deployment secret and API keys a rendering puts in its Secret."""

    secret: str
    api_keys: tuple[str, ...]
    generated: bool = False  # the secret was made up now: render again with it exported
    priority_api_keys: tuple[str, ...] = ()
    admin_keys: tuple[str, ...] = ()


def secret_name(dep: Deployment) -> str:
    return dep.kubernetes.existing_secret or f"{dep.kubernetes.name}-secrets"


def api_keys(dep: Deployment, environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The API keys the router will demand: the file's, else $HETERO_PD_API_KEY's."""
    return dep.router.api_keys or envs.api_keys(environ)


def secret_values(dep: Deployment, environ: Mapping[str, str] | None = None) -> SecretValues:
    """The values of the rendered Secret (see the module docstring for where each is from)."""
    keys = api_keys(dep, environ)
    vip = dep.router.priority_api_keys or envs.priority_api_keys(environ)
    ops = dep.router.admin_keys or envs.admin_keys(environ)
    secret = dep.transfer.secret or envs.deployment_secret(environ)
    if secret:
        return SecretValues(secret, keys, priority_api_keys=vip, admin_keys=ops)
    made = secrets.token_urlsafe(32)
    return SecretValues(made, keys, generated=True, priority_api_keys=vip, admin_keys=ops)


def config_text(dep: Deployment) -> str:
    """The file for the ConfigMap: as written, or without its secrets (which go to the Secret)."""
    r = dep.router
    if not (dep.transfer.secret or r.api_keys or r.priority_api_keys or r.admin_keys):
        return dep.text
    raw = yaml.safe_load(dep.text)
    raw.get("transfer", {}).pop("secret", None)
    for field in ("api_keys", "priority_api_keys", "admin_keys"):
        raw.get("router", {}).pop(field, None)
    head = f"# {dep.source}, its secrets moved to the Secret {secret_name(dep)}\n"
    return head + yaml.safe_dump(raw, sort_keys=False)


def secret_manifest(dep: Deployment, values: SecretValues, meta: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": meta,
        "type": "Opaque",
        "stringData": {
            SECRET_KEY: values.secret,
            **{
                worker_key(role): WorkerCredential.for_group(values.secret.encode(), role).text()
                for role in dict.fromkeys(w.role for w in dep.workers)
            },
            API_KEYS_KEY: ",".join(values.api_keys),
        }
        | ({PRIORITY_KEY: ",".join(values.priority_api_keys)} if values.priority_api_keys else {})
        | ({ADMIN_KEY: ",".join(values.admin_keys)} if values.admin_keys else {}),
    }


def secret_env(dep: Deployment, role: str) -> list[dict[str, Any]]:
    """Container env reading the Secret (never a value in the manifest itself): the router's
    (`role` "router": the secret, the API keys), else a worker's of `role` (its role's
    credential only)."""
    router = role == "router"
    pairs = [(SECRET_ENV, SECRET_KEY), (API_KEYS_ENV, API_KEYS_KEY)] if router else []
    pairs = pairs or [(WORKER_ENV, worker_key(role))]
    name = secret_name(dep)
    env = [
        {"name": env, "valueFrom": {"secretKeyRef": {"name": name, "key": key}}}
        for env, key in pairs
    ]
    if router:  # optional: an operator's own Secret may give no key these rights
        for env_name, key in ((PRIORITY_ENV, PRIORITY_KEY), (ADMIN_ENV, ADMIN_KEY)):
            ref = {"name": name, "key": key, "optional": True}
            env.append({"name": env_name, "valueFrom": {"secretKeyRef": ref}})
    return env


def checksum(config: str, values: SecretValues | None) -> str:
    """Changes whenever the file or a secret does (so `kubectl apply` rolls every pod to the
    same values); keyed by the secret, so it tells nothing about the API keys."""
    if values is None:  # an existing Secret: its changes need `kubectl rollout restart`
        return hashlib.sha256(config.encode()).hexdigest()
    keys = (values.api_keys, values.priority_api_keys, values.admin_keys)
    body = "\0".join([config, *(",".join(k) for k in keys)]).encode()
    return hmac.new(values.secret.encode(), body, hashlib.sha256).hexdigest()


def network_policy(
    dep: Deployment, meta: dict[str, Any], instance: dict[str, str]
) -> dict[str, Any]:
    """Worker ports reachable only from this deployment's router and workers."""
    port = dep.kubernetes.base_port
    workers = {"key": "app.kubernetes.io/component", "operator": "In"}
    workers["values"] = sorted({w.role for w in dep.workers})  # type: ignore[assignment]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": meta,
        "spec": {
            "podSelector": {"matchLabels": instance, "matchExpressions": [workers]},
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "from": [{"podSelector": {"matchLabels": instance}}],
                    "ports": [
                        {"protocol": "TCP", "port": port},
                        {"protocol": "TCP", "port": port + 1},
                        {"protocol": "TCP", "port": port + 2},
                    ],
                }
            ],
        },
    }
