"""What a benchmark ran on: the CPU model and the SIMD features that decide its speed.

Numbers from different machines (AVX2-only, AVX-512, AMX) do not compare, so every bench
records this next to what it measured.
"""

from __future__ import annotations

import os

from backends.cpuinfo import cpu_flags, host_cpu_name

#: The flags that change which kernels run (copies, hashes, GEMMs).
FEATURES = ("sse4_2", "avx2", "avx512f", "avx512bw", "avx512_bf16", "amx_tile", "amx_bf16")


def cpu_info() -> dict[str, str]:
    """``{"model", "features", "cores"}`` of this host (features: those of `FEATURES` it has)."""
    flags = cpu_flags()
    features = " ".join(f for f in FEATURES if f in flags) or "none of " + ", ".join(FEATURES)
    return {"model": host_cpu_name(), "features": features, "cores": str(os.cpu_count())}
