"""`hetero-pd plan`: the worker speeds of a deployment's devices and the P/D counts they imply.

A role's speed comes from, in order: a calibration of the real model on that device (when
the device is on this host and calibration is allowed; checked against the capability
profile, see `calibrate.check_agreement`), the numbers declared in the file
(`pd.capacity.<kind>`, measured earlier on the target hardware), or the device's capability
profile with the model's cost per token. CPU workers on one host share its cores: planned
for this host, the counts are capped at its core count.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

from backends import get_backend, parse_device_spec
from hetero_pd.deploy.calibrate import (
    CalibrationError,
    ModelCosts,
    calibrate,
    check_agreement,
    profile_speed,
)
from hetero_pd.deploy.formats import role_dtype
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


def role_tensor_parallel(dep: Deployment) -> dict[str, int]:
    """The devices (ranks) each prefill and each decode-capable worker takes."""
    if dep.pd is not None:
        pd = dep.pd
        return {
            "prefill": pd.prefill_tensor_parallel_size,
            "decode": pd.decode_tensor_parallel_size,
        }
    out: dict[str, int] = {}
    for w in dep.workers:
        for role in ("prefill", "decode") if w.role == "both" else (w.role,):
            out.setdefault(role, w.tensor_parallel_size)
    return {"prefill": out.get("prefill", 1), "decode": out.get("decode", 1)}


def present(device: str) -> bool:
    """Whether `device` exists on this host."""
    kind, index = parse_device_spec(device)
    return kind == "cpu" or get_backend(kind).device_count() > (index or 0)


def make_measure(dep: Deployment, use_calibration: bool) -> Measure:
    """The function that finds one role's speed (see the module docstring)."""
    from hetero_pd.deploy.model_deployment import concrete_dtype
    from hetero_pd.models.config import ModelConfig
    from hetero_pd.models.fetch import resolve_model

    cache: dict[tuple[str, str], WorkerSpeed] = {}
    workload = dep.workload or WorkloadSpec()
    context = workload.input_len + workload.output_len // 2

    def costs(dtype: str) -> ModelCosts:
        return ModelCosts.of(ModelConfig.from_dir(resolve_model(dep.model)), dtype)

    def measure(role: str, device: str) -> WorkerSpeed:
        kind, index = parse_device_spec(device)
        concrete = "cpu" if kind == "cpu" else f"{kind}:{index or 0}"
        here = present(concrete)
        declared = dep.capacity(kind)
        dtype = role_dtype(dep, role)  # per role: prefill and decode may differ
        if here and dtype == "auto":
            dtype = concrete_dtype(dtype, dep.model, concrete)
        if (concrete, dtype) in cache:
            return cache[concrete, dtype]
        if here and use_calibration:
            speed = calibrate(dep.model, concrete, dtype, num_threads=dep.engine.num_threads)
            try:
                checked = check_agreement(speed, profile_speed(concrete, costs(dtype), context))
            except CalibrationError as e:
                raise PlanError(f"{dep.source}: {e}") from e
            speed = dataclasses.replace(speed, source=f"{speed.source}; {'; '.join(checked)}")
        elif declared is not None:
            speed = WorkerSpeed(
                concrete,
                declared.prefill_tokens_per_s,
                declared.decode_step_ms,
                declared.decode_ms_per_seq,
                f"declared in pd.capacity.{kind}",
            )
        elif here:
            speed = profile_speed(concrete, costs(dtype), context)
        else:
            raise PlanError(
                f"{dep.source}: the {role} device {device} is not on this host, so its speed "
                f"cannot be measured; run `hetero-pd plan --measure {kind}` on a host that has "
                f"one and put the numbers under pd.capacity.{kind}"
            )
        cache[concrete, dtype] = speed
        return speed

    return measure


