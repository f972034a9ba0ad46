"""`dtype: auto`: the compute dtype a device runs fastest without losing the model's answers.

Reduced precision pays only where the hardware has native half-precision matmuls: AMX or
AVX512-BF16 on x86, BF16 instructions on Arm, every NPU and GPU we target. Elsewhere (an
AVX2-only CPU, say) bfloat16 is emulated and several times slower than float32, so auto
picks float32 there. Accelerators choose between bfloat16 and float16 by the checkpoint's
dtype. The choice is made by the device's backend and carries its reason, which the engine
prints at start.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

#: /proc/cpuinfo flags (x86) or Features (Arm) that give a CPU native bfloat16 matmuls.
FAST_BF16_CPU_FLAGS = frozenset({"amx_bf16", "avx512_bf16", "bf16"})
#: A CPU with such a flag must also measure at least this bf16/fp32 matmul speed ratio.
MIN_BF16_SPEEDUP = 1.2


@dataclass(frozen=True, slots=True)
class DtypeChoice:
    """The dtype an engine computes in, and why (`"configured"` when the user named it)."""

    dtype: torch.dtype
    reason: str

    @property
    def name(self) -> str:
        """ "float32", "bfloat16" or "float16"."""
        return str(self.dtype).removeprefix("torch.")


def choose_cpu_dtype(
    flags: frozenset[str], measure: Callable[[], tuple[float, float | None]]
) -> DtypeChoice:
    """bfloat16 when the CPU has a native bf16 matmul flag and `measure()` (fp32 and bf16
    GFLOP/s from the backend's profile) confirms it is faster; float32 otherwise.

    `measure` runs only when a flag is present: an AVX2-only host decides without probing.
    bfloat16 is chosen whatever the checkpoint's dtype: CPUs have no fast float16 matmul
    before AMX-FP16.
    """
    fast = sorted(flags & FAST_BF16_CPU_FLAGS)
    if not fast:
        return DtypeChoice(
            torch.float32, "auto: no AMX/AVX512-BF16 on this CPU, bfloat16 would be emulated"
        )
    fp32, bf16 = measure()
    if bf16 is None or bf16 < MIN_BF16_SPEEDUP * fp32:
        measured = "no bf16 kernel" if bf16 is None else f"bf16 {bf16:.0f} GFLOP/s"
        return DtypeChoice(
            torch.float32,
            f"auto: CPU has {'/'.join(fast)} but measured {measured} vs fp32 {fp32:.0f}",
        )
    return DtypeChoice(
        torch.bfloat16,
        f"auto: CPU has {'/'.join(fast)}, bf16 {bf16:.0f} vs fp32 {fp32:.0f} GFLOP/s",
    )


def choose_accelerator_dtype(
    kind: str, bf16_supported: bool, checkpoint: torch.dtype | None
) -> DtypeChoice:
    """A bfloat16 checkpoint runs in bfloat16 where the device has it; any other checkpoint
    (float32, float16, unknown) in float16, as vLLM's auto does: float16 keeps three more
    mantissa bits of float32 weights than bfloat16 (the default model, a float32 checkpoint,
    keeps 100% of its teacher-forced top-1 tokens in float16 and about 98% in bfloat16)."""
    if checkpoint == torch.bfloat16 and bf16_supported:
        return DtypeChoice(torch.bfloat16, f"auto: bfloat16 checkpoint on {kind}")
    if checkpoint == torch.bfloat16:
        return DtypeChoice(torch.float16, f"auto: {kind} has no bfloat16, float16 instead")
    saved = "a" if checkpoint is None else f"a {str(checkpoint).removeprefix('torch.')}"
    return DtypeChoice(torch.float16, f"auto: {saved} checkpoint on {kind}, float16")
