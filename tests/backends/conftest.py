"""Fixtures for the backends tests."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

FAKE_NPU_DIR = Path(__file__).parent / "fake_npu"


def load_fake_torch_npu(device_count: int = 2) -> ModuleType:
    """A fresh copy of the FAKE torch_npu (see fake_npu/torch_npu.py), not yet in sys.modules."""
    spec = importlib.util.spec_from_file_location("torch_npu", FAKE_NPU_DIR / "torch_npu.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FAKE_TORCH_NPU_DEVICES", str(device_count))
        mp.delenv("FAKE_TORCH_NPU_REGISTER", raising=False)
        spec.loader.exec_module(module)
    return module


@pytest.fixture
def fake_torch_npu(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """FAKE torch_npu with two NPUs injected into sys.modules (undone after the test)."""
    module = load_fake_torch_npu()
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    return module


@pytest.fixture
def no_torch_npu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make `import torch_npu` fail as it does on a host without the npu extra."""
    monkeypatch.setitem(sys.modules, "torch_npu", None)


@pytest.fixture
def isolated_registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Let a test register backends without leaking them into other tests."""
    from backends import registry

    monkeypatch.setattr(registry, "_factories", dict(registry._factories))
    monkeypatch.setattr(registry, "_instances", dict(registry._instances))
    yield
