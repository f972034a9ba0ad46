"""What an operator applies: secrets only in a Secret (read through secretKeyRef), worker ports
closed to all but the deployment's own pods, pods rolled when the file or a secret changes,
one image per device kind, Ascend's driver mounts, memory-backed /dev/shm, no root."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from hetero_pd.deploy import k8s, k8s_secrets
from hetero_pd.deploy.cli import render_main, validate_main
from hetero_pd.deploy.cluster import pod_worker_config
from hetero_pd.deploy.schema import load_deployment
from hetero_pd.deploy.source import ConfigError
from hetero_pd.deploy.validate import validate_file
from hetero_pd.secrets import WorkerCredential

from .test_k8s import K8S_VERSION

BASE = """
version: 1
model: smollm2-135m-instruct
workers:
  - {role: prefill, device: npu, count: 2}
  - {role: decode, device: cuda}
router: {port: 8000}
transfer: {transports: [tcp]}
"""


def _docs(manifests: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [m for m in manifests if m["kind"] == kind]


def _pod(manifests: list[dict[str, Any]], name: str) -> dict[str, Any]:
    obj = next(m for m in manifests if m["metadata"]["name"] == name and "template" in m["spec"])
    spec: dict[str, Any] = obj["spec"]["template"]["spec"]
    return spec


def _env(pod: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in pod["containers"][0]["env"]}


@pytest.fixture(autouse=True)
def _no_secrets_in_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HETERO_PD_SECRET", raising=False)
    monkeypatch.delenv("HETERO_PD_API_KEY", raising=False)
    monkeypatch.delenv("HETERO_PD_PRIORITY_API_KEY", raising=False)


def test_secrets_live_in_a_secret_read_through_secret_key_refs(
    write_yaml: Callable[[str], Path],
) -> None:
    text = BASE.replace("{port: 8000}", "{port: 8000, api_keys: [k-123]}")
    path = write_yaml(text.replace("[tcp]}", "[tcp], secret: s3cr3t-of-16-bytes}"))
    out = k8s.render(validate_file(path, "k8s").deployment)
    text = k8s.dump(out)
    assert "api_keys" in path.read_text()
    (secret,) = _docs(out, "Secret")
    assert secret["metadata"]["name"] == "hetero-pd-secrets"

    def worker_key(role: str) -> str:
        return WorkerCredential.for_group(b"s3cr3t-of-16-bytes", role).text()

    assert secret["stringData"] == {
        "secret": "s3cr3t-of-16-bytes",
        "worker-key-prefill": worker_key("prefill"),  # one per StatefulSet: a role's pods
        "worker-key-decode": worker_key("decode"),
        "api-keys": "k-123",
    }
    config = _docs(out, "ConfigMap")[0]["data"]["deployment.yaml"]
    assert "s3cr3t" not in config and "k-123" not in config
    assert yaml.safe_load(config)["workers"][0]["role"] == "prefill"  # still the deployment
    assert text.count("s3cr3t") == 1 and text.count("k-123") == 1  # only in the Secret
    router, worker = _env(_pod(out, "hetero-pd-router")), _env(_pod(out, "hetero-pd-decode"))
    ref = {"secretKeyRef": {"name": "hetero-pd-secrets", "key": "secret"}}
    assert router["HETERO_PD_SECRET"]["valueFrom"] == ref
    ref = {"secretKeyRef": {"name": "hetero-pd-secrets", "key": "worker-key-decode"}}
    assert worker["HETERO_PD_WORKER_KEY"]["valueFrom"] == ref
    prefill = _env(_pod(out, "hetero-pd-prefill"))
    assert (
        prefill["HETERO_PD_WORKER_KEY"]["valueFrom"]["secretKeyRef"]["key"] == "worker-key-prefill"
    )
    assert "HETERO_PD_SECRET" not in worker  # a worker's key cannot act as the router
    assert "HETERO_PD_WORKER_KEY" not in router
    assert router["HETERO_PD_API_KEY"]["valueFrom"]["secretKeyRef"]["key"] == "api-keys"
    assert "HETERO_PD_API_KEY" not in worker  # workers never see the API keys
    for doc in out:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_priority_keys_are_secrets_too(write_yaml: Callable[[str], Path]) -> None:
    """Keys allowed to set `priority` are API keys: they leave the ConfigMap for the Secret,
    which only the router reads (optional there, so an operator's own Secret may lack it)."""
    router = "{port: 8000, api_keys: [k-123, vip-456], priority_api_keys: [vip-456]}"
    out = k8s.render(
        validate_file(write_yaml(BASE.replace("{port: 8000}", router)), "k8s").deployment
    )
    config = _docs(out, "ConfigMap")[0]["data"]["deployment.yaml"]
    assert "vip-456" not in config and "priority_api_keys" not in config
    (secret,) = _docs(out, "Secret")
    assert secret["stringData"]["priority-api-keys"] == "vip-456"
    assert k8s.dump(out).count("vip-456") == 2  # the Secret's two lists, nowhere else
    router_env, worker = _env(_pod(out, "hetero-pd-router")), _env(_pod(out, "hetero-pd-decode"))
    ref = router_env["HETERO_PD_PRIORITY_API_KEY"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "hetero-pd-secrets", "key": "priority-api-keys", "optional": True}
    assert "HETERO_PD_PRIORITY_API_KEY" not in worker
    for doc in out:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_operator_keys_are_secrets_only_the_router_reads(write_yaml: Callable[[str], Path]) -> None:
    router = "{port: 8000, api_keys: [k-123], admin_keys: [ops-789]}"
    out = k8s.render(
        validate_file(write_yaml(BASE.replace("{port: 8000}", router)), "k8s").deployment
    )
    config = _docs(out, "ConfigMap")[0]["data"]["deployment.yaml"]
    assert "ops-789" not in config and "admin_keys" not in config
    (secret,) = _docs(out, "Secret")
    assert secret["stringData"]["admin-keys"] == "ops-789"
    assert k8s.dump(out).count("ops-789") == 1
    router_env, worker = _env(_pod(out, "hetero-pd-router")), _env(_pod(out, "hetero-pd-decode"))
    ref = router_env["HETERO_PD_ADMIN_KEY"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "hetero-pd-secrets", "key": "admin-keys", "optional": True}
    assert "HETERO_PD_ADMIN_KEY" not in worker


def test_an_absent_secret_is_generated_or_taken_from_the_environment(
    write_yaml: Callable[[str], Path],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = write_yaml(BASE)
    dep = load_deployment(path)
    first, second = (k8s_secrets.secret_values(dep) for _ in range(2))
    assert first.generated and len(first.secret) >= 40 and first.secret != second.secret
    out_file = path.with_suffix(".out.yaml")
    assert render_main(["k8s", str(path), "-o", str(out_file)]) == 0
    assert "generated a new deployment secret" in capsys.readouterr().err
    monkeypatch.setenv("HETERO_PD_SECRET", "from-env-16-bytes")
    monkeypatch.setenv("HETERO_PD_API_KEY", "a, b")
    values = k8s_secrets.secret_values(dep)
    want = ("from-env-16-bytes", ("a", "b"), False)
    assert (values.secret, values.api_keys, values.generated) == want
    assert render_main(["k8s", str(path), "-o", str(out_file)]) == 0
    assert "generated" not in capsys.readouterr().err
    (secret,) = [d for d in yaml.safe_load_all(out_file.read_text()) if d["kind"] == "Secret"]
    assert secret["stringData"]["secret"] == "from-env-16-bytes"
    assert secret["stringData"]["api-keys"] == "a,b"


def test_an_existing_secret_is_referenced_not_rendered(write_yaml: Callable[[str], Path]) -> None:
    path = write_yaml(BASE + "kubernetes: {existing_secret: ops-managed}\n")
    out = k8s.render(load_deployment(path))
    assert not _docs(out, "Secret")
    env = _env(_pod(out, "hetero-pd-prefill"))
    assert env["HETERO_PD_WORKER_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "ops-managed"
    env = _env(_pod(out, "hetero-pd-router"))
    assert env["HETERO_PD_SECRET"]["valueFrom"]["secretKeyRef"]["name"] == "ops-managed"


def test_worker_ports_are_open_only_to_the_deployments_pods(
    write_yaml: Callable[[str], Path],
) -> None:
    out = k8s.render(load_deployment(write_yaml(BASE + "kubernetes: {base_port: 9200}\n")))
    (policy,) = _docs(out, "NetworkPolicy")
    instance = {"app.kubernetes.io/name": "hetero-pd", "app.kubernetes.io/instance": "hetero-pd"}
    spec = policy["spec"]
    assert spec["podSelector"]["matchLabels"] == instance
    (workers,) = spec["podSelector"]["matchExpressions"]
    assert workers["values"] == ["decode", "prefill"]  # not the router: its Service is open
    (rule,) = spec["ingress"]
    assert rule["from"] == [{"podSelector": {"matchLabels": instance}}]
    assert [p["port"] for p in rule["ports"]] == [9200, 9201, 9202]  # control, transfer, data
    worker = _pod(out, "hetero-pd-decode")["containers"][0]
    assert [p["containerPort"] for p in worker["ports"]] == [9200, 9201, 9202]
    # the data channel listens where the policy opens it (it was a random port: every
    # session waited out the link timeout, then fell back to frames on the link)
    dep = load_deployment(write_yaml(BASE + "kubernetes: {base_port: 9200}\n"))
    cfg = pod_worker_config(dep, "decode-0", "", "10.1.2.3")
    assert (cfg.port, cfg.transfer.port, cfg.transfer.data_port) == (9200, 9201, 9202)
    router_labels = _docs(out, "Deployment")[0]["spec"]["template"]["metadata"]["labels"]
    assert instance.items() <= router_labels.items()  # the router is one of the allowed pods
    off = k8s.render(load_deployment(write_yaml(BASE + "kubernetes: {network_policy: false}\n")))
    assert not _docs(off, "NetworkPolicy")


def test_a_change_of_file_or_secret_rolls_every_pod(write_yaml: Callable[[str], Path]) -> None:
    def sums(text: str, secret: str, keys: tuple[str, ...] = ()) -> set[str]:
        out = k8s.render(load_deployment(write_yaml(text)), k8s_secrets.SecretValues(secret, keys))
        templates = [m["spec"]["template"] for m in out if "template" in m.get("spec", {})]
        assert len(templates) == 3
        return {t["metadata"]["annotations"][k8s_secrets.CHECKSUM_ANNOTATION] for t in templates}

    a, b = "a" * 16, "b" * 16
    base = sums(BASE, a)
    assert len(base) == 1  # router and workers roll together
    assert sums(BASE, a) == base
    assert sums(BASE, b) != base
    assert sums(BASE, a, ("key",)) != base
    assert sums(BASE.replace("port: 8000", "port: 8001"), a) != base


def test_pods_get_their_kinds_image_runtime_and_driver_mounts(
    write_yaml: Callable[[str], Path],
) -> None:
    images = "{router: r:1, cpu: c:1, cuda: g:1, npu: a:1}"
    path = write_yaml(
        BASE + f"kubernetes: {{images: {images}, runtime_classes: {{cuda: nvidia}}, "
        "shm_size: 2Gi}\n"
    )
    out = k8s.render(load_deployment(path))
    router, prefill, decode = (_pod(out, f"hetero-pd-{n}") for n in ("router", "prefill", "decode"))
    assert [p["containers"][0]["image"] for p in (router, prefill, decode)] == ["r:1", "a:1", "g:1"]
    assert decode["runtimeClassName"] == "nvidia" and "runtimeClassName" not in prefill
    npu_mounts = {m["mountPath"] for m in prefill["containers"][0]["volumeMounts"]}
    assert "/usr/local/Ascend/driver" in npu_mounts
    assert not any("Ascend" in m["mountPath"] for m in decode["containers"][0]["volumeMounts"])
    host_paths = {v["hostPath"]["path"] for v in prefill["volumes"] if "hostPath" in v}
    assert "/usr/local/Ascend/driver" in host_paths
    for pod in (router, prefill, decode):
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["shm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "2Gi"}
        mounts = {m["mountPath"]: m["name"] for m in pod["containers"][0]["volumeMounts"]}
        assert mounts["/dev/shm"] == "shm" and mounts["/tmp"] == "tmp"
        c = pod["containers"][0]["securityContext"]
        assert c["readOnlyRootFilesystem"] and c["runAsNonRoot"]
        assert c["capabilities"] == {"drop": ["ALL"]} and not c["allowPrivilegeEscalation"]
        assert pod["securityContext"]["runAsUser"] == 1000
        assert pod["automountServiceAccountToken"] is False
    only_image = k8s.render(load_deployment(write_yaml(BASE + "kubernetes: {image: one:2}\n")))
    assert {_pod(only_image, "hetero-pd-decode")["containers"][0]["image"]} == {"one:2"}


def test_validate_refuses_an_open_api_on_a_load_balancer(
    write_yaml: Callable[[str], Path],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = write_yaml(BASE + "kubernetes: {service_type: LoadBalancer}\n")
    assert validate_main(["--target", "k8s", str(path)]) == 1
    err = capsys.readouterr().err
    assert "kubernetes.service_type" in err and "auth is off (no API key)" in err
    assert render_main(["k8s", str(path)]) == 1
    monkeypatch.setenv("HETERO_PD_API_KEY", "k1")
    assert validate_main(["--target", "k8s", str(path)]) == 0
    monkeypatch.delenv("HETERO_PD_API_KEY")
    keyed = write_yaml(BASE.replace("{port: 8000}", "{port: 8000, api_keys: [k]}"))
    assert validate_file(keyed, "k8s").warnings[0].key == "router.api_keys"  # not in ConfigMap
    managed = write_yaml(BASE + "kubernetes: {service_type: LoadBalancer, existing_secret: ops}\n")
    assert "non-empty api-keys" in str(validate_file(managed, "k8s").warnings[0])
    assert validate_file(write_yaml(BASE), "k8s")  # ClusterIP: inside the cluster only


def test_unknown_image_kinds_and_relative_mounts_are_errors(
    write_yaml: Callable[[str], Path],
) -> None:
    path = write_yaml(
        BASE + "kubernetes: {images: {tpu: x}, host_mounts: {npu: [usr/local/Ascend]}}\n"
    )
    with pytest.raises(ConfigError) as e:
        validate_file(path, "k8s")
    text = str(e.value)
    assert "kubernetes.images.tpu: unknown kind; allowed: router, cpu, cuda, npu" in text
    assert "'usr/local/Ascend' is not an absolute path" in text


def test_compiled_code_caches_are_private_to_each_pod(write_yaml: Callable[[str], Path]) -> None:
    """Every pod runs as one uid on a shared /models volume, so a kernel library or an
    inductor cache entry (which inductor unpickles) written there by one pod passed the
    ownership check in every other: the compile caches go to the pod's own /tmp."""
    out = k8s.render(load_deployment(write_yaml(BASE)))
    tmp = {"name": "tmp", "emptyDir": {}}
    for name in ("hetero-pd-router", "hetero-pd-prefill", "hetero-pd-decode"):
        pod = _pod(out, name)
        env = _env(pod)
        cache = env["HETERO_PD_COMPILE_CACHE_DIR"]["value"]
        assert cache.startswith("/tmp/") and not cache.startswith(k8s.MODEL_DIR)
        assert tmp in pod["volumes"]
        mounts = {m["mountPath"]: m["name"] for m in pod["containers"][0]["volumeMounts"]}
        assert mounts["/tmp"] == "tmp"
        # an emptyDir is 0777 without the sticky bit, but no other uid is in the pod: named
        # private, so the check of the folders above the caches keeps compiled code on
        assert env["HETERO_PD_PRIVATE_DIR"]["value"] == "/tmp"
