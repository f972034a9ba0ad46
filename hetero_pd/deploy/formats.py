"""Each worker's KV format: the dtype it computes and stores KV in, and the byte order of
its KV blocks. Workers of one deployment may differ (bfloat16 NPU prefill, float32 CPU
decode); the transfer layer converts KV on receipt (transfer/kv_layouts.py).

    dtype:      workers[i].dtype | pd.<role>_dtype  >  the deployment's `dtype`
                "auto": the worker's device backend picks (backends/dtype.py), at its start
    kv_layout:  workers[i].kv_layout | pd.<role>_kv_layout; "auto": the device backend's
"""

from __future__ import annotations

from dataclasses import dataclass

from hetero_pd.deploy.schema import Deployment
from hetero_pd.deploy.workers import worker_ids


@dataclass(frozen=True, slots=True)
class KVFormat:
    """What a worker's engine is configured with ("auto" resolved by its backend)."""

    dtype: str
    kv_layout: str = "auto"


def worker_formats(dep: Deployment) -> dict[str, KVFormat]:
    """The format of every worker of `dep`, by worker id (`prefill-0`, `decode-1`, ...)."""
    ids = iter(worker_ids(dep.workers))
    dtype, layout = dep.engine.dtype or dep.dtype, dep.engine.kv_layout
    return {
        next(ids): KVFormat(
            spec.dtype or dtype, spec.kv_layout if spec.kv_layout != "auto" else layout
        )
        for spec in dep.workers
        for _ in range(spec.count)
    }


def worker_format(dep: Deployment, worker_id: str, role: str) -> KVFormat:
    """The format of worker `worker_id`; one the file does not list (a replica added by
    scaling a Kubernetes role up) gets that of the first group of its `role`."""
    formats = worker_formats(dep)
    if worker_id in formats:
        return formats[worker_id]
    roles = [spec.role for spec in dep.workers for _ in range(spec.count)]
    for worker_role, listed in zip(roles, worker_ids(dep.workers), strict=True):
        if worker_role == role:
            return formats[listed]
    return KVFormat(dep.engine.dtype or dep.dtype, dep.engine.kv_layout)


def role_dtype(dep: Deployment, role: str) -> str:
    """The dtype of the first worker that runs `role` ("prefill" or "decode")."""
    formats = worker_formats(dep)
    roles = [spec.role for spec in dep.workers for _ in range(spec.count)]
    for worker_role, worker_id in zip(roles, worker_ids(dep.workers), strict=True):
        if worker_role in (role, "both"):
            return formats[worker_id].dtype
    default = dep.engine.dtype or dep.dtype
    if dep.pd is not None:  # automatic counts: no workers yet
        return str(getattr(dep.pd, f"{role}_dtype")) or default
    return default
