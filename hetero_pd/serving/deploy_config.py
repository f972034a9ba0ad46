"""A deployment described in YAML, loaded into typed, frozen objects.

The schema has one home, `hetero_pd.deploy.schema` (documented in configs/README.md); this
module re-exports it for the serving code. Unknown keys are rejected with the file, line and
key named; workers report the addresses they bound, so no port is computed by hand.
"""

from __future__ import annotations

from hetero_pd.deploy.schema import (
    ENGINE_KEYS,
    ConfigError,
    Deployment,
    load_deployment,
    parse_deployment,
    worker_ids,
)
from hetero_pd.deploy.sections import ROLES, RouterSpec, SupervisorSpec, TransferSpec, WorkerSpec

__all__ = [
    "ENGINE_KEYS",
    "ROLES",
    "ConfigError",
    "Deployment",
    "RouterSpec",
    "SupervisorSpec",
    "TransferSpec",
    "WorkerSpec",
    "load_deployment",
    "parse_deployment",
    "worker_ids",
]
