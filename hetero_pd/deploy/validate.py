"""`hetero-pd validate CONFIG`: everything that can be wrong, found before anything starts.

Loading (`schema`) already checked keys, types, ranges, roles, device syntax and device
assignment. Here the deployment is checked against its target:

- `local` (one box): the model is a known name or a usable folder; every accelerator a
  worker names exists on this host; the router's port is free.
- `k8s` (a cluster): the host's hardware does not matter; ports are fixed and derived
  (workers use `kubernetes.base_port`, `+1` and `+2`, which must not clash with the router's);
  each role runs one device kind (one StatefulSet per role); names are valid DNS labels.
"""

from __future__ import annotations

import errno
import re
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from backends import get_backend, parse_device_spec
from hetero_pd.deploy.formats import worker_formats
from hetero_pd.deploy.schema import Deployment, load_deployment
from hetero_pd.deploy.sections import IMAGE_KINDS
from hetero_pd.deploy.source import Issue, Source
from hetero_pd.deploy.workers import WorkerInstance, expand_workers, host_ports, place_workers

TARGETS = ("local", "k8s")
Warn = Callable[[str, str], None]
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


@dataclass(slots=True)
class Report:
    """A valid deployment, the worker processes it runs, and what deserves a look."""

    deployment: Deployment
    target: str
    workers: list[WorkerInstance]
    warnings: list[Issue] = field(default_factory=list)

    def summary(self) -> str:
        """What will run, one aspect per line, then the warnings."""
        dep = self.deployment
        r = dep.router
        lines = [f"{dep.source}: valid (target {self.target})"]
        lines.append(f"  model       {dep.model} ({dep.dtype})")
        url = f"http://{r.host}:{r.port or '<any free port>'}"
        if self.target == "k8s":
            url = f"http://{dep.kubernetes.name}-router:{r.port}"
        lines.append(
            f"  router      {url}  policy {r.policy}, "
            f"on prefill failure: {r.failure_policy}, API keys: {len(r.api_keys)}"
        )
        formats = worker_formats(dep)
        if dep.pd is not None and dep.automatic:
            lines.append("  workers     automatic P/D counts (see `hetero-pd plan`)")
        for i, w in enumerate(self.workers):
            head = "  workers     " if i == 0 else "              "
            device = w.device
            if self.target == "k8s" and device != "cpu":
                device = f"{device.split(':')[0]} (one per pod)"
            fmt = formats[w.worker_id]
            layout = "" if fmt.kv_layout == "auto" else f", KV {fmt.kv_layout}"
            lines.append(f"{head}{w.worker_id:<12} {w.role:<8} {device} ({fmt.dtype}{layout})")
        t = dep.transfer
        lines.append(
            f"  transfer    {', '.join(t.transports)}; checksum {'on' if t.checksum else 'off'}"
            f"; layer-wise {'on' if t.layerwise else 'off'}; timeout {t.timeout_s:g} s"
        )
        s = dep.supervisor
        restart = (
            f"restart after {s.backoff_s:g} s (doubling to {s.backoff_max_s:g} s), at most "
            f"{s.max_restarts} per {s.window_s:g} s"
            if s.restart
            else "no restarts"
        )
        lines.append(f"  supervisor  {restart}; role switching {'on' if s.role_switch else 'off'}")
        if dep.edge is not None:
            e = dep.edge
            lines.append(
                f"  edge        split layer {e.split_layer}, codec {e.codec}, runtime {e.runtime}"
                + ("" if e.enabled else " (disabled)")
            )
        if self.target == "k8s":
            k = dep.kubernetes
            lines.append(
                f"  kubernetes  {k.namespace}/{k.name}, image {k.image}, worker ports "
                f"{k.base_port} (control), {k.base_port + 1} (transfer), {k.base_port + 2} (data)"
            )
        lines += [f"  warning: {w}" for w in self.warnings]
        return "\n".join(lines)


