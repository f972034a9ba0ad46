"""NPU wiring, tested against a FAKE torch_npu.

CI machines have no Ascend hardware and no torch_npu, so `fake_npu/torch_npu.py` stands in
for it: a module injected into sys.modules (monkeypatch) or found on sys.path, that records
the calls `backends.npu` makes. Building "npu:N" torch.devices needs torch's PrivateUse1
type renamed to "npu", which (like the real torch_npu) is process-wide and irreversible, so
those checks run in a child interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest
import torch

from backends import BackendUnavailableError, available_backends, get_backend, parse_device
from backends.npu import NpuBackend

REPO = Path(__file__).resolve().parents[2]
FAKE_NPU_DIR = Path(__file__).parent / "fake_npu"
INSTALL_HINT = "pip install hetero-pd[npu]"


@pytest.mark.usefixtures("no_torch_npu")
def test_missing_torch_npu_is_unavailable_with_install_hint() -> None:
    backend = NpuBackend()
    assert not backend.is_available()
    assert backend.device_count() == 0
    assert "npu" not in available_backends()
    operations = [
        lambda: backend.device(0),
        lambda: backend.synchronize(),
        lambda: backend.pinned_empty((2,), torch.float16),
        lambda: parse_device("npu:0"),
    ]
    for operation in operations:
        with pytest.raises(BackendUnavailableError, match="torch_npu is not installed") as info:
            operation()
        assert INSTALL_HINT in str(info.value)
        assert "Ascend host" in str(info.value)


def test_importing_backends_does_not_import_torch_npu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.syspath_prepend(str(FAKE_NPU_DIR))
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    try:
        backend = NpuBackend()
        assert "torch_npu" not in sys.modules  # constructing imports nothing
        assert backend.is_available()  # the first device query imports it
        assert "torch_npu" in sys.modules
    finally:
        sys.modules.pop("torch_npu", None)


def test_fake_npus_are_discovered(fake_torch_npu: ModuleType) -> None:
    backend = NpuBackend()
    assert backend.is_available()
    assert backend.device_count() == 2
    assert "npu" in available_backends()
    assert ("device_count",) in fake_torch_npu.npu.calls
    assert not backend.supports_ipc()


def test_torch_npu_without_devices_says_so(
    fake_torch_npu: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fake_torch_npu.npu, "is_available", lambda: False)
    backend = NpuBackend()
    assert not backend.is_available()
    assert backend.device_count() == 0
    with pytest.raises(BackendUnavailableError, match="sees no NPU"):
        backend.device(0)


def test_broken_torch_npu_install_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    broken = ModuleType("torch_npu")  # imports, but provides no torch.npu namespace
    monkeypatch.setitem(sys.modules, "torch_npu", broken)
    monkeypatch.delattr(torch, "npu", raising=False)
    with pytest.raises(BackendUnavailableError, match=r"did not provide torch\.npu"):
        NpuBackend().synchronize()


_CHILD = textwrap.dedent(
    """
    import json, sys
    import backends
    imported_early = "torch_npu" in sys.modules
    from backends import CapabilityProfile, format_devices_table

    npu = backends.get_backend("npu")
    dev = backends.parse_device("npu:1")
    import torch_npu
    calls = torch_npu.npu.calls
    calls.clear()
    npu.synchronize(dev)
    npu.synchronize()
    stream = npu.new_stream(dev)
    event = npu.new_event(dev, enable_timing=True)
    infos = [i for i in backends.list_devices() if i.kind == "npu"]
    try:
        npu.device(2)
        missing = ""
    except ValueError as exc:
        missing = str(exc)
    import torch
    auto = npu.auto_dtype(dev, torch.bfloat16)
    profile = CapabilityProfile("npu", 1, npu.device_name(dev), 1e5, 3e5, 1.6e3, 64 << 30, 0)
    print(json.dumps({
        "dev": str(dev), "type": dev.type, "index": dev.index,
        "device0": str(npu.device()), "backend_for": backends.backend_for(dev).kind,
        "memory": list(npu.memory_info(dev)),
        "stream_device": str(stream.device), "event_timing": event.enable_timing,
        "infos": [[i.kind, i.index, i.device, i.name, i.memory_bytes] for i in infos],
        "calls": [[str(a) for a in c] for c in calls],
        "auto_dtype": [auto.name, auto.reason],
        "missing": missing, "table": format_devices_table([profile]),
        "available": backends.available_backends(), "imported_early": imported_early,
    }))
    """
)


def test_fake_npu_devices_in_a_child_interpreter() -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(FAKE_NPU_DIR), str(REPO), env.get("PYTHONPATH", "")])
    env["FAKE_TORCH_NPU_REGISTER"] = "1"
    env["FAKE_TORCH_NPU_DEVICES"] = "2"
    done = subprocess.run(
        [sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert (out["dev"], out["type"], out["index"]) == ("npu:1", "npu", 1)
    assert out["device0"] == "npu:0"
    assert out["backend_for"] == "npu"
    assert out["available"][0] == "cpu" and "npu" in out["available"]
    assert out["memory"] == [30 << 30, 64 << 30]
    assert out["stream_device"] == "npu:1"
    assert out["event_timing"] is True
    assert out["infos"] == [
        ["npu", 0, "npu:0", "Ascend910B2", 64 << 30],
        ["npu", 1, "npu:1", "Ascend910B2", 64 << 30],
    ]
    assert ["synchronize", "npu:1"] in out["calls"]
    assert ["synchronize", "None"] in out["calls"]
    assert ["Stream", "npu:1"] in out["calls"]
    assert ["Event", "True"] in out["calls"]
    assert "npu:2 does not exist: this host has 2 npu device(s)" in out["missing"]
    assert out["table"].splitlines()[2].split()[:2] == ["npu:1", "Ascend910B2"]
    assert out["imported_early"] is False
    assert out["auto_dtype"] == ["bfloat16", "auto: bfloat16 checkpoint on NPU Ascend910B2"]


def test_registry_hands_out_the_npu_backend() -> None:
    assert isinstance(get_backend("npu"), NpuBackend)
