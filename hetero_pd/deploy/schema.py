"""A deployment described in YAML (schema version 1), loaded into typed, frozen objects.

This is the one schema of a deployment file. Loading checks
everything that needs no hardware and no model (keys, types, ranges, roles, device syntax,
device assignment, ports); `hetero_pd.deploy.validate` adds the checks against a host.

Workers come either from a `workers:` list or from a `pd:` ratio. With `pd` rates of 0/0
the counts are computed later (`hetero_pd.deploy.ratio`) and `workers` is empty until
`with_counts()` fills it.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hetero_pd.config import DTYPE_CHOICES
from hetero_pd.deploy.fields import build, check_value
from hetero_pd.deploy.sections import (
    ROLES,
    Capacity,
    EdgeSpec,
    EngineSpec,
    KubernetesSpec,
    PDSpec,
    RouterSpec,
    SupervisorSpec,
    TransferSpec,
    WorkerSpec,
    WorkloadSpec,
)
from hetero_pd.deploy.source import ConfigError, Issue, Source, parse_yaml, read_yaml
from hetero_pd.deploy.workers import (
    check_faults,
    host_ports,
    pd_workers,
    place_workers,
    worker_ids,
    workers_for_counts,
)
from hetero_pd.engine.kv_tiers.config import TierConfig
from hetero_pd.engine.spec.config import SpeculativeConfig

VERSION = 1
TOP_KEYS: tuple[str, ...] = ("version", "model", "dtype", "workers", "pd", "workload")
TOP_KEYS += ("router", "engine", "transfer", "edge", "supervisor", "kubernetes")


@dataclass(frozen=True, slots=True)
class Deployment:
    """One deployment: the model, its workers and how every component is configured."""

    model: str
    workers: tuple[WorkerSpec, ...]
    dtype: str = "float32"
    router: RouterSpec = field(default_factory=RouterSpec)
    engine: EngineSpec = field(default_factory=EngineSpec)
    transfer: TransferSpec = field(default_factory=TransferSpec)
    source: str = "<dict>"
    pd: PDSpec | None = None
    workload: WorkloadSpec | None = None
    edge: EdgeSpec | None = None
    supervisor: SupervisorSpec = field(default_factory=SupervisorSpec)
    kubernetes: KubernetesSpec = field(default_factory=KubernetesSpec)
    text: str = field(default="", repr=False)  # the YAML as written (for the ConfigMap)
    lines: dict[str, int] = field(default_factory=dict, repr=False, compare=False)

    @property
    def automatic(self) -> bool:
        """Whether the P/D counts are still to be computed (`pd` rates 0/0)."""
        return not self.workers

    def capacity(self, kind: str) -> Capacity | None:
        """Declared throughput of a worker on `kind` (`pd.capacity`), if any."""
        raw = self.pd.capacity.get(kind) if self.pd else None
        return None if raw is None else Capacity(**raw)


def load_deployment(path: str | Path) -> Deployment:
    """Reads and checks a deployment file; ConfigError lists every issue with its line."""
    raw, src = read_yaml(path)
    return _parse(raw, src)


def parse_deployment(raw: Any, source: str = "<dict>") -> Deployment:
    """A deployment from plain values (a dict as `yaml.safe_load` returns it)."""
    return _parse(raw, Source(source))


def parse_text(text: str, source: str = "<text>") -> Deployment:
    """A deployment from YAML text (errors carry lines)."""
    src = Source(source, text=text)
    return _parse(parse_yaml(text, src), src)


def _parse(raw: Any, src: Source) -> Deployment:
    if not isinstance(raw, dict):
        src.error("", "the top level must be a mapping (model:, workers:, router: ...)")
        src.raise_if_any()
    for name in raw:
        if name not in TOP_KEYS:
            src.error(str(name), f"unknown key; allowed at the top level: {', '.join(TOP_KEYS)}")
    version = raw.get("version", VERSION)
    if version != VERSION:
        src.error("version", f"unsupported version {version!r}; this build reads {VERSION}")
    if not isinstance(raw.get("model"), str) or not raw["model"]:
        src.error("model", "required: a known model name or a local Hugging Face folder")
    choices = {"choices": DTYPE_CHOICES}
    dtype = check_value(raw.get("dtype", "float32"), str, "dtype", src, choices)
    router = build(RouterSpec, raw.get("router"), "router", src)
    if router is not None and router.rebalance.low >= router.rebalance.high:
        src.error(
            "router.rebalance.low",
            f"{router.rebalance.low} must be below router.rebalance.high "
            f"({router.rebalance.high}): a worker below `low` takes requests from one above `high`",
        )
    transfer_raw = raw.get("transfer")
    faults: Any = {}
    if isinstance(transfer_raw, dict) and "faults" in transfer_raw:
        transfer_raw = dict(transfer_raw)
        faults = transfer_raw.pop("faults")
    transfer = build(TransferSpec, transfer_raw, "transfer", src)
    supervisor = build(SupervisorSpec, raw.get("supervisor"), "supervisor", src)
    kubernetes = build(KubernetesSpec, raw.get("kubernetes"), "kubernetes", src)
    workload = _optional(WorkloadSpec, raw, "workload", src)
    edge = _optional(EdgeSpec, raw, "edge", src)
    engine = build(EngineSpec, raw.get("engine"), "engine", src)
    if engine is not None:
        _check_kv_tiers(engine, src)
    pd = _optional(PDSpec, raw, "pd", src)
    if pd is not None:
        _check_capacity(pd, src)
    workers: tuple[WorkerSpec, ...] | None = None
    if ("workers" in raw) == ("pd" in raw):
        src.error("workers", "give exactly one of `workers:` (a list) and `pd:` (a P:D ratio)")
    elif "workers" in raw:
        workers = _worker_list(raw["workers"], src)
    elif pd is not None:
        workers = pd_workers(pd, workload, src)
        for spec in workers_for_counts(pd, 1, 1):
            _check_tensor_parallel(spec, "pd", src, f"{spec.role}_")
    if workers:
        place_workers(workers, src, "pd" if pd is not None else "workers")
        host_ports(workers, src)
    elif workers == () and pd is not None:  # automatic: check the devices' syntax now
        place_workers(workers_for_counts(pd, 1, 1), src, "pd")
    if transfer is not None and workers is not None:
        transfer = replace(transfer, faults=check_faults(faults, worker_ids(workers), src))
    src.raise_if_any()
    assert router and engine and transfer and supervisor and kubernetes and workers is not None
    return Deployment(
        model=str(raw["model"]),
        dtype=str(dtype),
        workers=workers,
        router=router,
        engine=engine,
        transfer=transfer,
        source=src.name,
        pd=pd,
        workload=workload,
        edge=edge,
        supervisor=supervisor,
        kubernetes=kubernetes,
        text=src.text,
        lines=dict(src.lines),
    )


def _optional(cls: type[Any], raw: dict[str, Any], key: str, src: Source) -> Any:
    return build(cls, raw[key], key, src) if key in raw else None


def _check_capacity(pd: PDSpec, src: Source) -> None:
    from backends import registered_kinds

    for kind, numbers in pd.capacity.items():
        key = f"pd.capacity.{kind}"
        if kind not in registered_kinds():
            src.error(key, f"unknown device kind; allowed: {', '.join(registered_kinds())}")
        build(Capacity, numbers, key, src)
    if pd.default_p_rate == pd.default_d_rate == 0 and pd.instances:
        src.error(
            "pd.instances",
            "automatic sizing (rates 0/0) computes the counts; cap them with max_instances",
        )


def _worker_list(raw: Any, src: Source) -> tuple[WorkerSpec, ...] | None:
    if not isinstance(raw, list) or not raw:
        src.error("workers", f"must be a non-empty list of workers (- role: {'|'.join(ROLES)})")
        return None
    specs = [build(WorkerSpec, w, f"workers[{i}]", src) for i, w in enumerate(raw)]
    if any(s is None for s in specs):
        return None
    out = []
    for i, spec in enumerate(typing.cast(list[WorkerSpec], specs)):
        if spec.devices:
            if "count" in raw[i] and spec.count != len(spec.devices):
                src.error(
                    f"workers[{i}].count",
                    f"{spec.count} workers but {len(spec.devices)} devices listed; "
                    "with `devices:` leave count out (one worker per device)",
                )
            if "device" in raw[i]:
                src.error(f"workers[{i}].device", "give `device:` or `devices:`, not both")
            spec = dataclasses.replace(spec, count=len(spec.devices))
        _check_tensor_parallel(spec, f"workers[{i}]", src)
        _check_speculative(spec, f"workers[{i}]", src)
        out.append(spec)
    roles = {w.role for w in out}
    if not roles & {"decode", "both"}:
        src.error("workers", "no worker can decode: add a worker with role decode or both")
    elif "prefill" in roles and "decode" not in roles:
        src.error("workers", "prefill workers need at least one worker with role decode")
    return tuple(out)


def _check_speculative(spec: WorkerSpec, key: str, src: Source) -> None:
    """A worker group's speculative_config: valid, and on workers that decode."""
    if spec.speculative_config is None:
        return
    if spec.role == "prefill":
        src.error(
            f"{key}.speculative_config",
            "speculative decoding runs where tokens are decoded: set it on decode (or "
            "both) workers; a prefill worker computes the prompt and its first token only",
        )
    try:
        SpeculativeConfig.parse(spec.speculative_config)
    except (TypeError, ValueError) as e:
        src.error(f"{key}.speculative_config", str(e))


