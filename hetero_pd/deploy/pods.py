"""A rendered manifest's pod as a process: exactly its container's command, arguments and
environment, with its volumes, the way a kubelet would start it.

    pod = pod_process(manifests, "drill-decode", ordinal=0, pod_ip="10.251.0.4", ...)
    lab.spawn(host, pod.argv, pod.env, pod.mounts, hostname=pod.name)

Nothing is retyped: `command`+`args` come from the container, `$(VAR)` references are
expanded as Kubernetes does, `env` values come from the manifest (`value`, the downward API
`metadata.name` / `status.podIP`, `secretKeyRef` into the rendered Secret, `configMapKeyRef`),
and each `volumeMount` becomes a mount: a ConfigMap's keys as files (read-only), an emptyDir
as a fresh folder, a memory emptyDir as a tmpfs, a PersistentVolumeClaim as the folder the
caller provides for that claim. The image's own environment (PATH and the like) is the one
thing added, since there is no image here; so is the interpreter, when `hetero-pd` is not
installed as a command (a source checkout).
"""

from __future__ import annotations

import base64
import importlib.metadata
import re
import shutil
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hetero_pd.deploy.netns import Mount

Manifests = list[dict[str, Any]]
#: What the `hetero-pd` command runs (pyproject.toml's [project.scripts]), and what a process
#: forked to run it has imported first: what `serve` loads for a router, a pod's worker and
#: a bare-metal host's part.
ENTRY = "hetero_pd.cli:main"
PRELOAD = (
    "hetero_pd.cli",
    "hetero_pd.deploy.serve",
    "hetero_pd.deploy.hosts",
    "hetero_pd.serving.worker.main",
)
_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


@dataclass(frozen=True, slots=True)
class PodProcess:
    """What to run for one pod: argv, its exact environment, and what it mounts."""

    name: str
    component: str
    argv: list[str]
    env: dict[str, str]
    mounts: list[Mount]
    #: What `argv` runs when it is this installation's `hetero-pd` command (`entry_point`).
    entry: str = ""


def workload(manifests: Manifests, name: str) -> dict[str, Any]:
    """The Deployment or StatefulSet called `name`."""
    for m in manifests:
        if m["kind"] in ("Deployment", "StatefulSet") and m["metadata"]["name"] == name:
            return m
    raise KeyError(f"no Deployment or StatefulSet {name!r} in the manifests")


def pod_process(
    manifests: Manifests,
    workload_name: str,
    pod_name: str,
    pod_ip: str,
    workdir: Path,
    claims: Mapping[str, str],
    image_env: Mapping[str, str],
) -> PodProcess:
    """Pod `pod_name` of `workload_name` with IP `pod_ip`; its folders go under `workdir`.
    `claims` maps a PersistentVolumeClaim name to the folder that backs it."""
    obj = workload(manifests, workload_name)
    template = obj["spec"]["template"]
    (container,) = template["spec"]["containers"]
    fields = {"metadata.name": pod_name, "status.podIP": pod_ip}
    env = dict(image_env)
    for item in container.get("env", []):
        env[item["name"]] = _env_value(item, manifests, fields, env)
    argv = [expand(part, env) for part in container.get("command", []) + container.get("args", [])]
    volumes = {v["name"]: v for v in template["spec"].get("volumes", [])}
    pod_dir = workdir / pod_name
    mounts = [
        _mount(m, volumes[m["name"]], manifests, pod_dir, claims)
        for m in container.get("volumeMounts", [])
        if "hostPath" not in volumes[m["name"]]  # a node's driver paths: none on this box
    ]
    component = template["metadata"]["labels"]["app.kubernetes.io/component"]
    command = local_command(argv)
    return PodProcess(pod_name, component, command, env, mounts, entry_point(command))


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion: defined variables are replaced, `$$` is `$`, and an
    undefined reference stays as written."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return _VAR.sub(sub, text)


