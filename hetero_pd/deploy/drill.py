"""A deployment across hosts, run on this machine: every "host" a network namespace
(`hetero_pd.deploy.netns`), every process exactly what the deployment says it is.

    Kubernetes mode (`k8s_cluster`): the manifests are rendered from the file, and each pod
    runs its container's command, arguments and environment parsed from them
    (`hetero_pd.deploy.pods`), on a host of its own whose DNS name the others resolve:

        router ── drill-router-0           hetero-pd serve ... --role router --host 0.0.0.0
        prefill-0 ─ drill-prefill-0.drill-prefill.default.svc   --role worker --host $(POD_IP)
        prefill-1 ─ drill-prefill-1...     decode-0 ─ drill-decode-0...     client

    Bare-metal mode (`bare_metal_cluster`): the file lists the workers by host address and
    each host runs `hetero-pd serve CONFIG --host-id <its address>`.

Pods are forked (`DrillSpec.fork_pods`, the default) from a fork server that imported
`hetero-pd`'s modules once: each runs `hetero_pd.cli:main`, what the `hetero-pd` command
runs, with its container's arguments and environment, in its host's namespaces; or exec'd.
The client host talks to the router's API only over the bridge. `Cluster` starts, kills
(-9), replaces and adds pods the way a kubelet and `kubectl scale` would; a pod that dies
while the drill waits for it fails the drill with the end of its log.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml

from hetero_pd import envs
from hetero_pd.deploy import k8s, netns, netns_sys, pods
from hetero_pd.deploy.drill_client import Api, alive, wait_until
from hetero_pd.deploy.k8s_secrets import SecretValues
from hetero_pd.deploy.schema import Deployment, parse_text
from hetero_pd.deploy.testing import SMALL_ENGINE
from hetero_pd.secrets import worker_environment

T = TypeVar("T")
NAME = "drill"
ROUTER_PORT = 8000
CLAIM = "drill-models"


class DrillError(RuntimeError):
    """The deployment did not behave; the message says what, with the relevant log."""


@dataclass(frozen=True, slots=True)
class DrillSpec:
    """What to deploy: a model (folder or known name) on `prefill` + `decode` hosts."""

    model: str
    prefill: int = 2
    decode: int = 1
    ready_timeout_s: float = 240.0
    #: Ranks of every worker (tensor parallelism inside each host's worker).
    tensor_parallel_size: int = 1
    #: Extra keys for the deployment file's sections (router, transfer, engine).
    overrides: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: Pods forked from a process that imported hetero-pd once (`Lab.spawn(entry=...)`),
    #: not exec'd: the same command, arguments and environment without ~3 s of CPU each.
    fork_pods: bool = True

    def worker_ids(self) -> list[str]:
        return [f"prefill-{i}" for i in range(self.prefill)] + [
            f"decode-{i}" for i in range(self.decode)
        ]


@dataclass(slots=True)
class Pod:
    """One pod (or bare-metal host part) and its current process."""

    name: str
    host: str
    start: Callable[[], pods.PodProcess]
    proc: netns.Proc | None = None
    log_path: Path | None = None
    runs: int = 0


@dataclass(slots=True)
class Cluster:
    """The lab, the deployment and its pods; see the module docstring."""

    lab: netns.Lab
    dep: Deployment
    workdir: Path
    api: Api
    pods: dict[str, Pod] = field(default_factory=dict)  # worker id or "router" -> its pod
    manifests: list[dict[str, Any]] = field(default_factory=list)
    claims: dict[str, str] = field(default_factory=dict)  # PVC name -> folder
    keep: bool = False  # leave the workdir (manifests, logs) behind
    model: str = ""  # the model as this machine names it (pods may see another path)
    fork_pods: bool = True  # DrillSpec.fork_pods

    def call(self, fn: Callable[..., T], *args: Any, timeout_s: float = 600) -> T:
        """`fn(*args)` on the client host (its sockets go over the lab's bridge)."""
        return self.lab.call_in("client", fn, *args, timeout_s=timeout_s)

    def run(self, key: str) -> None:
        """Starts (or starts again, as a kubelet does) pod `key`'s process."""
        pod = self.pods[key]
        spec = pod.start()
        pod.runs += 1
        pod.log_path = self.workdir / "logs" / f"{spec.name}.{pod.runs}.log"
        pod.log_path.parent.mkdir(parents=True, exist_ok=True)
        entry = spec.entry if self.fork_pods else ""
        with open(pod.log_path, "wb") as log:
            pod.proc = self.lab.spawn(
                pod.host, spec.argv, spec.env, spec.mounts, spec.name, log, entry=entry,
                preload=pods.PRELOAD,
            )  # fmt: skip

    def kill(self, key: str) -> None:
        """kill -9 of the pod's whole process group (a container dies with all it runs)."""
        proc = self.pods[key].proc
        assert proc is not None
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)

    def wait_workers(self, ids: set[str], pids: dict[str, int] | None = None) -> None:
        """Until the router sees every worker in `ids` alive (with a new pid where `pids`
        names the old one); a pod that exits meanwhile fails the drill with its log."""

        def ready() -> bool:
            self._check_running()
            return self.call(alive, self.api, ids, pids)

        def detail() -> str:
            logs = "".join(f"\nthe end of {k}'s log:\n{self.log_tail(k)}" for k in sorted(ids))
            return f"the router sees {self.call(self.api.workers)}{logs}"

        try:
            wait_until(f"the router did not see {sorted(ids)} alive", ready, self._timeout, detail)
        except TimeoutError as e:
            raise DrillError(str(e)) from None

    def pids(self) -> dict[str, int]:
        return {w: int(v.get("pid") or 0) for w, v in self.call(self.api.workers).items()}

    def log_tail(self, key: str, lines: int = 12) -> str:
        path = self.pods[key].log_path
        text = path.read_text(errors="replace") if path and path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def close(self) -> None:
        self.lab.close()
        if not self.keep:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def _check_running(self) -> None:
        for key, pod in self.pods.items():
            if pod.proc is not None and pod.proc.poll() is not None:
                raise DrillError(
                    f"pod {pod.name} ({key}) exited with code {pod.proc.returncode}; "
                    f"the end of its log:\n{self.log_tail(key)}"
                )

    @property
    def _timeout(self) -> float:
        return float(self.dep.supervisor.ready_timeout_s)


