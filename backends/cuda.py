"""NVIDIA GPUs through torch's CUDA runtime.

Streams and events use torch's generic `torch.Stream` / `torch.Event`; synchronization and
memory queries use `torch.accelerator` when CUDA is torch's current accelerator (always the
case on a CUDA host) and `torch.cuda` otherwise or on older torch.
"""

from __future__ import annotations

import torch

from backends import compiler
from backends.base import Backend, BackendUnavailableError, generic_accelerator_is
from backends.compiler import F, StepPadding
from backends.dtype import DtypeChoice, choose_accelerator_dtype


class CudaBackend(Backend):
    """NVIDIA GPUs ("cuda:N"). Host buffers are pinned; device memory can be shared with
    other processes through CUDA IPC handles."""

    kind = "cuda"
    half_dtype = torch.float16

    def is_available(self) -> bool:
        """Whether torch sees at least one CUDA device."""
        return torch.cuda.is_available()

    def device_count(self) -> int:
        """Visible CUDA devices (honours CUDA_VISIBLE_DEVICES); 0 when unavailable."""
        return torch.cuda.device_count() if torch.cuda.is_available() else 0

    def unavailable_error(self) -> BackendUnavailableError:
        """Explains whether torch lacks CUDA or the host lacks a GPU."""
        if torch.version.cuda is None:
            why = "this torch is a CPU-only build (torch.version.cuda is None)"
        else:
            why = (
                f"torch (CUDA {torch.version.cuda}) sees no GPU; "
                "check the driver and CUDA_VISIBLE_DEVICES"
            )
        return BackendUnavailableError(
            f"CUDA is not available: {why}. Use a 'cpu' or 'npu' device, or run on a GPU host "
            "with a CUDA build of torch."
        )

    def _checked(self, device: torch.device) -> torch.device:
        """`device` with an explicit index, after checking this host can run it."""
        self.require_available()
        return self.device(self.index_of(device))

    def device_name(self, device: torch.device) -> str:
        """Marketing name, e.g. "NVIDIA H100 80GB HBM3"."""
        return torch.cuda.get_device_name(self._checked(device))

    def synchronize(self, device: torch.device | None = None) -> None:
        """Wait for all streams on `device` (or the current device)."""
        self.require_available()
        target = None if device is None else self._checked(device)
        if generic_accelerator_is("cuda") and hasattr(torch.accelerator, "synchronize"):
            torch.accelerator.synchronize(target)
        else:
            torch.cuda.synchronize(target)

    def new_stream(self, device: torch.device) -> torch.Stream | None:
        """A new `torch.Stream` on `device`."""
        return torch.Stream(device=self._checked(device))

    def new_event(self, device: torch.device, enable_timing: bool = False) -> torch.Event | None:
        """A new `torch.Event` on `device`."""
        return torch.Event(device=self._checked(device), enable_timing=enable_timing)

    def memory_info(self, device: torch.device) -> tuple[int, int]:
        """(free, total) bytes as the driver reports them (all processes included)."""
        target = self._checked(device)
        if generic_accelerator_is("cuda") and hasattr(torch.accelerator, "get_memory_info"):
            free, total = torch.accelerator.get_memory_info(target)
        else:
            free, total = torch.cuda.mem_get_info(target)
        return int(free), int(total)

    def pinned_empty(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """Page-locked host tensor, so host<->GPU copies can run asynchronously."""
        self.require_available()
        return torch.empty(tuple(shape), dtype=dtype, device="cpu", pin_memory=True)

    def auto_dtype(
        self, device: torch.device, checkpoint: torch.dtype | None = None
    ) -> DtypeChoice:
        """float16, or bfloat16 for bfloat16 checkpoints on GPUs that have it (Ampere on)."""
        dev = self._checked(device)
        with torch.cuda.device(dev):
            native = torch.cuda.is_bf16_supported(including_emulation=False)
        return choose_accelerator_dtype(f"GPU {self.device_name(dev)}", native, checkpoint)

    def compile_step(self, fn: F) -> F:
        """CUDA graphs, one per padded batch shape (`backends.compiler.cuda_graphs`)."""
        return compiler.cuda_graphs(fn)

    def step_padding(self) -> StepPadding | None:
        """Batch buckets 1, 2, 4, 8..256 and contexts in multiples of 256."""
        return compiler.GRAPH_PADDING

    def compile_by_default(self, decode_kernel: bool) -> bool:
        """True: replaying a graph removes the per-kernel launch cost that decode is made of."""
        return True

    def supports_ipc(self) -> bool:
        """True: CUDA IPC memory handles work between processes on one host."""
        return True
