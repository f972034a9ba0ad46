"""Hardware abstraction: device discovery, capability profiles, streams, events, pinned
memory and copies for cpu, cuda and npu (torch_npu, imported lazily).

Only this package knows device kinds; everything else asks it.
"""

from __future__ import annotations

from backends.base import (
    Backend,
    CapabilityProfile,
    DeviceInfo,
    LinearKernel,
    MoEKernel,
    clear_profile_cache,
)
from backends.dtype import DtypeChoice
from backends.errors import BackendUnavailableError
from backends.registry import (
    available_backends,
    backend_for,
    get_backend,
    list_devices,
    parse_device,
    parse_device_spec,
    register_backend,
    registered_kinds,
)
from backends.table import devices_report, format_devices_table, role_hints

__all__ = [
    "Backend",
    "BackendUnavailableError",
    "CapabilityProfile",
    "DeviceInfo",
    "DtypeChoice",
    "LinearKernel",
    "MoEKernel",
    "available_backends",
    "backend_for",
    "clear_profile_cache",
    "devices_report",
    "format_devices_table",
    "get_backend",
    "list_devices",
    "parse_device",
    "parse_device_spec",
    "register_backend",
    "registered_kinds",
    "role_hints",
]