def k8s_cluster(spec: DrillSpec, dns: dict[str, str] | None = None) -> Cluster:
    """The rendered manifests' pods on their own hosts, up and seen by the router.
    `dns` (worker id -> host) points a worker's name elsewhere (see `add_worker`)."""
    lab = netns.Lab()
    workdir = Path(tempfile.mkdtemp(prefix="hetero-pd-drill-"))
    try:
        model, claims = _model_volume(spec.model)
        dep = parse_text(_config(spec, model, k8s_mode=True), "drill.yaml")
        key = secrets.token_urlsafe(16)
        manifests = k8s.render(dep, SecretValues(secrets.token_urlsafe(32), (key,)))
        (workdir / "manifests.yaml").write_text(k8s.dump(manifests))
        for name in ("client", "router"):
            lab.add_host(name)
        router_ip = lab.hosts["router"].address
        api = Api(f"http://{router_ip}:{ROUTER_PORT}", key, model)
        cluster = Cluster(lab, dep, workdir, api, manifests=manifests, claims=claims)
        cluster.model, cluster.fork_pods = spec.model, spec.fork_pods
        cluster.pods["router"] = Pod(
            f"{NAME}-router-0",
            "router",
            _pod_start(cluster, f"{NAME}-router", f"{NAME}-router-0", "router"),
        )
        ids = spec.worker_ids()
        for worker_id in ids:
            add_worker(cluster, worker_id, dns)
        cluster.run("router")
        cluster.wait_workers(set(ids))
        return cluster
    except BaseException:
        lab.close()
        shutil.rmtree(workdir, ignore_errors=True)  # the error carries what the logs said
        raise


def add_worker(cluster: Cluster, worker_id: str, dns: dict[str, str] | None = None) -> None:
    """A new host for worker `worker_id`'s pod, its DNS record (as the headless Service publishes
    it) and the pod started: what `kubectl scale` does. `dns` (worker id -> host) points
    a worker's name at another host, to break the deployment on purpose."""
    lab, dep = cluster.lab, cluster.dep
    lab.add_host(worker_id)
    lab.dns[k8s.pod_host(dep, worker_id)] = lab.hosts[(dns or {}).get(worker_id, worker_id)].address
    lab.write_hosts()
    role = worker_id.rsplit("-", 1)[0]
    pod = k8s.pod_name(dep, worker_id)
    start = _pod_start(cluster, k8s.service_name(dep, role), pod, worker_id)
    cluster.pods[worker_id] = Pod(pod, worker_id, start)
    cluster.run(worker_id)


