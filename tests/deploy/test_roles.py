"""Run-time pieces of a deployment: role switching on a live stack, /health and `status`,
the cluster roles (pod worker config, the router reconnecting to a replaced pod), and a
worker that outlives its launcher stopping."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from hetero_pd import omp_wait_defaults, secrets
from hetero_pd.config import EngineConfig
from hetero_pd.deploy import cluster
from hetero_pd.deploy.cluster import HostList, StatefulSetDNS, pod_worker_config
from hetero_pd.deploy.forkserver import ForkedProcess, start_worker
from hetero_pd.deploy.schema import load_deployment
from hetero_pd.deploy.status import main as status_main
from hetero_pd.deploy.testing import deployment, random_prompts, running_stack
from hetero_pd.sampling_params import SamplingParams
from hetero_pd.serving.control import protocol as P
from hetero_pd.serving.worker.config import WorkerConfig
from hetero_pd.serving.worker.main import READY_LINE
from transfer import TransferConfig

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _generate(stack: object, prompt: list[int]) -> list[int]:
    async def run() -> list[int]:
        router = stack.router  # type: ignore[attr-defined]
        rid = f"r{time.monotonic_ns()}"
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        out: list[int] = []
        async for msg in router.generate(rid, prompt, params):
            out += msg.token_ids
        return out

    return stack.call(run())  # type: ignore[attr-defined,no-any-return]


def test_a_worker_switches_between_prefill_and_decode(
    tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dep = deployment(
        tiny_llama_dir,
        workers=[{"role": "prefill", "count": 2}, {"role": "decode"}],
        router={"local_prefill_max_tokens": 0},
    )
    prompts = random_prompts([40, 40, 40], seed=3)
    with running_stack(dep) as stack:
        before = [_generate(stack, p) for p in prompts]
        router = stack.router
        assert router is not None
        stack.call(router.switch_role("prefill-1", "decode"), 60)
        assert router.workers["prefill-1"].role == "decode"
        # Back in rotation when the switch returns, not at its next heartbeat: the router's
        # view of it is no longer the draining load it reported while it switched.
        assert router.workers["prefill-1"].usable
        assert {w.worker_id for w in router.live("decode")} == {"decode-0", "prefill-1"}
        assert [_generate(stack, p) for p in prompts] == before  # same greedy answers
        with pytest.raises(ValueError, match="last prefill worker"):
            stack.call(router.switch_role("prefill-0", "decode"))
        stack.call(router.switch_role("prefill-1", "prefill"), 60)
        assert router.workers["prefill-1"].usable
        assert [_generate(stack, p) for p in prompts] == before
        assert status_main(["--url", stack.url]) == 0
        table = capsys.readouterr().out
        assert "prefill-1  prefill  cpu     up" in table
        body = _get(f"{stack.url}/health")
        assert body["workers"]["prefill-1"]["device"] == "cpu"
        assert body["workers"]["prefill-1"]["state"] == "running"
        assert _get(f"{stack.url}/health?live=1") == {"status": "alive"}
        stack.wait_idle()


def _get(url: str) -> dict[str, Any]:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as r:
        return dict(json.loads(r.read()))


def test_pod_worker_binds_its_pod_ip_and_advertises_its_dns_name() -> None:
    dep = load_deployment(CONFIGS / "ascend-h100.yaml")
    cfg = pod_worker_config(dep, "hetero-pd-decode-1", "/tmp/alive", "10.1.2.3")
    assert (cfg.worker_id, cfg.role, cfg.engine.device) == ("decode-1", "decode", "cuda:0")
    assert (cfg.host, cfg.port, cfg.transfer.port) == ("10.1.2.3", 9000, 9001)
    assert cfg.advertise_host == "hetero-pd-decode-1.hetero-pd-decode.llm.svc"
    assert cfg.transfer.transports == ("tcp",) and cfg.alive_file == "/tmp/alive"
    with pytest.raises(ValueError, match="not <role>-<n>"):
        pod_worker_config(dep, "router-x", "", "10.1.2.3")


def test_the_router_finds_statefulset_pods_by_their_dns_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    dep = load_deployment(CONFIGS / "ascend-h100.yaml")
    names = {cluster.k8s.pod_host(dep, w) for w in ("prefill-0", "decode-0", "decode-1")}
    asked: list[str] = []

    async def resolves(name: str) -> bool:
        asked.append(name)
        return name in names

    monkeypatch.setattr(cluster, "_resolves", resolves)
    found = asyncio.run(StatefulSetDNS(dep)())
    assert found == {
        "prefill-0": "tcp://hetero-pd-prefill-0.hetero-pd-prefill.llm.svc:9000",
        "decode-0": "tcp://hetero-pd-decode-0.hetero-pd-decode.llm.svc:9000",
        "decode-1": "tcp://hetero-pd-decode-1.hetero-pd-decode.llm.svc:9000",
    }
    assert len(asked) == 1 + cluster.LOOKAHEAD + 1 + 2 + cluster.LOOKAHEAD + 1  # bounded probing
    names.add(cluster.k8s.pod_host(dep, "decode-4"))  # a gap (Parallel scale-up): still found
    assert "decode-4" in asyncio.run(StatefulSetDNS(dep)())


def test_bare_metal_workers_get_ports_by_host() -> None:
    from hetero_pd.deploy.schema import parse_deployment

    dep = parse_deployment(
        {
            "model": "smollm2-135m-instruct",
            "workers": [
                {"role": "prefill", "device": "npu:0", "host": "10.0.0.2"},
                {"role": "prefill", "device": "npu:0", "host": "10.0.0.3"},
                {"role": "decode", "devices": ["cuda:0", "cuda:1"], "host": "10.0.0.3"},
            ],
        }
    )
    assert asyncio.run(HostList(dep)()) == {
        "prefill-0": "tcp://10.0.0.2:9000",
        "prefill-1": "tcp://10.0.0.3:9000",
        "decode-0": "tcp://10.0.0.3:9002",
        "decode-1": "tcp://10.0.0.3:9004",
    }


SECRET = secrets.generate()


def small_engine(model: Path) -> EngineConfig:
    return EngineConfig(model=str(model), num_threads=1, num_kv_blocks=32)


async def spawn_worker(cfg: WorkerConfig) -> ForkedProcess:
    """A worker process as the launcher starts one (`supervisor.fork_server`, the suite's
    default): forked from this process's fork server (the one this file's stack started:
    no interpreter imports torch again), config on stdin, credential in its env; its
    stderr is ours, its stdout a pipe (its READY line: nothing to fill it)."""
    env = secrets.worker_environment(dict(os.environ), SECRET.encode(), [cfg.worker_id])
    omp_wait_defaults(env)  # as the launcher: the same fork server
    proc, _ = await start_worker(env, lambda pid: cfg.to_json(), (secrets.WORKER_ENV,))
    return proc


def test_a_worker_whose_launcher_is_gone_stops(
    tiny_llama_dir: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    alive = tmp_path / "alive"
    cfg = WorkerConfig(
        "decode-0",
        "decode",
        small_engine(tiny_llama_dir),
        alive_file=str(alive),
        parent_pid=1,  # not its parent: as if its launcher died and it was re-parented
    )

    async def run() -> tuple[int, bytes]:
        proc = await spawn_worker(cfg)
        out = await asyncio.wait_for(proc.stdout.read(), 60)
        return await asyncio.wait_for(proc.wait(), 60), out

    code, out = asyncio.run(run())
    assert code == 0
    assert READY_LINE in out.decode()
    assert "launcher (pid 1) is gone" in capfd.readouterr().err
    assert alive.is_file()


def test_switch_role_is_a_control_message() -> None:
    codec = P.worker_codec()
    assert codec.decode(codec.encode(P.SwitchRole(role="decode"))) == P.SwitchRole(role="decode")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_cluster_router_reconnects_to_a_replaced_worker_pod(tiny_llama_dir: Path) -> None:
    """The router side of a cluster: it connects by a derived address and, when the worker's
    pod is replaced (same name and port, new process), greets the new one."""
    from hetero_pd.deploy.cluster import keep_connected
    from hetero_pd.serving.control.auth import RouterKeys
    from hetero_pd.serving.router.router import Router, RouterConfig

    port = _free_port()
    cfg = WorkerConfig(
        "decode-0",
        "decode",
        small_engine(tiny_llama_dir),
        TransferConfig(port=_free_port()),
        port=port,
        advertise_host="127.0.0.1",
    )

    async def until(check: object, timeout_s: float = 120.0) -> None:  # generous: shared CPUs
        deadline = time.monotonic() + timeout_s
        while not check():  # type: ignore[operator]
            assert time.monotonic() < deadline, "timed out"
            await asyncio.sleep(0.05)

    async def scenario() -> tuple[int, int]:
        router = Router(
            RouterConfig(heartbeat_timeout_s=0.5), RouterKeys.from_secret(SECRET.encode())
        )
        pod = await spawn_worker(cfg)
        task = asyncio.create_task(keep_connected(router, "decode-0", f"tcp://127.0.0.1:{port}"))
        try:
            await until(lambda: router.live("decode"))
            first = router.workers["decode-0"].info.pid
            assert router.workers["decode-0"].info.address == f"tcp://127.0.0.1:{port}"
            pod.kill()
            await asyncio.wait_for(pod.wait(), 10)
            await until(lambda: not router.live("decode"))
            pod = await spawn_worker(cfg)
            await until(lambda: router.live("decode"))
            return first, router.workers["decode-0"].info.pid
        finally:
            task.cancel()
            with contextlib.suppress(ProcessLookupError):
                pod.kill()
            await asyncio.wait_for(pod.wait(), 10)
            await router.close()

    first, second = asyncio.run(scenario())
    assert first != second


def test_a_worker_whose_transfer_engine_died_exits_to_be_restarted(tiny_llama_dir: Path) -> None:
    """Its transfer engine's I/O thread gone for good (injected here: a fatal exception on
    that thread), a worker finishes what it can and exits non-zero, so its supervisor (or
    Kubernetes) restarts it; before, it stayed up with every transfer failing."""
    from hetero_pd.serving.worker.main import Worker

    cfg = WorkerConfig("prefill-0", "prefill", small_engine(tiny_llama_dir))
    worker = Worker(cfg, secrets.WorkerCredential.for_worker(SECRET.encode(), "prefill-0"))
    try:
        assert worker.transfer.healthy()

        def fatal() -> None:  # the fault: not an Exception, so no step contains it
            raise SystemExit("injected: the transfer I/O thread ends")

        worker.transfer._loop.call(fatal)
        deadline = time.monotonic() + 30
        while worker.transfer.healthy():
            assert time.monotonic() < deadline, "the I/O thread did not end"
            time.sleep(0.01)
        worker._heartbeat(time.monotonic())
        assert worker.draining
        assert worker.fault is not None and "injected" in worker.fault
        worker.serve_forever()  # nothing in flight: it ends at once
    finally:
        worker.close()