def validate_file(
    path: str | Path, target: str = "local", check_ports: bool = True, host_id: str | None = None
) -> Report:
    """Loads and validates `path`; ConfigError lists every issue (file, line, key)."""
    return validate(load_deployment(path), target, check_ports, host_id)


def validate(
    dep: Deployment, target: str = "local", check_ports: bool = True, host_id: str | None = None
) -> Report:
    """Checks `dep` against `target` ("local" or "k8s"); raises ConfigError on any issue.
    A file that lists workers by host is checked here only for what `host_id` runs (its
    workers' ports, and the router's when it is `router.host`)."""
    if target not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS}, got {target!r}")
    src = Source(dep.source, dict(dep.lines))
    warnings: list[Issue] = []

    def warn(key: str, message: str) -> None:
        warnings.append(Issue(src.name, src.line(key), key, message))

    _check_model(dep, target, src, warn)
    if target == "local":
        _check_host_devices(dep, src)
        if any(w.host for w in dep.workers):
            _check_host_part(dep, host_id, check_ports, src, warn)
        elif check_ports and dep.router.port:
            _check_port_free(dep.router.host, dep.router.port, src, "router.port")
        _check_edge_tls(dep, check_ports and not any(w.host for w in dep.workers), src)
    else:
        _check_k8s(dep, src, warn)
    src.raise_if_any()
    return Report(dep, target, expand_workers(dep.workers), warnings)


def _check_model(dep: Deployment, target: str, src: Source, warn: Warn) -> None:
    from hetero_pd.models.config import ModelConfig
    from hetero_pd.models.fetch import KNOWN_MODELS, MARKER, check_model_dir, model_dir

    key = dep.model.lower()
    path = Path(dep.model).expanduser()
    folder: Path | None = None
    if key in KNOWN_MODELS and not path.is_dir():
        if (model_dir(key) / MARKER).is_file():
            folder = model_dir(key)
        elif target == "local":
            warn("model", f"{dep.model} is not fetched yet; serve fetches it first")
    elif target == "k8s" and path.is_absolute():
        warn("model", f"{path} is not checked here: it must exist inside the pods")
    elif not path.is_dir():
        src.error(
            "model",
            f"{dep.model!r} is neither a known model ({', '.join(KNOWN_MODELS)}) nor a folder",
        )
    else:
        folder = path
    if folder is None:
        return
    try:
        check_model_dir(folder)
        cfg = ModelConfig.from_dir(folder)
    except ValueError as e:
        src.error("model", str(e))
        return
    _check_drafts(dep, folder, src)
    if dep.edge is not None and dep.edge.split_layer >= cfg.num_layers:
        src.error(
            "edge.split_layer",
            f"{dep.edge.split_layer}: the model has {cfg.num_layers} layers; the split must "
            f"leave the cloud at least one (0..{cfg.num_layers - 1}, 0 = automatic)",
        )
    if dep.edge is not None and dep.edge.max_recovery is not None:
        from edge.privacy import PrivacyFloorError, PrivacyProfileError, check_split

        try:
            check_split(dep.model, dep.edge.split_layer, dep.edge.max_recovery)
        except (PrivacyProfileError, PrivacyFloorError) as e:
            src.error("edge.max_recovery", str(e))


def _check_drafts(dep: Deployment, target: Path, src: Source) -> None:
    """Each `draft_model` draft: a usable model folder with the target's tokenizer."""
    from hetero_pd.engine.spec.config import SpeculativeConfig
    from hetero_pd.engine.spec.draft import check_same_tokenizer
    from hetero_pd.models.fetch import resolve_model

    for i, w in enumerate(dep.workers):
        spec = SpeculativeConfig.parse(w.speculative_config)
        if spec is None or spec.model is None:
            continue
        try:
            check_same_tokenizer(target, resolve_model(spec.model, fetch=False))
        except (OSError, ValueError) as e:
            src.error(f"workers[{i}].speculative_config.model", str(e))


