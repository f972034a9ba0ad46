"""Bare-metal host lists (ports and devices per host, the parts each host runs) and the
bind/advertise check every worker passes before it starts."""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path

import pytest

from hetero_pd import envs
from hetero_pd.deploy import addresses
from hetero_pd.deploy.addresses import AddressError, bind_address, check_advertised
from hetero_pd.deploy.hosts import host_worker_configs, run_host
from hetero_pd.deploy.schema import load_deployment
from hetero_pd.deploy.serve import main as serve_main
from hetero_pd.deploy.source import ConfigError
from hetero_pd.deploy.validate import validate_file
from hetero_pd.deploy.workers import expand_workers

HOSTS = """
version: 1
model: smollm2-135m-instruct
workers:
  - {role: prefill, device: npu:0, host: 10.0.0.2}
  - {role: prefill, device: npu:0, host: 10.0.0.3}
  - {role: decode, devices: [cuda:0, cuda:1], host: 127.0.0.1, port: 9100}
router: {host: 10.0.0.1, port: 8000}
"""


def test_workers_are_placed_and_numbered_per_host(write_yaml: Callable[[str], Path]) -> None:
    dep = load_deployment(write_yaml(HOSTS))
    placed = [(w.worker_id, w.device, w.host, w.port) for w in expand_workers(dep.workers)]
    assert placed == [
        ("prefill-0", "npu:0", "10.0.0.2", 9000),  # npu:0 on two hosts: two devices
        ("prefill-1", "npu:0", "10.0.0.3", 9000),
        ("decode-0", "cuda:0", "127.0.0.1", 9100),
        ("decode-1", "cuda:1", "127.0.0.1", 9102),
    ]
    report = validate_file(write_yaml(HOSTS), "local", check_ports=False)
    assert len(report.workers) == 4  # other hosts' accelerators are not looked for here


@pytest.mark.parametrize(
    ("workers", "message"),
    [
        (
            "[{role: prefill, host: a}, {role: decode}]",
            "workers[1].host: list a host for every worker group, or for none",
        ),
        (
            "[{role: prefill, host: a, port: 9001}, {role: decode, host: a, port: 9000}]",
            "port 9001 on a is already used by workers[0]",
        ),
        (
            "[{role: prefill, device: npu:0, host: a}, {role: decode, device: npu:0, host: a}]",
            "npu:0 on a is already used by workers[0].device",
        ),
    ],
)
def test_host_list_mistakes_are_named(
    write_yaml: Callable[[str], Path], workers: str, message: str
) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_deployment(write_yaml(f"version: 1\nmodel: m\nworkers: {workers}\n"))


def test_a_host_runs_its_own_workers_bound_to_its_address(
    write_yaml: Callable[[str], Path],
) -> None:
    dep = load_deployment(write_yaml(HOSTS))
    configs = host_worker_configs(dep, "127.0.0.1")
    assert [(c.worker_id, c.host, c.port, c.transfer.port) for c in configs] == [
        ("decode-0", "127.0.0.1", 9100, 9101),
        ("decode-1", "127.0.0.1", 9102, 9103),
    ]
    assert all(c.advertise_host == "127.0.0.1" for c in configs)
    with pytest.raises(AddressError, match=r"10.0.0.2 \(10.0.0.2\) is not an address of this"):
        host_worker_configs(dep, "10.0.0.2")  # started on the wrong machine
    with pytest.raises(ValueError, match="lists no worker there"):
        run_host(dep, "10.9.9.9", _never)
    with pytest.raises(ValueError, match="--host-id HOST"):
        run_host(dep, None, _never)


def test_serve_refuses_a_host_list_without_a_host_id(
    write_yaml: Callable[[str], Path],
) -> None:
    with pytest.raises(ValueError, match=r"lists workers by host \(10.0.0.2, 10.0.0.3, 127"):
        serve_main([str(write_yaml(HOSTS))])


async def _never() -> None:
    raise AssertionError("the router must not start here")


