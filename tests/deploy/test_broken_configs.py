"""Broken deployment files: each fails with its expected message naming file, line and key."""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path

import pytest

from backends import get_backend
from hetero_pd.deploy.source import ConfigError
from hetero_pd.deploy.validate import validate_file

HEAD = "version: 1\nmodel: smollm2-135m-instruct\n"  # lines 1-2
PD = "workers:\n  - role: prefill\n  - role: decode\n"  # lines 3-5 (after HEAD)

# (name, yaml, target, line, key, fragment of the message)
CASES = [
    ("unknown top-level key", HEAD + PD + "routr: {}\n", "local", 6, "routr", "unknown key"),
    (
        "unknown router key",
        HEAD + PD + "router:\n  host: 127.0.0.1\n  prot: 8000\n",
        "local",
        8,
        "router.prot",
        "unknown key; allowed in router: admin_keys, api_keys",
    ),
    (
        "port is not a number",
        HEAD + PD + "router:\n  port: 80x0\n",
        "local",
        7,
        "router.port",
        "must be an integer, got str '80x0'",
    ),
    (
        "port out of range",
        HEAD + PD + "router:\n  port: 70000\n",
        "local",
        7,
        "router.port",
        "out of range; must be in [0, 65535]",
    ),
    (
        "unknown policy",
        HEAD + PD + "router:\n  policy: fastest\n",
        "local",
        7,
        "router.policy",
        "'fastest' is not allowed; allowed: round_robin, least_loaded, prefix_aware, kv_aware",
    ),
    (
        "unknown rebalance key",
        HEAD + PD + "router:\n  rebalance:\n    enabled: true\n    hgh: 0.9\n",
        "local",
        9,
        "router.rebalance.hgh",
        "unknown key; allowed in router.rebalance: cooldown_s, enabled, high",
    ),
    (
        "negative TPOT target",
        HEAD + PD + "router:\n  tpot_slo_ms: -100\n",
        "local",
        7,
        "router.tpot_slo_ms",
        "-100.0 is out of range; must be in [0.0, 3600000.0]",
    ),
    (
        "an allowance that would overflow",
        HEAD + PD + "router:\n  elastic_tokens_per_output: .inf\n",
        "local",
        7,
        "router.elastic_tokens_per_output",
        "must be a finite number, got inf",
    ),
    (
        "a NaN passes no bound",
        HEAD + PD + "router:\n  tpot_slo_ms: .nan\n",
        "local",
        7,
        "router.tpot_slo_ms",
        "must be a finite number, got nan",
    ),
    (
        "rebalance threshold out of range",
        HEAD + PD + "router:\n  rebalance: {high: 1.5}\n",
        "local",
        7,
        "router.rebalance.high",
        "1.5 is out of range; must be in [0.0, 1.0]",
    ),
    (
        "rebalance low not below high",
        HEAD + PD + "router:\n  rebalance: {high: 0.6, low: 0.6}\n",
        "local",
        7,
        "router.rebalance.low",
        "0.6 must be below router.rebalance.high (0.6)",
    ),
    (
        "two workers on one NPU",
        HEAD + "workers:\n  - role: prefill\n    device: npu:0\n    count: 2\n  - role: decode\n",
        "k8s",
        5,
        "workers[0].device",
        "2 workers on one device npu:0",
    ),
    (
        "one GPU index in two entries",
        HEAD + "workers:\n  - role: prefill\n    device: cuda:1\n"
        "  - role: decode\n    device: cuda:1\n",
        "k8s",
        7,
        "workers[1].device",
        "cuda:1 is already used by workers[0].device",
    ),
    (
        "unknown device kind",
        HEAD + "workers:\n  - role: prefill\n    device: tpu:0\n  - role: decode\n",
        "local",
        5,
        "workers[0].device",
        "unknown device kind 'tpu'",
    ),
    (
        "missing model",
        "version: 1\nmodel: /no/such/model\n" + PD,
        "local",
        2,
        "model",
        "neither a known model (smollm2-135m-instruct) nor a folder",
    ),
    (
        "router port clashes with the derived worker ports",
        HEAD + PD + "router:\n  port: 9001\nkubernetes:\n  base_port: 9000\n",
        "k8s",
        7,
        "router.port",
        "clashes with the worker ports derived from kubernetes.base_port (9000 control",
    ),
    (
        "duplicate key",
        HEAD + PD + "router:\n  port: 8000\n  port: 8001\n",
        "local",
        8,
        "router.port",
        "duplicate key",
    ),
    (
        "only one rate is zero",
        HEAD + "pd:\n  default_p_rate: 1\n  default_d_rate: 0\n  instances: 4\n",
        "local",
        4,
        "pd.default_p_rate",
        "give both rates > 0, or 0/0",
    ),
    (
        "both workers and pd",
        HEAD + PD + "pd:\n  default_p_rate: 1\n  default_d_rate: 1\n  instances: 2\n",
        "local",
        3,
        "workers",
        "exactly one of `workers:`",
    ),
    ("no decode worker", HEAD + "workers:\n  - role: prefill\n", "local", 3, "workers", "decode"),
    ("unsupported version", "version: 2\nmodel: x\n" + PD, "local", 1, "version", "reads 1"),
    (
        "invalid YAML",
        HEAD + "workers:\n  - role: prefill\n   device: cpu\n",
        "local",
        5,
        "",
        "not valid YAML",
    ),
    (
        "engine value out of range",
        HEAD + PD + "engine:\n  max_num_seqs: 0\n",
        "local",
        7,
        "engine.max_num_seqs",
        "0 is out of range; must be > 0",
    ),
    (
        "negative routing knob",
        HEAD + PD + "router:\n  kv_overlap_weight: -1.0\n",
        "local",
        7,
        "router.kv_overlap_weight",
        "-1.0 is out of range; must be >= 0.0",
    ),
    (
        "SSD tier without the host-DRAM tier",
        HEAD + PD + "engine:\n  kv_cache_disk_gb: 1\n",
        "local",
        7,
        "engine.kv_cache_disk_gb",
        "needs kv_cache_host_gb > 0",
    ),
    (
        "devices and count disagree",
        HEAD + "workers:\n  - role: decode\n    devices: [cuda:0, cuda:1]\n    count: 3\n",
        "k8s",
        6,
        "workers[0].count",
        "3 workers but 2 devices listed",
    ),
    (
        "fault for a worker that does not exist",
        HEAD + PD + "transfer:\n  faults:\n    prefill-7: [{kind: drop}]\n",
        "local",
        8,
        "transfer.faults.prefill-7",
        "no such worker; the workers are prefill-0, decode-0",
    ),
    (
        "invalid Kubernetes name",
        HEAD + PD + "kubernetes:\n  name: Hetero_PD\n",
        "k8s",
        7,
        "kubernetes.name",
        "must be a DNS label",
    ),
    (
        "one role on two device kinds",
        HEAD + "workers:\n  - role: prefill\n  - role: decode\n    device: cuda\n"
        "  - role: decode\n    device: cpu\n",
        "k8s",
        3,
        "workers",
        "decode workers use cpu, cuda",
    ),
    (
        "worker without a role",
        HEAD + "workers:\n  - device: cpu\n",
        "local",
        4,
        "workers[0]",
        "missing required key 'role'",
    ),
    (
        "declared capacity of an unknown kind",
        HEAD + "workload: {}\npd:\n  capacity:\n    tpu: {prefill_tokens_per_s: 10}\n",
        "k8s",
        6,
        "pd.capacity.tpu",
        "unknown device kind; allowed: cpu, cuda, npu",
    ),
    (
        "automatic sizing with a device index",
        HEAD + "workload: {}\npd:\n  prefill_device: npu:0\n",
        "k8s",
        5,
        "pd.prefill_device",
        "write a bare 'npu'",
    ),
    (
        "fork_server neither true nor false (unset: the environment decides)",
        HEAD + PD + "supervisor:\n  fork_server: sometimes\n",
        "local",
        7,
        "supervisor.fork_server",
        "must be true or false, got str 'sometimes'",
    ),
]


