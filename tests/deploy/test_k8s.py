"""Rendered Kubernetes manifests: valid against a pinned Kubernetes, wired by service names."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from hetero_pd.deploy import k8s
from hetero_pd.deploy.cli import render_main
from hetero_pd.deploy.plan import resolve
from hetero_pd.deploy.schema import load_deployment
from hetero_pd.deploy.validate import validate_file

from .conftest import CONFIGS

#: The Kubernetes version the manifests are checked against (kubernetes-validate bundles it).
K8S_VERSION = "1.30.0"
#: Every example meant for a cluster (bare-metal host lists are not).
FILES = [p for p in sorted(CONFIGS.glob("*.yaml")) if not load_deployment(p).workers[0].host]


def _render(path: Path) -> list[dict[str, Any]]:
    dep, _ = resolve(validate_file(path, "k8s").deployment, use_calibration=False)
    return k8s.render(dep)


def _by(manifests: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    return next(m for m in manifests if m["kind"] == kind and m["metadata"]["name"] == name)


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_manifests_pass_kubernetes_validate(path: Path) -> None:
    text = k8s.dump(_render(path))
    docs = list(yaml.safe_load_all(text))
    kinds = {"ConfigMap", "Deployment", "Service", "StatefulSet", "NetworkPolicy"}
    secret = load_deployment(path).kubernetes.existing_secret
    assert {d["kind"] for d in docs} == kinds | (set() if secret else {"Secret"})
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_an_invalid_manifest_is_caught() -> None:
    doc = _by(_render(CONFIGS / "local.yaml"), "Deployment", "hetero-pd-router")
    doc["spec"]["replicas"] = "one"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_ascend_and_nvidia_workers_request_their_devices() -> None:
    out = _render(CONFIGS / "ascend-h100.yaml")
    prefill = _by(out, "StatefulSet", "hetero-pd-prefill")["spec"]
    decode = _by(out, "StatefulSet", "hetero-pd-decode")["spec"]
    assert prefill["replicas"] == decode["replicas"] == 2
    p_pod, d_pod = prefill["template"]["spec"], decode["template"]["spec"]
    p_res, d_res = p_pod["containers"][0]["resources"], d_pod["containers"][0]["resources"]
    assert p_res["requests"]["huawei.com/Ascend910"] == p_res["limits"]["huawei.com/Ascend910"] == 1
    assert d_res["requests"]["nvidia.com/gpu"] == d_res["limits"]["nvidia.com/gpu"] == 1
    assert "nvidia.com/gpu" not in p_res["limits"]
    assert p_pod["nodeSelector"] == {"accelerator": "ascend-910b"}
    assert d_pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}


def test_workers_are_found_by_service_names_not_addresses() -> None:
    path = CONFIGS / "k8s-multinode.yaml"
    out = _render(path)
    dep = load_deployment(path)
    svc = _by(out, "Service", "pd-multinode-decode")
    assert svc["spec"]["clusterIP"] == "None"
    assert [p["port"] for p in svc["spec"]["ports"]] == [9100, 9101, 9102]
    sts = _by(out, "StatefulSet", "pd-multinode-decode")
    assert sts["spec"]["serviceName"] == "pd-multinode-decode"
    router = _by(out, "Deployment", "pd-multinode-router")["spec"]["template"]["spec"]
    command = router["containers"][0]["command"]
    # No replica counts and no address: the router resolves the pods' names (scaling).
    assert command == [
        "hetero-pd",
        "serve",
        k8s.CONFIG_PATH,
        "--role",
        "router",
        "--host",
        "0.0.0.0",
    ]
    assert k8s.worker_address(dep, "decode-5") == (
        "tcp://pd-multinode-decode-5.pd-multinode-decode.llm-prod.svc:9100"
    )
    assert k8s.worker_id_of_pod(dep, "pd-multinode-decode-5") == "decode-5"
    worker = sts["spec"]["template"]["spec"]["containers"][0]
    args = ["--worker-id", "$(POD_NAME)", "--host", "$(POD_IP)", "--alive-file", k8s.ALIVE_FILE]
    assert worker["command"][3:] == ["--role", "worker", *args]
    env = {e["name"]: e for e in worker["env"]}
    assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}


def test_config_map_holds_the_file_and_probes_use_health() -> None:
    path = CONFIGS / "local.yaml"
    out = _render(path)
    assert _by(out, "ConfigMap", "hetero-pd-config")["data"]["deployment.yaml"] == path.read_text()
    assert "metadata" in _by(out, "Secret", "hetero-pd-secrets")
    router = _by(out, "Deployment", "hetero-pd-router")["spec"]["template"]["spec"]
    c = router["containers"][0]
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["livenessProbe"]["httpGet"]["path"].startswith("/health")
    worker = _by(out, "StatefulSet", "hetero-pd-decode")["spec"]["template"]["spec"]
    probe = worker["containers"][0]["livenessProbe"]["exec"]["command"]
    assert k8s.ALIVE_FILE in probe[-1]
    assert "nodeSelector" not in worker  # cpu workers go anywhere


def test_automatic_counts_are_planned_from_declared_capacity(
    write_yaml: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_yaml(
        """
        version: 1
        model: smollm2-135m-instruct
        workload: {input_len: 512, output_len: 128, rate: 4, ttft_ms: 2000, tpot_ms: 100}
        pd:
          prefill_device: npu
          decode_device: cuda
          capacity:
            npu: {prefill_tokens_per_s: 1024, decode_step_ms: 20, decode_ms_per_seq: 2}
            cuda: {prefill_tokens_per_s: 4096, decode_step_ms: 20, decode_ms_per_seq: 2}
        router: {port: 8000}
        transfer: {transports: [tcp]}
        """
    )
    out_file = path.with_suffix(".out.yaml")
    assert render_main(["k8s", str(path), "-o", str(out_file)]) == 0
    docs = list(yaml.safe_load_all(out_file.read_text()))
    replicas = {
        d["metadata"]["name"]: d["spec"]["replicas"] for d in docs if d["kind"] == "StatefulSet"
    }
    assert replicas == {"hetero-pd-prefill": 3, "hetero-pd-decode": 2}
    err = capsys.readouterr().err
    assert "plan: 3 prefill + 2 decode workers" in err
    assert "declared in pd.capacity.npu" in err


def test_automatic_counts_without_any_speed_is_a_clear_error(
    write_yaml: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_yaml(
        """
        version: 1
        model: smollm2-135m-instruct
        workload: {}
        pd: {prefill_device: npu, decode_device: cuda}
        transfer: {transports: [tcp]}
        """
    )
    assert render_main(["k8s", str(path)]) == 1
    assert "put the numbers under pd.capacity.npu" in capsys.readouterr().err


def test_the_edge_listener_port_is_exposed_with_the_api() -> None:
    """Edge sessions are served over TLS on edge.port: the router's pod and Service open it
    (a deployment without an edge section opens only the API's)."""
    out = _render(CONFIGS / "edge.yaml")
    service = _by(out, "Service", "hetero-pd-router")["spec"]["ports"]
    assert {"name": "edge", "port": 8443, "targetPort": "edge"} in service
    router = _by(out, "Deployment", "hetero-pd-router")["spec"]["template"]["spec"]
    assert {"name": "edge", "containerPort": 8443} in router["containers"][0]["ports"]
    plain = _by(_render(CONFIGS / "local.yaml"), "Service", "hetero-pd-router")["spec"]["ports"]
    assert [p["name"] for p in plain] == ["http"]


@pytest.mark.parametrize(("grace", "pod_grace"), [(10.0, 60), (100.0, 130)])
def test_worker_pods_have_time_to_drain(grace: float, pod_grace: int) -> None:
    """A worker pod's SIGTERM drains it (the router moves its decoding requests when its
    heartbeat says so), so its termination grace covers supervisor.stop_grace_s and the
    exit; no hook calls the router: no worker pod holds an operator key."""
    dep, _ = resolve(validate_file(CONFIGS / "local.yaml", "k8s").deployment, use_calibration=False)
    dep = dataclasses.replace(
        dep, supervisor=dataclasses.replace(dep.supervisor, stop_grace_s=grace)
    )
    out = k8s.render(dep)
    for role in ("prefill", "decode"):
        pod = _by(out, "StatefulSet", f"hetero-pd-{role}")["spec"]["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] == pod_grace
        assert "lifecycle" not in pod["containers"][0]
    for doc in out:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
