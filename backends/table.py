"""The device table printed by `hetero-pd devices`.

Role hints use comparative advantage: prefill is compute-bound and decode bandwidth-bound,
so a device whose FLOP-per-byte balance (prefill_score / decode_score) is well above the
group's geometric mean leans "prefill", well below leans "decode", otherwise "either". A
single device is always "either". When accelerators are present the host cpu is left out of
the comparison (it would drag every accelerator towards "prefill") and shown as "either".
It is a hint for the deployment file, not a rule.
"""

from __future__ import annotations

import math

from backends.base import CapabilityProfile
from backends.registry import backend_for, list_devices

#: Balance this many times above (below) the group's geometric mean gives "prefill" ("decode").
ROLE_MARGIN = 1.25

_HEADERS = ("device", "name", "memory GiB", "fp32 GFLOP/s", "half GFLOP/s", "GB/s", "role")
_NUMERIC = frozenset({2, 3, 4, 5})  # right-aligned columns


def role_hints(profiles: list[CapabilityProfile]) -> list[str]:
    """ "prefill", "decode" or "either" for each profile, judged against the whole group."""
    has_accelerator = any(p.kind != "cpu" for p in profiles)
    balances = [None if has_accelerator and p.kind == "cpu" else _balance(p) for p in profiles]
    known = [b for b in balances if b is not None]
    if len(known) < 2:
        return ["either"] * len(profiles)
    mean = math.exp(sum(math.log(b) for b in known) / len(known))
    hints = []
    for balance in balances:
        if balance is None:
            hints.append("either")
        elif balance > mean * ROLE_MARGIN:
            hints.append("prefill")
        elif balance < mean / ROLE_MARGIN:
            hints.append("decode")
        else:
            hints.append("either")
    return hints


def _balance(profile: CapabilityProfile) -> float | None:
    flops, bandwidth = profile.prefill_score(), profile.decode_score()
    if flops <= 0 or bandwidth <= 0:
        return None
    return flops / bandwidth


def _device_label(profile: CapabilityProfile) -> str:
    return "cpu" if profile.kind == "cpu" else f"{profile.kind}:{profile.index}"


def _number(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def format_devices_table(profiles: list[CapabilityProfile]) -> str:
    """Plain-text table, one row per profile, columns aligned, no trailing newline."""
    rows = [
        (
            _device_label(p),
            p.name,
            _number(p.memory_bytes / (1 << 30), 1),
            _number(p.fp32_gflops, 1),
            _number(p.half_gflops, 1),
            _number(p.mem_gbps, 1),
            hint,
        )
        for p, hint in zip(profiles, role_hints(profiles), strict=True)
    ]
    widths = [max(len(row[col]) for row in [_HEADERS, *rows]) for col in range(len(_HEADERS))]

    def line(cells: tuple[str, ...]) -> str:
        parts = [
            cell.rjust(width) if col in _NUMERIC else cell.ljust(width)
            for col, (cell, width) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * width for width in widths)
    return "\n".join([line(_HEADERS), rule, *(line(row) for row in rows)])


def devices_report(quick: bool = True) -> str:
    """Discover every device, profile each (cached per process) and format the table."""
    profiles = []
    for info in list_devices():
        backend = backend_for(info.device)
        profiles.append(backend.profile(backend.device(info.index), quick=quick))
    return format_devices_table(profiles)
