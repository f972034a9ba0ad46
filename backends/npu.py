"""Huawei Ascend NPUs through torch_npu.

torch_npu is imported lazily, on first use, never when this module is imported: it is an
optional extra (`pip install hetero-pd[npu]`) that only exists on Ascend hosts, and importing
it registers the "npu" device type with torch process-wide. Everything here goes through
torch_npu's documented `torch.npu` namespace (`torch.npu.synchronize`, `torch.npu.Stream`,
`torch.npu.Event`, `torch.npu.mem_get_info`, ...); devices are "npu:N".
"""

from __future__ import annotations

from typing import Any

import torch

from backends import compiler
from backends.base import Backend
from backends.compiler import F, StepPadding
from backends.dtype import DtypeChoice, choose_accelerator_dtype
from backends.errors import BackendUnavailableError

INSTALL_HINT = "run `pip install hetero-pd[npu]` on an Ascend host (it needs the CANN toolkit)"


def load_torch_npu() -> Any:
    """Import torch_npu and return the `torch.npu` namespace it installs.

    Raises BackendUnavailableError, naming the fix, when torch_npu is missing or cannot load
    its native libraries.
    """
    try:
        import torch_npu
    except ModuleNotFoundError as exc:
        if exc.name != "torch_npu":
            raise _unavailable(f"torch_npu could not be imported ({exc})") from exc
        raise _unavailable("torch_npu is not installed") from exc
    except (ImportError, OSError) as exc:
        raise _unavailable(f"torch_npu could not be imported ({exc})") from exc
    namespace = getattr(torch, "npu", None) or getattr(torch_npu, "npu", None)
    if namespace is None:
        raise _unavailable("torch_npu was imported but did not provide torch.npu")
    return namespace


def _unavailable(why: str) -> BackendUnavailableError:
    return BackendUnavailableError(f"Ascend NPU support is unavailable: {why}; {INSTALL_HINT}.")


class NpuBackend(Backend):
    """Ascend NPUs ("npu:N"). Host buffers are pinned through torch_npu's host allocator;
    cross-process sharing of device memory is not supported yet (`supports_ipc()` is False)."""

    kind = "npu"
    half_dtype = torch.float16
    #: Ascend's attention kernels read KV in fractal (NZ) formats; ours is documented in
    #: transfer/kv_layouts.py. There is no NPU here: a CPU engine with
    #: `kv_layout: fractal_nz` stores its KV exactly so (the emulation the tests run).
    kv_layout = "fractal_nz"

    def _npu(self) -> Any:
        # Not cached: after the first success the import is a sys.modules lookup.
        return load_torch_npu()

    def is_available(self) -> bool:
        """Whether torch_npu imports and sees at least one NPU."""
        try:
            npu = self._npu()
        except BackendUnavailableError:
            return False
        return bool(npu.is_available())

    def device_count(self) -> int:
        """Visible NPUs; 0 when torch_npu is missing or sees none."""
        try:
            npu = self._npu()
        except BackendUnavailableError:
            return 0
        return int(npu.device_count()) if npu.is_available() else 0

    def unavailable_error(self) -> BackendUnavailableError:
        """Says to install the npu extra, or that torch_npu sees no device."""
        try:
            self._npu()
        except BackendUnavailableError as exc:
            return exc
        return _unavailable(
            "torch_npu is installed but sees no NPU "
            "(check the driver and ASCEND_RT_VISIBLE_DEVICES)"
        )

    def make_device(self, index: int) -> torch.device:
        """`torch.device("npu", index)`; needs torch_npu, which registers the "npu" type."""
        self._npu()
        return torch.device("npu", index)

    def _checked(self, device: torch.device) -> tuple[Any, torch.device]:
        npu = self._npu()
        return npu, self.device(self.index_of(device))

    def device_name(self, device: torch.device) -> str:
        """Chip name, e.g. "Ascend910B2"."""
        npu, dev = self._checked(device)
        return str(npu.get_device_name(dev.index))

    def synchronize(self, device: torch.device | None = None) -> None:
        """`torch.npu.synchronize` on `device` (or the current device)."""
        if device is None:
            self.require_available()
            self._npu().synchronize()
            return
        npu, dev = self._checked(device)
        npu.synchronize(dev)

    def new_stream(self, device: torch.device) -> torch.Stream | None:
        """A new `torch.npu.Stream` on `device`."""
        npu, dev = self._checked(device)
        stream: torch.Stream = npu.Stream(device=dev)
        return stream

    def new_event(self, device: torch.device, enable_timing: bool = False) -> torch.Event | None:
        """A new `torch.npu.Event`; like CUDA events it binds to the device of the stream it
        is first recorded on."""
        npu, _ = self._checked(device)
        event: torch.Event = npu.Event(enable_timing=enable_timing)
        return event

    def memory_info(self, device: torch.device) -> tuple[int, int]:
        """`torch.npu.mem_get_info`: (free, total) bytes."""
        npu, dev = self._checked(device)
        free, total = npu.mem_get_info(dev)
        return int(free), int(total)

    def auto_dtype(
        self, device: torch.device, checkpoint: torch.dtype | None = None
    ) -> DtypeChoice:
        """float16, or bfloat16 for bfloat16 checkpoints where torch_npu says the chip has
        it (Atlas A2/A3)."""
        npu, dev = self._checked(device)
        supported = getattr(npu, "is_bf16_supported", None)
        native = bool(supported()) if callable(supported) else False
        name = f"NPU {npu.get_device_name(dev.index)}"
        return choose_accelerator_dtype(name, native, checkpoint)

    def compile_step(self, fn: F) -> F:
        """Ascend graph mode through torchair (`backends.compiler.npu_graph`)."""
        return compiler.npu_graph(fn)

    def step_padding(self) -> StepPadding | None:
        """The same buckets as CUDA graphs: a graph is built per static shape."""
        return compiler.GRAPH_PADDING

    def compile_by_default(self, decode_kernel: bool) -> bool:
        """True: graph mode removes the per-operator dispatch that dominates NPU decode."""
        return True

    def pinned_empty(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """Page-locked host tensor (`pin_memory=True` through torch_npu's host allocator)."""
        self.require_available()
        return torch.empty(tuple(shape), dtype=dtype, device="cpu", pin_memory=True)