def _check_host_devices(dep: Deployment, src: Source) -> None:
    base = "pd" if dep.pd is not None else "workers"
    specs = dep.workers
    if dep.automatic and dep.pd is not None:
        from hetero_pd.deploy.workers import workers_for_counts

        specs = workers_for_counts(dep.pd, 1, 1)
    for i, devices in enumerate(place_workers(specs, Source(), base)):
        if specs[i].host:
            continue  # another host's devices: `serve --host-id` checks them there
        key = f"pd.{specs[i].role}_device" if base == "pd" else f"workers[{i}].device"
        if base == "workers" and specs[i].devices:
            key = f"workers[{i}].devices"
        missing = []
        for device in devices:
            kind, index = parse_device_spec(device)
            # a tensor-parallel worker takes its device and the tp - 1 after it
            for n in range(index or 0, (index or 0) + specs[i].tensor_parallel_size):
                if kind != "cpu" and n >= get_backend(kind).device_count():
                    missing.append(f"{kind}:{n}")
        if missing:
            kind = parse_device_spec(missing[0])[0]
            count = get_backend(kind).device_count()
            src.error(
                key,
                f"{', '.join(missing)}: this host has {count} {kind} device(s)"
                + (f", numbered 0..{count - 1}" if count else "")
                + "; for a cluster validate with --target k8s",
            )


def _check_host_part(
    dep: Deployment, host_id: str | None, check_ports: bool, src: Source, warn: Warn
) -> None:
    """Bare metal: the ports of the part of `dep` that host `host_id` runs."""
    hosts = sorted({w.host for w in dep.workers})
    if host_id is None:
        warn(
            "workers",
            f"lists workers by host ({', '.join(hosts)}): their ports are checked on each "
            "host, with `hetero-pd validate CONFIG --host-id HOST`",
        )
        return
    if host_id not in hosts and host_id != dep.router.host:
        src.error(
            "workers",
            f"--host-id {host_id}: the file lists no worker there (its hosts: "
            f"{', '.join(hosts)}) and router.host is {dep.router.host}",
        )
        return
    if not check_ports:
        return
    if dep.router.host == host_id and dep.router.port:
        _check_port_free(host_id, dep.router.port, src, "router.port")
    every = host_ports(dep.workers, Source())
    for i, (spec, ports) in enumerate(zip(dep.workers, every, strict=True)):
        if spec.host == host_id:
            for port in ports:
                for p in (port, port + 1):  # control, transfer
                    _check_port_free(host_id, p, src, f"workers[{i}].port")


def _check_edge_tls(dep: Deployment, check_port: bool, src: Source) -> None:
    """The edge listener (`edge.tls`): its port free here, the given certificate and key
    loadable as a pair (none given: serve generates them)."""
    edge = dep.edge
    if edge is None or not edge.enabled or not edge.tls:
        return
    if check_port and edge.port:
        _check_port_free(dep.router.host, edge.port, src, "edge.port")
    if edge.tls_cert or edge.tls_key:
        from hetero_pd.serving.api.edge_tls import edge_cert

        try:
            edge_cert(edge.tls_cert, edge.tls_key, dep.router.host).server_context()
        except ValueError as e:
            src.error("edge.tls_cert" if edge.tls_cert else "edge.tls_key", str(e))


def _check_port_free(host: str, port: int, src: Source, key: str = "router.port") -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # As aiohttp binds: connections of a stopped server in TIME_WAIT do not block the
        # port, a listening socket still does.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
                src.error(
                    key,
                    f"{host} is not an address of this machine ({e.strerror}): validate each "
                    "host's part on that host (--host-id)",
                )
            else:
                src.error(
                    key,
                    f"{host}:{port} cannot be bound ({e.strerror}); another process has it: "
                    "choose another port, or 0 for any free one",
                )


