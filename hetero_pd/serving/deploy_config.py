"""A deployment described in YAML, loaded into typed, frozen objects.

Unknown keys are rejected with the file and the key named; workers find each other through
addresses they report themselves, so no port is ever computed by hand.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hetero_pd.config import EngineConfig
from hetero_pd.serving.policy import FAILURE_POLICIES, POLICIES
from transfer import FaultRule

ROLES = ("prefill", "decode", "both")
ENGINE_KEYS = {f.name for f in dataclasses.fields(EngineConfig)} - {"model", "role", "device"}


class ConfigError(ValueError):
    """A deployment file that cannot be used; the message names the file and the key."""


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    role: str
    device: str = "cpu"
    count: int = 1
    cpus: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class RouterSpec:
    host: str = "127.0.0.1"
    port: int = 8000
    policy: str = "least_loaded"
    failure_policy: str = "recompute"
    api_keys: tuple[str, ...] = ()
    max_inflight: int = 256
    local_prefill_max_tokens: int = 32
    heartbeat_timeout_s: float = 5.0


@dataclass(frozen=True, slots=True)
class TransferSpec:
    layerwise: bool = False
    checksum: bool = True
    transports: tuple[str, ...] = ("local", "cuda_ipc", "shm", "tcp")
    timeout_s: float = 30.0
    secret: str = ""
    #: Longest a shared-memory write into a decode worker's blocks may take; blocks released
    #: while one is open are not reused before it ends.
    grant_s: float = 10.0
    #: How long a decode worker waits for a prompt's KV before computing it itself.
    remote_kv_timeout_s: float = 60.0
    #: For tests and fault drills only: worker id (e.g. "prefill-0") -> FaultRule fields
    #: (kind, msg_type, nth, count, delay_s) injected into that worker's outgoing transfer
    #: frames (see transfer/faults.py). Never set this in production.
    faults: dict[str, tuple[dict[str, Any], ...]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Deployment:
    model: str
    workers: tuple[WorkerSpec, ...]
    dtype: str = "float32"
    router: RouterSpec = field(default_factory=RouterSpec)
    engine: dict[str, Any] = field(default_factory=dict)
    transfer: TransferSpec = field(default_factory=TransferSpec)
    source: str = "<dict>"


def worker_ids(workers: tuple[WorkerSpec, ...]) -> list[str]:
    """The id of every worker process, in launch order: `prefill-0`, `decode-0`, `both-1`."""
    counters: dict[str, int] = {}
    ids = []
    for spec in workers:
        for _ in range(spec.count):
            n = counters.get(spec.role, 0)
            counters[spec.role] = n + 1
            ids.append(f"{spec.role}-{n}")
    return ids


def _faults(raw: Any, ids: list[str], source: str) -> dict[str, tuple[dict[str, Any], ...]]:
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: transfer.faults must map worker ids to lists of rules")
    out = {}
    for wid, rules in raw.items():
        where = f"transfer.faults.{wid}"
        if wid not in ids:
            raise ConfigError(f"{source}: {where}: no such worker; the workers are {ids}")
        if not isinstance(rules, (list, tuple)) or not all(isinstance(r, dict) for r in rules):
            raise ConfigError(f"{source}: {where} must be a list of mappings")
        for rule in rules:
            try:
                FaultRule(**rule)
            except (TypeError, ValueError) as e:
                raise ConfigError(f"{source}: {where}: {e}") from e
        out[str(wid)] = tuple(dict(r) for r in rules)
    return out


def _typed(cls: type, raw: Any, where: str, source: str) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: {where} must be a mapping, got {type(raw).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ConfigError(
            f"{source}: unknown key {where}.{unknown[0]}; allowed: {', '.join(sorted(names))}"
        )
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()}
    try:
        return cls(**values)
    except TypeError as e:
        raise ConfigError(f"{source}: {where}: {e}") from e


def load_deployment(path: str | Path) -> Deployment:
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as e:
        raise ConfigError(f"{path}: cannot read ({e.strerror})") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({e})") from e
    return parse_deployment(raw, str(path))


def parse_deployment(raw: Any, source: str = "<dict>") -> Deployment:
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the top level must be a mapping")
    raw = dict(raw)
    version = raw.pop("version", 1)
    if version != 1:
        raise ConfigError(f"{source}: unsupported version {version!r} (this build reads 1)")
    top = {"model", "dtype", "workers", "router", "engine", "transfer"}
    unknown = sorted(set(raw) - top)
    if unknown:
        raise ConfigError(f"{source}: unknown key {unknown[0]!r}; allowed: {sorted(top)}")
    if "model" not in raw:
        raise ConfigError(f"{source}: missing key 'model'")
    workers_raw = raw.get("workers")
    if not isinstance(workers_raw, list) or not workers_raw:
        raise ConfigError(f"{source}: 'workers' must be a non-empty list")
    workers = tuple(
        _typed(WorkerSpec, w, f"workers[{i}]", source) for i, w in enumerate(workers_raw)
    )
    for i, w in enumerate(workers):
        if w.role not in ROLES:
            raise ConfigError(f"{source}: workers[{i}].role {w.role!r} is not one of {ROLES}")
    router = _typed(RouterSpec, raw.get("router", {}), "router", source)
    if router.policy not in POLICIES:
        raise ConfigError(f"{source}: router.policy {router.policy!r} is not one of {POLICIES}")
    if router.failure_policy not in FAILURE_POLICIES:
        raise ConfigError(
            f"{source}: router.failure_policy {router.failure_policy!r} is not one of "
            f"{FAILURE_POLICIES}"
        )
    engine = raw.get("engine", {}) or {}
    if not isinstance(engine, dict):
        raise ConfigError(f"{source}: engine must be a mapping")
    bad = sorted(set(engine) - ENGINE_KEYS)
    if bad:
        raise ConfigError(f"{source}: unknown key engine.{bad[0]}; allowed: {sorted(ENGINE_KEYS)}")
    roles = {w.role for w in workers}
    if not roles & {"decode", "both"}:
        raise ConfigError(f"{source}: no worker can decode (add a 'decode' or 'both' worker)")
    if "prefill" in roles and "decode" not in roles:
        raise ConfigError(f"{source}: prefill workers need at least one 'decode' worker")
    transfer = _typed(TransferSpec, raw.get("transfer", {}), "transfer", source)
    transfer = dataclasses.replace(
        transfer, faults=_faults(transfer.faults, worker_ids(workers), source)
    )
    return Deployment(
        model=str(raw["model"]),
        dtype=str(raw.get("dtype", "float32")),
        workers=workers,
        router=router,
        engine=dict(engine),
        transfer=transfer,
        source=source,
    )