def test_an_advertised_name_must_lead_back_to_the_bound_address(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    check_advertised("127.0.0.1", "localhost", "worker decode-0", wait_s=0)
    table = {"pod-a.svc": ["10.1.0.7"]}

    def resolve(name: str) -> list[str]:
        if name not in table:
            raise socket.gaierror(-2, "Name or service not known")
        return table[name]

    monkeypatch.setattr(addresses, "resolve", resolve)
    with pytest.raises(AddressError) as e:
        check_advertised("10.1.0.5", "pod-a.svc", "worker decode-0", wait_s=0)
    assert str(e.value).startswith(
        "worker decode-0 advertises pod-a.svc, which resolves to 10.1.0.7, but it binds "
        "10.1.0.5: peers would connect to 10.1.0.7, where it does not listen"
    )
    with pytest.raises(AddressError, match=r"'pod-b\.svc' does not resolve on this host"):
        check_advertised("10.1.0.5", "pod-b.svc", "worker decode-0", wait_s=0)
    with pytest.raises(AddressError, match="data channel advertises the address it binds"):
        check_advertised("0.0.0.0", "pod-a.svc", "worker decode-0", wait_s=0)
    table["late.svc"] = ["10.1.0.9"]
    calls: list[str] = []
    real = resolve

    def lagging(name: str) -> list[str]:  # DNS still has the previous pod's address
        calls.append(name)
        return ["10.1.0.9"] if len(calls) < 3 else ["10.1.0.5"]

    monkeypatch.setattr(addresses, "resolve", lagging)
    check_advertised("10.1.0.5", "late.svc", "worker decode-0", wait_s=5)
    assert len(calls) == 3 and real("pod-a.svc") == ["10.1.0.7"]


def test_the_wait_for_an_advertised_name_comes_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Unset: 10 s; $HETERO_PD_ADVERTISE_WAIT_S otherwise, read where the check runs (a
    pod's process), so a wrong name fails as soon as that says."""
    monkeypatch.delenv("HETERO_PD_ADVERTISE_WAIT_S", raising=False)
    assert envs.advertise_wait_s() == 10.0
    calls: list[str] = []

    def wrong(name: str) -> list[str]:
        calls.append(name)
        return ["10.1.0.7"]

    monkeypatch.setattr(addresses, "resolve", wrong)
    monkeypatch.setattr(addresses.time, "sleep", lambda s: None)  # count tries, not seconds
    monkeypatch.setenv("HETERO_PD_ADVERTISE_WAIT_S", "0")
    with pytest.raises(AddressError, match="where it does not listen"):
        check_advertised("10.1.0.5", "pod-a.svc", "worker decode-0")
    assert calls == ["pod-a.svc"]  # one look, no retry
    monkeypatch.setenv("HETERO_PD_ADVERTISE_WAIT_S", "-1")
    with pytest.raises(ValueError, match="HETERO_PD_ADVERTISE_WAIT_S must be >= 0"):
        check_advertised("10.1.0.5", "pod-a.svc", "worker decode-0")


def test_bind_address_resolves_names_of_this_host() -> None:
    assert bind_address("127.0.0.1") == "127.0.0.1"
    assert bind_address("localhost", wait_s=0) == "127.0.0.1"


def test_validate_checks_the_part_of_the_host_it_runs_on(
    write_yaml: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """`validate` of a multi-host file failed on every machine but the router's ("cannot
    be bound ... another process has it"): without --host-id it checks no other host's
    addresses; with it, that host's ports, and an address that is not this machine's is
    named as such."""
    from hetero_pd.deploy.cli import validate_main

    path = write_yaml(HOSTS)
    assert validate_main([str(path)]) == 0
    assert "--host-id" in capsys.readouterr().out  # says what it did not check
    assert validate_main([str(path), "--host-id", "10.0.0.1"]) == 1
    err = capsys.readouterr().err
    assert "router.port" in err and "10.0.0.1 is not an address of this machine" in err
    assert "another process" not in err
    with socket.socket() as busy:  # this host's decode workers take 4 ports from a free one
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        path = write_yaml(HOSTS.replace("port: 9100", f"port: {port - 3}"))
        assert validate_main([str(path), "--host-id", "127.0.0.1"]) == 1
        err = capsys.readouterr().err
        assert "workers[2].port" in err and f"127.0.0.1:{port}" in err and "another process" in err
    for _ in range(3):  # freed, that port may be any process's ephemeral port meanwhile
        if validate_main([str(path), "--host-id", "127.0.0.1"]) == 0:
            break
        assert "another process" in capsys.readouterr().err
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            path = write_yaml(HOSTS.replace("port: 9100", f"port: {probe.getsockname()[1] - 3}"))
    else:
        pytest.fail("no free ports for this host's workers in three tries")
    assert validate_main([str(path), "--host-id", "10.9.9.9"]) == 1
    assert "lists no worker" in capsys.readouterr().err