def _check_k8s(dep: Deployment, src: Source, warn: Warn) -> None:
    k = dep.kubernetes
    for key, value in (("kubernetes.name", k.name), ("kubernetes.namespace", k.namespace)):
        if not _DNS_LABEL.fullmatch(value) or len(value) > 40:
            src.error(key, f"{value!r} must be a DNS label: a-z, 0-9 and '-', at most 40 long")
    if dep.router.port == 0:
        src.error("router.port", "0 (any free port) only works on one box; give a fixed port")
    elif dep.router.port in (k.base_port, k.base_port + 1, k.base_port + 2):
        src.error(
            "router.port",
            f"{dep.router.port} clashes with the worker ports derived from kubernetes.base_port "
            f"({k.base_port} control, {k.base_port + 1} transfer, {k.base_port + 2} data)",
        )
    kinds: dict[str, set[str]] = {}
    for w in dep.workers:
        for d in w.devices or (w.device,):
            kinds.setdefault(w.role, set()).add(parse_device_spec(d)[0])
    for role, found in kinds.items():
        if len(found) > 1:
            src.error(
                "workers",
                f"on Kubernetes each role runs one device kind (one StatefulSet per role); "
                f"{role} workers use {', '.join(sorted(found))}",
            )
    local_only = sorted(set(dep.transfer.transports) - {"tcp"})
    if local_only and "tcp" not in dep.transfer.transports:
        src.error("transfer.transports", "pods on different nodes need 'tcp'; add it")
    elif local_only:
        warn("transfer.transports", f"{', '.join(local_only)} only help workers on one host")
    if any(w.host for w in dep.workers):
        src.error("workers", "`host:` lists bare-metal hosts; on Kubernetes pods are placed")
    _check_k8s_kinds(dep, src)
    _check_k8s_secrets(dep, src, warn)


def _check_k8s_kinds(dep: Deployment, src: Source) -> None:
    k = dep.kubernetes
    kinds = ("cpu", "cuda", "npu")
    for key, names, allowed in (
        ("kubernetes.images", k.images, IMAGE_KINDS),
        ("kubernetes.runtime_classes", k.runtime_classes, kinds),
        ("kubernetes.host_mounts", k.host_mounts, kinds),
    ):
        for name in names:
            if name not in allowed:
                src.error(f"{key}.{name}", f"unknown kind; allowed: {', '.join(allowed)}")
    for kind, paths in k.host_mounts.items():
        for path in paths:
            if not path.startswith("/"):
                src.error(f"kubernetes.host_mounts.{kind}", f"{path!r} is not an absolute path")


def _check_k8s_secrets(dep: Deployment, src: Source, warn: Warn) -> None:
    from hetero_pd.deploy.k8s_secrets import API_KEYS_ENV, SECRET_ENV, api_keys

    k = dep.kubernetes
    exposed = k.service_type in ("LoadBalancer", "NodePort")
    if exposed and k.existing_secret:
        warn(
            "kubernetes.existing_secret",
            f"the router is a {k.service_type}: give {k.existing_secret} a non-empty "
            "api-keys entry, or the API is open to anyone who reaches it",
        )
    elif exposed and not api_keys(dep):
        src.error(
            "kubernetes.service_type",
            f"a {k.service_type} exposes the API outside the cluster, and auth is off (no API "
            f"key): set router.api_keys, or {API_KEYS_ENV} when rendering, or "
            "kubernetes.existing_secret with an api-keys entry; or use ClusterIP",
        )
    if dep.router.api_keys or dep.transfer.secret:
        key = "router.api_keys" if dep.router.api_keys else "transfer.secret"
        warn(
            key,
            f"moved into the Secret {k.name}-secrets (never the ConfigMap); better kept out "
            f"of the file: {SECRET_ENV} / {API_KEYS_ENV} when rendering, or "
            "kubernetes.existing_secret",
        )
