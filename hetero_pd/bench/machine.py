"""What a benchmark ran on: the CPU model and the SIMD features that decide its speed.

Numbers from different machines (AVX2-only, AVX-512, AMX) do not compare, so every bench
records this next to what it measured.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

from backends.cpuinfo import cpu_flags, host_cpu_name

#: The flags that change which kernels run (copies, hashes, GEMMs).
FEATURES = ("sse4_2", "avx2", "avx512f", "avx512bw", "avx512_bf16", "amx_tile", "amx_bf16")


def cpu_info() -> dict[str, str]:
    """``{"model", "features", "cores"}`` of this host (features: those of `FEATURES` it has)."""
    flags = cpu_flags()
    features = " ".join(f for f in FEATURES if f in flags) or "none of " + ", ".join(FEATURES)
    return {"model": host_cpu_name(), "features": features, "cores": str(os.cpu_count())}


def take_turns(ways: dict[str, Callable[[], object]], rounds: int, calls: int) -> dict[str, float]:
    """Median ms per call of each way, the ways taking turns `rounds` times (`calls` calls
    each per turn), so that a load that changes during the run weighs on all of them."""
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(rounds):
        for name, fn in ways.items():
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - start) / calls * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}
