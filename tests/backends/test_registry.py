"""Registry, device-string parsing and device discovery."""

from __future__ import annotations

import pytest
import torch

import backends
from backends import (
    Backend,
    DeviceInfo,
    available_backends,
    backend_for,
    get_backend,
    list_devices,
    parse_device,
    parse_device_spec,
    register_backend,
)
from backends.cpu import CpuBackend


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("cpu", torch.device("cpu")),
        ("cpu:0", torch.device("cpu")),
        ("cuda", torch.device("cuda", 0)),
        ("cuda:1", torch.device("cuda", 1)),
        (" CUDA:2 ", torch.device("cuda", 2)),
        (torch.device("cuda", 3), torch.device("cuda", 3)),
        (torch.device("cuda"), torch.device("cuda", 0)),
        (torch.device("cpu"), torch.device("cpu")),
    ],
)
def test_parse_device_normalizes(spec: str | torch.device, expected: torch.device) -> None:
    assert parse_device(spec) == expected


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ("tpu:0", "unknown device kind 'tpu'"),
        ("tpu:0", "cpu, cuda, npu"),
        ("cuda:x", "must be a non-negative integer, as in 'cuda:1'"),
        ("cuda:-1", "must be a non-negative integer"),
        ("cuda:", "must be a non-negative integer"),
        ("cuda:1:2", "expected '<kind>' or '<kind>:<index>'"),
        ("", "expected '<kind>' or '<kind>:<index>'"),
        ("cpu:1", "single device 'cpu'"),
        (torch.device("meta"), "unknown device kind 'meta'"),
    ],
)
def test_parse_device_rejects_junk_clearly(spec: str | torch.device, fragment: str) -> None:
    with pytest.raises(ValueError, match="invalid device") as info:
        parse_device(spec)
    assert fragment in str(info.value)


def test_parse_device_rejects_non_device_types() -> None:
    with pytest.raises(TypeError, match=r"str or torch\.device"):
        parse_device(0)  # type: ignore[arg-type]


def test_parse_device_spec_needs_no_hardware() -> None:
    assert parse_device_spec("npu:3") == ("npu", 3)
    assert parse_device_spec("cuda") == ("cuda", None)


def test_get_backend_unknown_kind_names_allowed_kinds() -> None:
    with pytest.raises(
        ValueError, match=r"unknown backend kind 'tpu'; expected one of: cpu, cuda, npu"
    ):
        get_backend("tpu")


def test_get_backend_is_shared_and_kind_matches() -> None:
    for kind in ("cpu", "cuda", "npu"):
        backend = get_backend(kind)
        assert isinstance(backend, Backend)
        assert backend.kind == kind
        assert get_backend(kind) is backend


def test_backend_for_strings_and_devices() -> None:
    assert backend_for("cuda:1") is get_backend("cuda")
    assert backend_for(torch.device("cpu")) is get_backend("cpu")
    # Works without torch_npu: looking up the backend is not a device operation.
    assert backend_for("npu:0") is get_backend("npu")


def test_available_backends_lists_usable_kinds() -> None:
    kinds = available_backends()
    assert kinds[0] == "cpu"
    assert ("cuda" in kinds) == torch.cuda.is_available()


def test_list_devices_starts_with_the_host() -> None:
    devices = list_devices()
    host = devices[0]
    assert isinstance(host, DeviceInfo)
    assert (host.kind, host.index, host.device) == ("cpu", 0, "cpu")
    assert host.name
    assert host.memory_bytes > 0
    for info in devices[1:]:
        assert info.device == f"{info.kind}:{info.index}"


class _SimBackend(CpuBackend):
    kind = "sim"
    available = False

    def is_available(self) -> bool:
        return self.available


@pytest.mark.usefixtures("isolated_registry")
def test_register_backend_builds_lazily_once() -> None:
    built: list[Backend] = []

    def factory() -> Backend:
        built.append(_SimBackend())
        return built[-1]

    register_backend("sim", factory)
    assert built == []
    assert "sim" in backends.registered_kinds()
    assert "sim" not in available_backends()  # builds it to ask
    assert get_backend("sim") is get_backend("sim") is built[0]
    assert len(built) == 1
    assert parse_device_spec("sim:0") == ("sim", 0)


@pytest.mark.usefixtures("isolated_registry")
def test_register_backend_rejects_duplicates_unless_replaced() -> None:
    with pytest.raises(ValueError, match="already registered; pass replace=True"):
        register_backend("cpu", CpuBackend)
    _SimBackend.available = True
    try:
        register_backend("sim", _SimBackend)
        first = get_backend("sim")
        register_backend("sim", _SimBackend, replace=True)
        assert get_backend("sim") is not first
        assert "sim" in available_backends()
    finally:
        _SimBackend.available = False


@pytest.mark.usefixtures("isolated_registry")
def test_register_backend_validates_kind_and_factory() -> None:
    with pytest.raises(ValueError, match="lowercase identifier"):
        register_backend("Bad Kind", CpuBackend)
    with pytest.raises(TypeError, match="must be callable"):
        register_backend("sim", "not a factory")  # type: ignore[arg-type]
    register_backend("wrong", CpuBackend)
    with pytest.raises(ValueError, match="built a 'cpu' backend"):
        get_backend("wrong")
