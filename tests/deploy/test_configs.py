"""Every file in configs/ is valid: CPU-only ones on this host, all of them for Kubernetes."""

from __future__ import annotations

from pathlib import Path

import pytest

from backends import get_backend, parse_device_spec
from hetero_pd.deploy.schema import load_deployment
from hetero_pd.deploy.source import ConfigError
from hetero_pd.deploy.validate import validate_file
from hetero_pd.deploy.workers import expand_workers

from .conftest import CONFIGS

FILES = sorted(CONFIGS.glob("*.yaml"))


def _needs_accelerator(path: Path) -> bool:
    dep = load_deployment(path)
    devices = [w.device for w in expand_workers(dep.workers)]
    return any(
        parse_device_spec(d)[0] != "cpu" and not get_backend(parse_device_spec(d)[0]).device_count()
        for d in devices
    )


def test_the_expected_examples_exist() -> None:
    names = {p.name for p in FILES}
    expected = {"local.yaml", "colocated.yaml", "ascend-h100.yaml", "edge.yaml"}
    assert expected | {"k8s-multinode.yaml", "bare-metal.yaml"} <= names
    assert (CONFIGS / "README.md").is_file()


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_config_is_valid_for_kubernetes(path: Path) -> None:
    if any(w.host for w in load_deployment(path).workers):
        with pytest.raises(ConfigError, match="`host:` lists bare-metal hosts"):
            validate_file(path, "k8s")
        return
    report = validate_file(path, "k8s")
    assert report.workers
    assert f"{path}: valid (target k8s)" in report.summary()


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_config_is_valid_on_this_host_unless_it_needs_accelerators(path: Path) -> None:
    if _needs_accelerator(path):
        pytest.skip("names accelerators this host lacks (covered by test_broken_configs)")
    report = validate_file(path, "local", check_ports=False)
    assert "valid (target local)" in report.summary()


def test_local_yaml_is_one_prefill_and_one_decode_on_cpu() -> None:
    report = validate_file(CONFIGS / "local.yaml", "local", check_ports=False)
    assert [(w.worker_id, w.role, w.device) for w in report.workers] == [
        ("prefill-0", "prefill", "cpu"),
        ("decode-0", "decode", "cpu"),
    ]
    # The SLO its goodput is measured at reaches the router's elastic prefill.
    routing = load_deployment(CONFIGS / "local.yaml").router.router_config(16).routing
    assert routing.tpot_slo_ms == 100


def test_ascend_h100_puts_prefill_on_npu_and_decode_on_cuda() -> None:
    dep = load_deployment(CONFIGS / "ascend-h100.yaml")
    placed = {w.worker_id: w.device for w in expand_workers(dep.workers)}
    assert placed == {
        "prefill-0": "npu:0",
        "prefill-1": "npu:1",
        "decode-0": "cuda:0",
        "decode-1": "cuda:1",
    }


def test_k8s_multinode_splits_instances_by_the_rates() -> None:
    dep = load_deployment(CONFIGS / "k8s-multinode.yaml")
    assert [(w.role, w.device, w.count) for w in dep.workers] == [
        ("prefill", "npu", 2),
        ("decode", "cuda", 6),
    ]


def test_bare_metal_lists_each_hosts_workers_and_ports() -> None:
    dep = load_deployment(CONFIGS / "bare-metal.yaml")
    placed = [(w.worker_id, w.device, w.address) for w in expand_workers(dep.workers)]
    assert placed == [
        ("prefill-0", "npu:0", "tcp://10.0.0.2:9000"),
        ("prefill-1", "npu:1", "tcp://10.0.0.2:9002"),
        ("prefill-2", "npu:0", "tcp://10.0.0.3:9000"),
        ("prefill-3", "npu:1", "tcp://10.0.0.3:9002"),
        ("decode-0", "cuda:0", "tcp://10.0.0.4:9000"),
        ("decode-1", "cuda:1", "tcp://10.0.0.4:9002"),
    ]
