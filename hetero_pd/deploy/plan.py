"""`hetero-pd plan`: the worker speeds of a deployment's devices and the P/D counts they imply.

A role's speed comes from, in order: a calibration of the real model on that device (when
the device is on this host and calibration is allowed), the numbers declared in the file
(`pd.capacity.<kind>`, measured earlier on the target hardware), or the device's capability
profile with the model's cost per token.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

from backends import get_backend, parse_device_spec
from hetero_pd.deploy.calibrate import ModelCosts, calibrate, profile_speed
from hetero_pd.deploy.ratio import Plan, WorkerSpeed, plan_workers
from hetero_pd.deploy.schema import Deployment
from hetero_pd.deploy.sections import WorkloadSpec
from hetero_pd.deploy.workers import workers_for_counts

Measure = Callable[[str, str], WorkerSpeed]  # (role, device) -> speed


class PlanError(ValueError):
    """The plan cannot be made (a device's speed is unknown); the message says what to do."""


def role_devices(dep: Deployment) -> dict[str, str]:
    """The device of the first prefill and the first decode-capable worker."""
    if dep.pd is not None:
        return {"prefill": dep.pd.prefill_device, "decode": dep.pd.decode_device}
    out: dict[str, str] = {}
    for w in dep.workers:
        device = w.devices[0] if w.devices else w.device
        for role in ("prefill", "decode") if w.role == "both" else (w.role,):
            out.setdefault(role, device)
    return out


def present(device: str) -> bool:
    """Whether `device` exists on this host."""
    kind, index = parse_device_spec(device)
    return kind == "cpu" or get_backend(kind).device_count() > (index or 0)


def make_measure(dep: Deployment, use_calibration: bool) -> Measure:
    """The function that finds one role's speed (see the module docstring)."""
    from hetero_pd.models.config import ModelConfig
    from hetero_pd.models.fetch import resolve_model

    cache: dict[str, WorkerSpeed] = {}
    workload = dep.workload or WorkloadSpec()

    def measure(role: str, device: str) -> WorkerSpeed:
        kind, index = parse_device_spec(device)
        concrete = "cpu" if kind == "cpu" else f"{kind}:{index or 0}"
        here = present(concrete)
        declared = dep.capacity(kind)
        if concrete in cache:
            return cache[concrete]
        if here and use_calibration:
            threads = dep.engine.get("num_threads")
            speed = calibrate(dep.model, concrete, dep.dtype, num_threads=threads)
        elif declared is not None:
            speed = WorkerSpeed(
                concrete,
                declared.prefill_tokens_per_s,
                declared.decode_step_ms,
                declared.decode_ms_per_seq,
                f"declared in pd.capacity.{kind}",
            )
        elif here:
            costs = ModelCosts.of(ModelConfig.from_dir(resolve_model(dep.model)), dep.dtype)
            context = workload.input_len + workload.output_len // 2
            speed = profile_speed(concrete, costs, context)
        else:
            raise PlanError(
                f"{dep.source}: the {role} device {device} is not on this host, so its speed "
                f"cannot be measured; run `hetero-pd plan --measure {kind}` on a host that has "
                f"one and put the numbers under pd.capacity.{kind}"
            )
        cache[concrete] = speed
        return speed

    return measure


def plan_deployment(dep: Deployment, measure: Measure) -> Plan:
    """P/D counts for `dep`'s workload on its devices."""
    if dep.workload is None:
        raise PlanError(f"{dep.source}: a plan needs a `workload:` section (rate, lengths, SLOs)")
    devices = role_devices(dep)
    p_speed = measure("prefill", devices["prefill"])
    d_speed = measure("decode", devices["decode"])
    max_batch = int(dep.engine.get("max_num_seqs", 64))
    cap = dep.pd.max_instances if dep.pd else 0
    plan = plan_workers(dep.workload, p_speed, d_speed, max_batch, cap)
    if devices["prefill"] == devices["decode"] == "cpu" and (os.cpu_count() or 1) < 8:
        plan.warnings.append(
            "cpu workers on one host share its cores: each extra worker slows the others, "
            "so these counts hold only where each worker has the cores it was measured with"
        )
    return plan


def with_counts(dep: Deployment, plan: Plan) -> Deployment:
    """`dep` with its automatic (0/0) worker counts filled in from `plan`."""
    assert dep.pd is not None, "only a `pd:` deployment has automatic counts"
    return dataclasses.replace(dep, workers=workers_for_counts(dep.pd, plan.prefill, plan.decode))


def resolve(dep: Deployment, use_calibration: bool = True) -> tuple[Deployment, Plan | None]:
    """A deployment with concrete worker counts, and the plan when one was made."""
    if not dep.automatic:
        return dep, None
    plan = plan_deployment(dep, make_measure(dep, use_calibration))
    return with_counts(dep, plan), plan