def local_command(argv: list[str]) -> list[str]:
    """`argv` with its program found on this machine (the image's PATH has `hetero-pd`)."""
    beside = Path(sys.executable).parent
    found = shutil.which(argv[0], path=str(beside)) or shutil.which(argv[0])
    if found:
        return [found, *argv[1:]]
    if argv[0] == "hetero-pd":  # a source checkout: the same entry point, by module
        return [sys.executable, "-m", "hetero_pd.cli", *argv[1:]]
    raise FileNotFoundError(f"{argv[0]!r} (the container's command) is not installed here")


def entry_point(argv: list[str]) -> str:
    """ENTRY when `argv` (from `local_command`) runs this installation's `hetero-pd`
    command (its console script beside this interpreter, or `python -m hetero_pd.cli`),
    else "": what a process forked to run it calls with `argv` (`Lab.spawn(entry=...)`)."""
    if argv[:3] == [sys.executable, "-m", "hetero_pd.cli"]:
        return ENTRY
    script = shutil.which("hetero-pd", path=str(Path(sys.executable).parent))
    scripts = importlib.metadata.entry_points(group="console_scripts", name="hetero-pd")
    if argv[:1] == [script] and [e.value for e in scripts] == [ENTRY]:
        return ENTRY
    return ""


def _env_value(
    item: dict[str, Any], manifests: Manifests, fields: Mapping[str, str], env: Mapping[str, str]
) -> str:
    if "value" in item:
        return expand(str(item["value"]), env)
    source = item["valueFrom"]
    if "fieldRef" in source:
        return fields[source["fieldRef"]["fieldPath"]]
    if "secretKeyRef" in source:
        ref = source["secretKeyRef"]
        try:
            return _data(_named(manifests, "Secret", ref["name"]), ref["key"])
        except KeyError:
            if ref.get("optional"):  # Kubernetes leaves the variable unset; empty reads alike
                return ""
            raise
    if "configMapKeyRef" in source:
        ref = source["configMapKeyRef"]
        return _data(_named(manifests, "ConfigMap", ref["name"]), ref["key"])
    raise ValueError(f"env {item['name']}: unsupported source {sorted(source)}")


def _mount(
    mount: dict[str, Any],
    volume: dict[str, Any],
    manifests: Manifests,
    pod_dir: Path,
    claims: Mapping[str, str],
) -> Mount:
    target, read_only = mount["mountPath"], bool(mount.get("readOnly", False))
    if "configMap" in volume:
        config_map = _named(manifests, "ConfigMap", volume["configMap"]["name"])
        folder = pod_dir / mount["name"]
        folder.mkdir(parents=True, exist_ok=True)
        for key, text in config_map.get("data", {}).items():
            (folder / key).write_text(text)
        return Mount(target, str(folder), read_only=True)
    if "emptyDir" in volume:
        if volume["emptyDir"].get("medium") == "Memory":
            return Mount(target)  # tmpfs
        folder = pod_dir / mount["name"]
        folder.mkdir(parents=True, exist_ok=True)
        folder.chmod(0o1777)
        return Mount(target, str(folder), read_only)
    if "persistentVolumeClaim" in volume:
        claim = volume["persistentVolumeClaim"]["claimName"]
        if claim not in claims:
            raise ValueError(f"volume {mount['name']}: no folder given for claim {claim!r}")
        return Mount(target, claims[claim], read_only=True)
    raise ValueError(f"volume {mount['name']}: unsupported kind {sorted(volume)}")


def _named(manifests: Manifests, kind: str, name: str) -> dict[str, Any]:
    for m in manifests:
        if m["kind"] == kind and m["metadata"]["name"] == name:
            return m
    raise KeyError(f"no {kind} {name!r} in the manifests (a pod refers to it)")


def _data(obj: dict[str, Any], key: str) -> str:
    if key in obj.get("stringData", {}):
        return str(obj["stringData"][key])
    if obj["kind"] == "Secret" and key in obj.get("data", {}):
        return base64.b64decode(obj["data"][key]).decode()
    if key in obj.get("data", {}):
        return str(obj["data"][key])
    raise KeyError(f"{obj['kind']} {obj['metadata']['name']} has no key {key!r}")
