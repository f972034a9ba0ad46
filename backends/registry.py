"""Backend registry and device-string parsing.

Backends are registered as factories and built on first use, so asking about "cpu" never
imports vendor code, and an absent vendor stack only shows up as `is_available() == False`.

Device strings are "<kind>" or "<kind>:<index>" ("cpu", "cuda", "cuda:1", "npu:0"). A bare
accelerator kind means index 0: a worker owns one device, and explicit indices keep device
descriptors comparable across processes.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable

import torch

from backends.base import Backend, DeviceInfo

BackendFactory = Callable[[], Backend]

_KIND_RE = re.compile(r"[a-z][a-z0-9_]*")
_SPEC_RE = re.compile(r"(?P<kind>[a-z][a-z0-9_]*)(?::(?P<index>[^:]*))?")

_lock = threading.Lock()
_factories: dict[str, BackendFactory] = {}
_instances: dict[str, Backend] = {}


def _make_cpu() -> Backend:
    from backends.cpu import CpuBackend

    return CpuBackend()


def _make_cuda() -> Backend:
    from backends.cuda import CudaBackend

    return CudaBackend()


def _make_npu() -> Backend:
    from backends.npu import NpuBackend

    return NpuBackend()


def register_backend(kind: str, factory: BackendFactory, *, replace: bool = False) -> None:
    """Register `factory` (called once, on first use) as the backend for `kind`.

    Re-registering a kind raises ValueError unless `replace=True`; replacing drops the
    instance built from the previous factory.
    """
    if not isinstance(kind, str) or not _KIND_RE.fullmatch(kind):
        raise ValueError(f"backend kind must be a lowercase identifier like 'cuda', got {kind!r}")
    if not callable(factory):
        raise TypeError(f"backend factory for {kind!r} must be callable, got {factory!r}")
    with _lock:
        if kind in _factories and not replace:
            raise ValueError(
                f"backend {kind!r} is already registered; pass replace=True to override it"
            )
        _factories[kind] = factory
        _instances.pop(kind, None)


def registered_kinds() -> list[str]:
    """Every registered kind, available on this host or not, in registration order."""
    with _lock:
        return list(_factories)


def get_backend(kind: str) -> Backend:
    """The (shared) backend instance for `kind`; ValueError naming the known kinds if unknown."""
    with _lock:
        backend = _instances.get(kind)
        if backend is not None:
            return backend
        factory = _factories.get(kind)
        if factory is None:
            known = ", ".join(_factories)
            raise ValueError(f"unknown backend kind {kind!r}; expected one of: {known}")
        backend = factory()
        if backend.kind != kind:
            raise ValueError(
                f"the factory registered for {kind!r} built a {backend.kind!r} backend"
            )
        _instances[kind] = backend
        return backend


def parse_device_spec(spec: str | torch.device) -> tuple[str, int | None]:
    """Split a device string into (kind, index or None), checking syntax and kind only.

    Touches no hardware and imports no vendor module, so deployment files naming "npu:3"
    can be validated on any machine. Raises ValueError with the accepted forms otherwise.
    """
    if isinstance(spec, torch.device):
        return _check_kind(spec.type, str(spec)), spec.index
    if not isinstance(spec, str):
        raise TypeError(f"a device must be a str or torch.device, got {type(spec).__name__}")
    text = spec.strip().lower()
    match = _SPEC_RE.fullmatch(text)
    if match is None:
        raise ValueError(f"invalid device {spec!r}: {_forms()}")
    kind = _check_kind(match["kind"], spec)
    raw_index = match["index"]
    if raw_index is None:
        return kind, None
    if not raw_index.isdigit():
        raise ValueError(
            f"invalid device {spec!r}: the index after ':' must be a non-negative integer, "
            f"as in '{kind}:1'"
        )
    return kind, int(raw_index)


def _forms() -> str:
    kinds = ", ".join(registered_kinds())
    return f"expected '<kind>' or '<kind>:<index>' with kind one of {kinds} (e.g. 'cuda:1')"


def _check_kind(kind: str, spec: str) -> str:
    if kind not in registered_kinds():
        raise ValueError(f"invalid device {spec!r}: unknown device kind {kind!r}; {_forms()}")
    return kind


def parse_device(spec: str | torch.device) -> torch.device:
    """Parse "cpu", "cuda", "cuda:1", "npu:0" or a torch.device into a normalized
    torch.device (accelerators get an explicit index; the host is plain "cpu").

    ValueError for malformed strings or unknown kinds; BackendUnavailableError for "npu:N"
    when torch_npu is missing (torch only knows the "npu" type once torch_npu registers it).
    Whether the device exists on this host is checked by `Backend.device()`, not here.
    """
    kind, index = parse_device_spec(spec)
    if kind == "cpu" and index not in (None, 0):
        raise ValueError(f"invalid device {str(spec)!r}: the host is the single device 'cpu'")
    return get_backend(kind).make_device(0 if index is None else index)


def backend_for(device: str | torch.device) -> Backend:
    """The backend that owns `device` (works even when that backend is unavailable here)."""
    kind, _ = parse_device_spec(device)
    return get_backend(kind)


def available_backends() -> list[str]:
    """Kinds usable on this host, in registration order; always includes "cpu"."""
    return [kind for kind in registered_kinds() if get_backend(kind).is_available()]


def list_devices() -> list[DeviceInfo]:
    """Every usable device on this host: the cpu first, then each accelerator by index."""
    return [info for kind in available_backends() for info in get_backend(kind).device_infos()]


register_backend("cpu", _make_cpu)
register_backend("cuda", _make_cuda)
register_backend("npu", _make_npu)
