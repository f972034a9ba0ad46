"""Worker placement: which device each worker process owns, and P:D counts from rates.

A worker owns exactly one device, or with tensor_parallel_size N the N consecutive devices
from its first. Explicit indices (`cuda:1`, or `devices: [...]`) are reserved first; a bare
accelerator kind (`npu`) then takes the lowest free indices in file order; `cpu` is shared
by any number of workers. Two workers on one accelerator index is an error, caught here
without touching hardware (`backends.parse_device_spec`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from backends import parse_device_spec
from hetero_pd.deploy.sections import PDSpec, WorkerSpec, WorkloadSpec
from hetero_pd.deploy.source import Source
from hetero_pd.engine.spec.config import SpeculativeConfig


@dataclass(frozen=True, slots=True)
class WorkerInstance:
    """One worker process to run: its id, role and the device it owns (its first, with
    tensor parallelism: rank r takes the r-th from it)."""

    worker_id: str
    role: str
    device: str  # "cpu" or "<kind>:<index>"
    cpus: tuple[int, ...] = ()
    host: str = ""  # bare metal: the host that runs it ("" = this box)
    port: int = 0  # bare metal: its control port (transfer: port + 1)
    tensor_parallel_size: int = 1
    speculative_config: SpeculativeConfig | None = None

    @property
    def address(self) -> str:
        """Bare metal: where the router reaches its control socket."""
        return f"tcp://{self.host}:{self.port}"


def _spec_key(base: str, i: int) -> str:
    return f"workers[{i}]" if base == "workers" else "pd"


def place_workers(
    workers: tuple[WorkerSpec, ...], src: Source, base: str = "workers"
) -> list[list[str]]:
    """The device of every worker of every spec; issues are recorded in `src`."""
    taken: dict[tuple[str, str, int], str] = {}  # (host, kind, index): one host's devices
    wanted: list[list[tuple[str, int | None, str]]] = []
    for i, spec in enumerate(workers):
        items = []
        named = [(f"devices[{j}]", d) for j, d in enumerate(spec.devices)] or [
            ("device", spec.device)
        ]
        if base == "pd":
            named = [(f"{spec.role}_device", spec.device)]
        for sub, text in named:
            key = f"{_spec_key(base, i)}.{sub}"
            try:
                kind, index = parse_device_spec(text)
            except (ValueError, TypeError) as e:
                src.error(key, str(e))
                continue
            if kind == "cpu" and index not in (None, 0):
                src.error(key, f"{text!r}: the host is the single device 'cpu' (no index)")
                continue
            if kind != "cpu" and index is not None and spec.count > 1 and not spec.devices:
                src.error(
                    key,
                    f"{spec.count} workers on one device {text}: a worker owns one device; "
                    f"list them (`devices: [{kind}:0, {kind}:1]`) or write a bare '{kind}'",
                )
                continue
            if kind != "cpu" and index is not None:
                run = [
                    (spec.host, kind, n) for n in range(index, index + spec.tensor_parallel_size)
                ]
                clash = next((w for w in run if w in taken), None)
                if clash is not None:
                    on = f" on {spec.host}" if spec.host else ""
                    src.error(
                        key,
                        f"{kind}:{clash[2]}{on} is already used by {taken[clash]}; "
                        "a worker owns its devices",
                    )
                    continue
                taken.update(dict.fromkeys(run, key))
            items.append((kind, index, key))
        wanted.append(items)
    out = []
    for spec, items in zip(workers, wanted, strict=True):
        devices = []
        for kind, index, _ in items:
            if kind == "cpu":
                devices += ["cpu"] * (spec.count if not spec.devices else 1)
            elif index is not None:
                devices.append(f"{kind}:{index}")
            else:
                tp = spec.tensor_parallel_size
                for _ in range(spec.count):  # the lowest run of tp free indices
                    free = next(
                        n
                        for n in range(10_000)
                        if all((spec.host, kind, m) not in taken for m in range(n, n + tp))
                    )
                    taken.update(
                        dict.fromkeys(
                            [(spec.host, kind, m) for m in range(free, free + tp)], "auto"
                        )
                    )
                    devices.append(f"{kind}:{free}")
        out.append(devices)
    return out


#: Bare metal: the control port of a host's first worker when the file gives none.
FIRST_PORT = 9000


def host_ports(workers: tuple[WorkerSpec, ...], src: Source) -> list[list[int]]:
    """Bare metal: the control port of every worker of every spec (0 without a host). A
    worker takes two ports (control, transfer = control + 1); clashes are recorded."""
    used: dict[str, dict[int, str]] = {}
    out = []
    hosts = [bool(spec.host) for spec in workers]
    if any(hosts) and not all(hosts):
        i = hosts.index(False)
        src.error(f"workers[{i}].host", "list a host for every worker group, or for none")
    for i, spec in enumerate(workers):
        if not spec.host:
            out.append([0] * spec.count)
            continue
        taken = used.setdefault(spec.host, {})
        start = spec.port or max(taken, default=FIRST_PORT - 1) + 1
        ports = [start + 2 * n for n in range(spec.count)]
        for port in ports:
            for p in (port, port + 1):
                if p in taken:
                    src.error(
                        f"workers[{i}].port",
                        f"port {p} on {spec.host} is already used by {taken[p]}; "
                        "each worker takes two ports (control, transfer = control + 1)",
                    )
                taken[p] = f"workers[{i}]"
        out.append(ports)
    return out


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


def role_speculative_config(workers: tuple[WorkerSpec, ...], role: str) -> SpeculativeConfig | None:
    """The speculative config of `role`'s first worker group (a Kubernetes replica's)."""
    spec = next((w for w in workers if w.role == role), None)
    return None if spec is None else SpeculativeConfig.parse(spec.speculative_config)


def expand_workers(workers: tuple[WorkerSpec, ...]) -> list[WorkerInstance]:
    """Every worker process of a loaded deployment, in launch order, with its device."""
    src = Source("<deployment>")
    placed = place_workers(workers, src)
    ports = host_ports(workers, src)
    src.raise_if_any()
    ids = iter(worker_ids(workers))
    return [
        WorkerInstance(
            next(ids),
            spec.role,
            device,
            spec.cpus,
            spec.host,
            port,
            spec.tensor_parallel_size,
            SpeculativeConfig.parse(spec.speculative_config),
        )
        for spec, devices, group in zip(workers, placed, ports, strict=True)
        for device, port in zip(devices, group, strict=True)
    ]


def pd_counts(p_rate: int, d_rate: int, instances: int) -> tuple[int, int]:
    """Prefill and decode counts for `instances` workers split p_rate:d_rate (each >= 1)."""
    p = max(1, min(instances - 1, round(instances * p_rate / (p_rate + d_rate))))
    return p, instances - p


def pd_workers(
    pd: PDSpec, workload: WorkloadSpec | None, src: Source
) -> tuple[WorkerSpec, ...] | None:
    """Workers for fixed rates; () when the rates are 0/0 (automatic); None on an issue."""
    if (pd.default_p_rate == 0) != (pd.default_d_rate == 0):
        src.error("pd.default_p_rate", "give both rates > 0, or 0/0 for automatic sizing")
        return None
    if pd.default_p_rate == 0:
        if workload is None:
            src.error("pd", "automatic sizing (rates 0/0) needs a `workload:` section")
            return None
        for role in ("prefill", "decode"):
            text = getattr(pd, f"{role}_device")
            if ":" in text and not text.startswith("cpu"):
                kind = text.split(":")[0]
                src.error(
                    f"pd.{role}_device",
                    f"{text!r}: automatic sizing may run several workers there; write a bare "
                    f"'{kind}' so each gets its own index",
                )
        return ()
    if pd.instances < 2:
        src.error("pd.instances", f"{pd.instances}: a P:D ratio needs at least 2 instances")
        return None
    p, d = pd_counts(pd.default_p_rate, pd.default_d_rate, pd.instances)
    return workers_for_counts(pd, p, d)


def workers_for_counts(pd: PDSpec, prefill: int, decode: int) -> tuple[WorkerSpec, ...]:
    """The worker list for `prefill` + `decode` workers on the pd section's devices."""
    return tuple(
        WorkerSpec(
            role,
            getattr(pd, f"{role}_device"),
            count,
            dtype=getattr(pd, f"{role}_dtype"),
            kv_layout=getattr(pd, f"{role}_kv_layout"),
            tensor_parallel_size=getattr(pd, f"{role}_tensor_parallel_size"),
        )
        for role, count in (("prefill", prefill), ("decode", decode))
    )


def check_faults(raw: Any, ids: list[str], src: Source) -> dict[str, tuple[dict[str, Any], ...]]:
    """`transfer.faults`: real worker ids mapped to lists of valid FaultRule fields."""
    from transfer import FaultRule

    if not isinstance(raw, dict):
        src.error("transfer.faults", "transfer.faults must map worker ids to lists of rules")
        return {}
    out = {}
    for worker_id, rules in raw.items():
        key = f"transfer.faults.{worker_id}"
        if worker_id not in ids:
            src.error(key, f"no such worker; the workers are {', '.join(ids)}")
            continue
        if not isinstance(rules, list) or not all(isinstance(r, dict) for r in rules):
            src.error(key, "must be a list of mappings (FaultRule fields)")
            continue
        for rule in rules:
            try:
                FaultRule(**rule)
            except (TypeError, ValueError) as e:
                src.error(key, str(e))
        out[str(worker_id)] = tuple(dict(r) for r in rules)
    return out