def _check_tensor_parallel(spec: WorkerSpec, key: str, src: Source, role: str = "") -> None:
    """What a worker group with tensor_parallel_size > 1 cannot do yet, named (`role`:
    the `pd:` section's key prefix, `prefill_` or `decode_`)."""
    tp = spec.tensor_parallel_size
    if tp == 1:
        return
    kind = spec.device.split(":", 1)[0]
    if spec.role != "both" and kind != "cpu":
        src.error(
            f"{key}.{role}tensor_parallel_size",
            f"{tp} on a {spec.role} worker on {kind}: KV resharded in transit works where "
            "the ranks share one KV cache in memory, on the CPU only so far; on other "
            "devices only role both runs with TP > 1",
        )
    if kind == "cpu" and spec.kv_layout not in ("auto", "nd"):
        src.error(
            f"{key}.{role}kv_layout",
            f"{spec.kv_layout} with tensor_parallel_size {tp} on the CPU: each rank's KV heads "
            "are a slice of one nd cache; use kv_layout nd (or auto)",
        )
    if spec.devices:
        src.error(
            f"{key}.devices",
            "a worker with tensor_parallel_size > 1 takes consecutive devices from its "
            "`device:` (e.g. cuda:2 -> cuda:2, cuda:3, or a bare cuda); `devices:` lists "
            "one device per worker",
        )


def _check_kv_tiers(engine: EngineSpec, src: Source) -> None:
    """The `kv_cache_*` options together (the tiers' own rule; each alone is checked)."""
    caching = engine.enable_prefix_caching and engine.start_layer == 0
    try:
        TierConfig.from_options(
            engine.kv_cache_host_gb,
            engine.kv_cache_disk_gb,
            engine.kv_cache_disk_path,
            caching,
            engine.kv_cache_admit_after,
        )
    except ValueError as e:  # its message starts with the option it is about
        key = "kv_cache_disk_gb" if str(e).startswith("kv_cache_disk_gb") else "kv_cache_host_gb"
        src.error(f"engine.{key}", str(e))


__all__ = [
    "ConfigError",
    "Deployment",
    "Issue",
    "RouterSpec",
    "TransferSpec",
    "WorkerSpec",
    "load_deployment",
    "parse_deployment",
]
