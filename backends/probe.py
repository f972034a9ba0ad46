"""Short micro-benchmarks behind `Backend.profile()`.

Each probe warms up once, then keeps the best of a few timed repetitions (the least disturbed
by other processes). On accelerators each repetition runs `inner` back-to-back launches
between two synchronizations so launch overhead does not dominate.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

_MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class ProbePlan:
    """Work sizes of one profiling run."""

    matmul_n: int  # fp32 square matmul size
    half_n: int  # fp16/bf16 square matmul size; 0 skips the half probe
    copy_bytes: int  # bytes of the copied buffer (moved twice: read + write)
    reps: int  # timed repetitions after one warm-up; the best one counts
    inner: int  # launches per timed repetition


# cpu, ~0.5 s on a 2-core VM, mostly first-touch page faults of the copy buffers. Small
# matmuls understate a multi-threaded CPU badly (thread wake-up dominates below ~512), hence
# 1024. The copy buffer pair (2 x 32 MiB) is larger than the last-level caches of the
# machines we run on. bf16 is several times slower than fp32 on AVX2-only CPUs.
CPU_QUICK = ProbePlan(matmul_n=1024, half_n=512, copy_bytes=32 * _MIB, reps=3, inner=1)
CPU_FULL = ProbePlan(matmul_n=2048, half_n=1024, copy_bytes=256 * _MIB, reps=5, inner=1)
ACCELERATOR_QUICK = ProbePlan(matmul_n=2048, half_n=4096, copy_bytes=256 * _MIB, reps=3, inner=8)
ACCELERATOR_FULL = ProbePlan(matmul_n=4096, half_n=8192, copy_bytes=1024 * _MIB, reps=5, inner=20)


def best_seconds(
    run: Callable[[], None],
    sync: Callable[[], None],
    reps: int,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Best wall time of `run` over `reps` timed repetitions, after one warm-up."""
    run()
    sync()
    best = math.inf
    for _ in range(max(1, reps)):
        start = clock()
        run()
        sync()
        best = min(best, clock() - start)
    return max(best, 1e-9)


@torch.inference_mode()
def matmul_gflops(
    device: torch.device,
    dtype: torch.dtype,
    n: int,
    plan: ProbePlan,
    sync: Callable[[], None],
) -> float:
    """GFLOP/s of an `n` x `n` by `n` x `n` matmul of `dtype` on `device`."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)

    def run() -> None:
        for _ in range(plan.inner):
            torch.mm(a, b, out=out)

    seconds = best_seconds(run, sync, plan.reps)
    return 2.0 * n**3 * plan.inner / seconds / 1e9


def half_gflops(
    device: torch.device,
    dtype: torch.dtype,
    plan: ProbePlan,
    sync: Callable[[], None],
) -> float | None:
    """Reduced-precision matmul GFLOP/s, or None when the plan skips it or the device has
    no kernel for `dtype` (that is a capability answer, not an error)."""
    if plan.half_n <= 0:
        return None
    try:
        return matmul_gflops(device, dtype, plan.half_n, plan, sync)
    except (RuntimeError, NotImplementedError):
        return None


@torch.inference_mode()
def copy_gbps(
    device: torch.device,
    nbytes: int,
    plan: ProbePlan,
    sync: Callable[[], None],
) -> float:
    """Device-local copy bandwidth in GB/s, counting bytes read plus bytes written."""
    numel = max(nbytes // 4, 1 << 16)
    src = torch.ones(numel, device=device, dtype=torch.float32)  # touches every page
    dst = torch.zeros_like(src)

    def run() -> None:
        for _ in range(plan.inner):
            dst.copy_(src)

    seconds = best_seconds(run, sync, plan.reps)
    return 2.0 * src.nbytes * plan.inner / seconds / 1e9