def bare_metal_cluster(spec: DrillSpec) -> Cluster:
    """Workers listed by host address; each host runs `serve CONFIG --host-id ADDRESS`."""
    lab = netns.Lab()
    workdir = Path(tempfile.mkdtemp(prefix="hetero-pd-drill-"))
    try:
        ids = spec.worker_ids()
        for name in ("client", "router", *ids):
            lab.add_host(name)
        hosts = {w: lab.hosts[w].address for w in ids}
        text = _config(spec, spec.model, k8s_mode=False, hosts=hosts, router=lab.hosts["router"])
        config = workdir / "deployment.yaml"
        config.write_text(text)
        dep = parse_text(text, str(config))
        key, secret = secrets.token_urlsafe(16), secrets.token_urlsafe(32)
        env = {**_image_env(), "HETERO_PD_SECRET": secret, "HETERO_PD_API_KEY": key}
        # hosts of workers only get their worker's credential: none can act as the router
        # nor as another worker
        workers_env = {w: worker_environment(env, secret.encode(), [w]) for w in ids}
        for one in workers_env.values():
            one.pop("HETERO_PD_API_KEY")
        api = Api(f"http://{lab.hosts['router'].address}:{ROUTER_PORT}", key, spec.model)
        cluster = Cluster(lab, dep, workdir, api, model=spec.model, fork_pods=spec.fork_pods)
        for host in ("router", *ids):
            address = lab.hosts[host].address
            argv = pods.local_command(["hetero-pd", "serve", str(config), "--host-id", address])
            one = workers_env.get(host, env)
            run = pods.PodProcess(host, host, argv, one, [], pods.entry_point(argv))
            cluster.pods[host] = Pod(host, host, _always(run))
            cluster.run(host)
        cluster.wait_workers(set(ids))
        return cluster
    except BaseException:
        lab.close()
        shutil.rmtree(workdir, ignore_errors=True)  # the error carries what the logs said
        raise


def _pod_start(
    cluster: Cluster, workload: str, pod: str, host: str
) -> Callable[[], pods.PodProcess]:
    def start() -> pods.PodProcess:
        ip, c = cluster.lab.hosts[host].address, cluster
        return pods.pod_process(c.manifests, workload, pod, ip, c.workdir, c.claims, _image_env())

    return start


def _always(run: pods.PodProcess) -> Callable[[], pods.PodProcess]:
    return lambda: run


def _image_env() -> dict[str, str]:
    """What the image's environment provides (there is no image here): PATH with the
    installed `hetero-pd`, this source tree on PYTHONPATH, a HOME the pod may write; and the
    engine tuning the drill's caller set (`envs.ENGINE_TUNING`: tests run eager, like the
    suite's own engines, and resolve `auto` alike in every process), and its
    $HETERO_PD_ADVERTISE_WAIT_S where set."""
    source = Path(__file__).resolve().parents[2]
    path = f"{Path(sys.executable).parent}:{netns_sys.SYSTEM_PATH}"
    env = {"PATH": path, "PYTHONPATH": str(source), "HOME": "/tmp", "LANG": "C.UTF-8"}
    wait = {k: v for k, v in os.environ.items() if k == envs.ADVERTISE_WAIT_S}
    return {**env, **envs.engine_tuning(), **wait}


def _model_volume(model: str) -> tuple[str, dict[str, str]]:
    """The model as pods name it, and the folder backing the models claim (read-only)."""
    path = Path(model).expanduser()
    if path.is_dir():
        return f"{k8s.MODEL_DIR}/{path.resolve().name}", {CLAIM: str(path.resolve().parent)}
    return model, {CLAIM: str(envs.cache_dir())}


def _config(
    spec: DrillSpec,
    model: str,
    k8s_mode: bool,
    hosts: dict[str, str] | None = None,
    router: netns.Host | None = None,
) -> str:
    workers: list[dict[str, Any]] = []
    if hosts is None:
        workers = [{"role": "prefill", "count": spec.prefill}, {"role": "decode", "count": 1}]
        workers[1]["count"] = spec.decode
    else:
        workers = [{"role": w.rsplit("-", 1)[0], "host": ip} for w, ip in hosts.items()]
    for w in workers:
        w["tensor_parallel_size"] = spec.tensor_parallel_size
    o = spec.overrides
    raw: dict[str, Any] = {
        "version": 1,
        "model": model,
        "workers": workers,
        "router": {
            "host": router.address if router else "127.0.0.1",
            "port": ROUTER_PORT,
            "policy": "round_robin",  # every prefill worker takes its turn
            **o.get("router", {}),
        },
        "engine": {**SMALL_ENGINE, **o.get("engine", {})},
        "transfer": {"timeout_s": 15.0, "remote_kv_timeout_s": 30.0, **o.get("transfer", {})},
        "supervisor": {"ready_timeout_s": spec.ready_timeout_s},
    }
    if k8s_mode:
        raw["kubernetes"] = {"name": NAME, "model_pvc": CLAIM, "network_policy": True}
    return f"# hetero-pd drill ({'kubernetes' if k8s_mode else 'bare metal'})\n" + yaml.safe_dump(
        raw, sort_keys=False
    )