def host_cores() -> int:
    """Cores this process may run on (its CPU affinity, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def plan_deployment(dep: Deployment, measure: Measure, cores: int | None = None) -> Plan:
    """P/D counts for `dep`'s workload on its devices; with `cores` (planning CPU workers
    on this host), at most that many CPU workers."""
    if dep.workload is None:
        raise PlanError(f"{dep.source}: a plan needs a `workload:` section (rate, lengths, SLOs)")
    devices = role_devices(dep)
    p_speed = measure("prefill", devices["prefill"])
    d_speed = measure("decode", devices["decode"])
    max_batch = dep.engine.max_num_seqs
    cap = dep.pd.max_instances if dep.pd else 0
    tp = role_tensor_parallel(dep)
    plan = plan_workers(dep.workload, p_speed, d_speed, max_batch, cap)
    plan = dataclasses.replace(plan, ranks=(tp["prefill"], tp["decode"]))
    for note in dict.fromkeys(p_speed.notes + d_speed.notes):
        plan.warnings.append(note)
    if plan.ranks != (1, 1):
        plan.warnings.append(
            f"tensor_parallel_size {tp['prefill']} (prefill) and {tp['decode']} (decode): the "
            "speeds above are one device's, so a worker over several devices is counted no "
            "faster than one (on the CPU its ranks share the same cores; on accelerators "
            "it is faster, and these counts are an upper bound)"
        )
    if cores is not None and devices["prefill"] == devices["decode"] == "cpu":
        plan = cap_to_cores(plan, cores)
    if cores is not None:  # this host's accelerators: a worker owns its devices
        check_host_devices(plan, devices)
    return plan


def cap_to_cores(plan: Plan, cores: int) -> Plan:
    """CPU workers on one host share its cores: more ranks (a worker has tensor_parallel_size
    of them) than cores only slow each other down, so the counts are capped at the core
    count (at least 1P + 1D), in the plan's proportion."""
    tp_p, tp_d = plan.ranks
    limit = max(tp_p + tp_d, cores)
    if plan.devices("cpu", "cpu")["cpu"] <= limit:
        return plan
    share = limit * plan.prefill * tp_p / (plan.prefill * tp_p + plan.decode * tp_d)
    prefill = min((limit - tp_d) // tp_p, max(1, round(share / tp_p)))
    decode = max(1, (limit - prefill * tp_p) // tp_d)
    ranks = "" if plan.ranks == (1, 1) else f" ({tp_p} and {tp_d} ranks each)"
    warning = (
        f"{plan.prefill}P + {plan.decode}D cpu workers{ranks} on a host with {cores} core(s): "
        f"capped to {prefill}P + {decode}D (more ranks than cores only slow each "
        "other down); the declared rate and SLOs will not hold on this host"
    )
    return dataclasses.replace(
        plan, prefill=prefill, decode=decode, warnings=[*plan.warnings, warning]
    )


def check_host_devices(plan: Plan, devices: dict[str, str]) -> None:
    """PlanError when the planned workers need more of an accelerator kind this host has
    than it has (a kind it lacks is planned for another host or a cluster)."""
    for kind, need in plan.devices(devices["prefill"], devices["decode"]).items():
        have = 0 if kind == "cpu" else get_backend(kind).device_count()
        if have and need > have:
            raise PlanError(
                f"{plan.prefill}P + {plan.decode}D workers of {plan.ranks[0]} and "
                f"{plan.ranks[1]} device(s) each need {need} {kind} devices; this host has "
                f"{have}: set pd.max_instances, lower the workload, or plan a cluster "
                "(`hetero-pd render k8s`)"
            )


def with_counts(dep: Deployment, plan: Plan) -> Deployment:
    """`dep` with its automatic (0/0) worker counts filled in from `plan`."""
    assert dep.pd is not None, "only a `pd:` deployment has automatic counts"
    return dataclasses.replace(dep, workers=workers_for_counts(dep.pd, plan.prefill, plan.decode))


def resolve(
    dep: Deployment, use_calibration: bool = True, local: bool = True
) -> tuple[Deployment, Plan | None]:
    """A deployment with concrete worker counts, and the plan when one was made. `local`:
    the workers run on this host (CPU workers capped at its cores), not on a cluster."""
    if not dep.automatic:
        return dep, None
    cores = host_cores() if local else None
    plan = plan_deployment(dep, make_measure(dep, use_calibration), cores)
    return with_counts(dep, plan), plan