@pytest.mark.parametrize(
    ("text", "target", "line", "key", "fragment"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_broken_config_fails_with_its_message(
    write_yaml: Callable[[str], Path], text: str, target: str, line: int, key: str, fragment: str
) -> None:
    path = write_yaml(text)
    with pytest.raises(ConfigError) as info:
        validate_file(path, target, check_ports=False)
    expected = f"{path}:{line}: {key}: " if key else f"{path}:{line}: "
    matching = [str(i) for i in info.value.issues if str(i).startswith(expected)]
    assert matching, f"no issue at {expected!r}; got:\n{info.value}"
    assert any(fragment in m for m in matching), str(info.value)


def test_all_issues_are_reported_at_once(write_yaml: Callable[[str], Path]) -> None:
    path = write_yaml(HEAD + PD + "router:\n  prot: 1\n  policy: x\nengine:\n  foo: 1\n")
    with pytest.raises(ConfigError) as info:
        validate_file(path, check_ports=False)
    assert [(i.line, i.key) for i in info.value.issues] == [
        (7, "router.prot"),
        (8, "router.policy"),
        (10, "engine.foo"),
    ]


@pytest.mark.skipif(get_backend("cuda").device_count() > 0, reason="this host has CUDA")
def test_cuda_on_a_host_without_cuda_is_an_error_unless_targeting_k8s(
    write_yaml: Callable[[str], Path],
) -> None:
    path = write_yaml(HEAD + "workers:\n  - role: prefill\n  - role: decode\n    device: cuda\n")
    with pytest.raises(ConfigError) as info:
        validate_file(path, "local", check_ports=False)
    assert f"{path}:6: workers[1].device: cuda:0: this host has 0 cuda device(s)" in str(info.value)
    assert "--target k8s" in str(info.value)
    assert validate_file(path, "k8s").workers[1].device == "cuda:0"


def test_a_port_in_use_is_a_clash(write_yaml: Callable[[str], Path]) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        path = write_yaml(HEAD + PD + f"router:\n  host: 127.0.0.1\n  port: {port}\n")
        with pytest.raises(ConfigError, match=rf"{path}:8: router.port: 127.0.0.1:{port} cannot"):
            validate_file(path, "local")


def test_edge_split_must_leave_the_cloud_a_layer(
    write_yaml: Callable[[str], Path], tiny_llama_dir: Path
) -> None:
    text = f"version: 1\nmodel: {tiny_llama_dir}\n" + PD + "edge:\n  split_layer: 3\n"
    with pytest.raises(ConfigError, match=r":7: edge.split_layer: 3: the model has 3 layers"):
        validate_file(write_yaml(text), check_ports=False)
    ok = text.replace("split_layer: 3", "split_layer: 2")
    assert "split layer 2" in validate_file(write_yaml(ok), check_ports=False).summary()


def test_the_edge_listener_is_checked_before_serve(
    write_yaml: Callable[[str], Path], tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """A certificate that cannot be loaded, a key without its certificate and a busy edge
    port are named with their keys; a generated pair is loaded as serve loads it."""
    from hetero_pd.serving.api.edge_tls import generate

    head = f"version: 1\nmodel: {tiny_llama_dir}\n" + PD + "edge:\n  split_layer: 2\n"
    missing = head + f"  tls_cert: {tmp_path}/nope.pem\n  tls_key: {tmp_path}/nope.key\n"
    with pytest.raises(ConfigError, match=r"edge.tls_cert: .*nope.pem.*cannot load them"):
        validate_file(write_yaml(missing), check_ports=False)
    with pytest.raises(ConfigError, match=r"edge.tls_key: edge.tls_cert is missing"):
        validate_file(write_yaml(head + f"  tls_key: {tmp_path}/k.pem\n"), check_ports=False)
    pair = generate("127.0.0.1")
    try:
        good = head + f"  tls_cert: {pair.cert}\n  tls_key: {pair.key}\n"
        assert "split layer 2" in validate_file(write_yaml(good), check_ports=False).summary()
    finally:
        pair.remove()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        text = head + f"  port: {port}\nrouter:\n  host: 127.0.0.1\n  port: 0\n"
        with pytest.raises(ConfigError, match=rf"edge.port: 127.0.0.1:{port} cannot be bound"):
            validate_file(write_yaml(text), "local")
