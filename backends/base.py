"""The hardware abstraction every other package talks to.

A `Backend` owns one device kind ("cpu", "cuda", "npu"). It discovers devices, hands out
streams and events, reports memory, allocates host staging buffers and copies tensors. The
scheduler, block pool, router and transfer state machines never touch device APIs directly.
"""

from __future__ import annotations

import contextlib
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import ClassVar

import torch

from backends import compiler, probe
from backends.compiler import F, StepPadding
from backends.dtype import DtypeChoice
from backends.errors import BackendUnavailableError

# x -> F.linear(x, weight, bias), with the weight held inside in the device's preferred layout.
LinearKernel = Callable[[torch.Tensor], torch.Tensor]
# A mixture-of-experts layer's routed experts, fused: (x [N, hidden], weights [N, k] float32,
# ids [N, k], gate_up [held, 2 * inter, hidden], down [held, hidden, inter], num_experts,
# first_expert) -> [N, hidden]; the arguments of hetero_pd::moe_experts (vLLM's fused_experts).
MoEKernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int],
    torch.Tensor,
]


@dataclass(frozen=True, slots=True)
class DeviceInfo:
    """One usable device on this host, as `list_devices()` reports it."""

    kind: str
    index: int
    device: str  # "cuda:0"; "cpu" for the host
    name: str
    memory_bytes: int


@dataclass(frozen=True, slots=True)
class CapabilityProfile:
    """Measured capability of one device, used to decide where prefill and decode run.

    Prefill is compute-bound (`prefill_score`, GFLOP/s); decode is memory-bandwidth-bound
    (`decode_score`, GB/s). Numbers come from short probes, so compare devices profiled in
    the same run rather than across machines or days.
    """

    kind: str
    index: int
    name: str
    fp32_gflops: float
    half_gflops: float | None  # fp16 on accelerators, bf16 on cpu; None when skipped
    mem_gbps: float  # (read + write) bytes per second of a device-local copy, in GB/s
    memory_bytes: int
    threads: int  # torch.get_num_threads() on cpu, 0 otherwise

    def to_dict(self) -> dict[str, object]:
        """Plain dict (JSON/msgpack friendly)."""
        return asdict(self)

    def prefill_score(self) -> float:
        """Best matmul throughput in GFLOP/s over the probed dtypes."""
        return max(self.fp32_gflops, self.half_gflops or 0.0)

    def decode_score(self) -> float:
        """Memory bandwidth in GB/s."""
        return self.mem_gbps


_profile_cache: dict[tuple[str, int, bool], CapabilityProfile] = {}
# Held while measuring too: two probes running at once would skew each other.
_profile_lock = threading.Lock()


def clear_profile_cache() -> None:
    """Forget every cached `CapabilityProfile` (the next `profile()` measures again)."""
    with _profile_lock:
        _profile_cache.clear()


class Backend(ABC):
    """One kind of device. Subclasses implement the abstract methods; the rest is shared.

    Methods that take a `torch.device` require its type to be this backend's kind; a device
    without an index means index 0. Operations on a backend that `is_available()` says is
    absent raise `BackendUnavailableError` with a message saying what to install or use.
    """

    kind: ClassVar[str] = ""
    #: Dtype of the reduced-precision matmul probe.
    half_dtype: ClassVar[torch.dtype] = torch.float16
    #: Byte order of the device's KV cache blocks, one of transfer/kv_layouts.py's LAYOUTS
    #: (backends cannot import transfer; tests check the name): engines on this device
    #: store their KV in it and transfers convert to and from it on receipt.
    kv_layout: ClassVar[str] = "nd"

    @abstractmethod
    def is_available(self) -> bool:
        """Whether this host can run this backend at all (never raises)."""

    @abstractmethod
    def device_count(self) -> int:
        """Number of usable devices of this kind; 0 when unavailable (never raises)."""

    @abstractmethod
    def device_name(self, device: torch.device) -> str:
        """Human-readable model name of `device`."""

    @abstractmethod
    def synchronize(self, device: torch.device | None = None) -> None:
        """Block until all queued work on `device` (or the current device) has finished."""

    @abstractmethod
    def new_stream(self, device: torch.device) -> torch.Stream | None:
        """A new side stream on `device`; None where the backend has no streams (cpu)."""

    @abstractmethod
    def new_event(self, device: torch.device, enable_timing: bool = False) -> torch.Event | None:
        """A new event on `device`; None where the backend has no events (cpu)."""

    @abstractmethod
    def memory_info(self, device: torch.device) -> tuple[int, int]:
        """`(free_bytes, total_bytes)` of `device`'s memory."""

    @abstractmethod
    def pinned_empty(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """Uninitialised host tensor, page-locked when this backend can pin memory."""

    def zeros(
        self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """A zero-filled tensor on `device` (the KV cache's storage)."""
        return torch.zeros(tuple(shape), dtype=dtype, device=device)

    def supports_ipc(self) -> bool:
        """Whether device memory can be shared with another process by handle."""
        return False

    def unavailable_error(self) -> BackendUnavailableError:
        """The error raised when a device operation is asked of an unavailable backend."""
        return BackendUnavailableError(f"the {self.kind} backend is not available on this host")

    def require_available(self) -> None:
        """Raise `unavailable_error()` unless `is_available()`."""
        if not self.is_available():
            raise self.unavailable_error()

    def make_device(self, index: int) -> torch.device:
        """The `torch.device` for `index`, without checking that it exists on this host."""
        return torch.device(self.kind, index)

    def device(self, index: int = 0) -> torch.device:
        """The `torch.device` of device number `index`, which must exist on this host."""
        count = self.device_count()
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < count:
            self.require_available()
            raise ValueError(
                f"device {self.kind}:{index} does not exist: this host has {count} "
                f"{self.kind} device(s), numbered 0..{count - 1}"
            )
        return self.make_device(index)

    def index_of(self, device: torch.device) -> int:
        """Index of `device`, checking that it belongs to this backend."""
        if device.type != self.kind:
            raise ValueError(f"the {self.kind} backend was given a {device.type} device ({device})")
        return 0 if device.index is None else device.index

    def device_infos(self) -> list[DeviceInfo]:
        """One `DeviceInfo` per usable device of this kind (empty when unavailable)."""
        infos = []
        for index in range(self.device_count()):
            dev = self.device(index)
            _, total = self.memory_info(dev)
            infos.append(DeviceInfo(self.kind, index, str(dev), self.device_name(dev), total))
        return infos

    def copy(self, dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> None:
        """Copy `src` into `dst` (device-device, device-host, host-device or host-host).

        Shapes and dtypes must match exactly: a KV block copy never broadcasts or converts.
        Tensors not on the host must be on this backend's kind. With `non_blocking=True` the
        copy may still be running on return; synchronize (or wait on an event) before use.
        """
        self._check_copy("copy needs matching tensors", dst, src, dst.shape, src.shape)
        dst.copy_(src, non_blocking=non_blocking)

    def _check_copy(
        self,
        what: str,
        dst: torch.Tensor,
        src: torch.Tensor,
        dst_shape: tuple[int, ...],
        src_shape: tuple[int, ...],
    ) -> None:
        """ValueError unless the shapes and dtypes match and both sides are on the host or
        on this backend's kind of device."""
        if dst_shape != src_shape or dst.dtype != src.dtype:
            raise ValueError(
                f"{what}, got dst {tuple(dst_shape)} {dst.dtype} and src {tuple(src_shape)} "
                f"{src.dtype}"
            )
        for tensor in (dst, src):
            if tensor.device.type not in ("cpu", self.kind):
                raise ValueError(
                    f"the {self.kind} backend cannot copy a tensor on {tensor.device}; "
                    f"use backend_for({str(tensor.device)!r})"
                )

    def copy_blocks(
        self,
        dst: Sequence[torch.Tensor],
        dst_ids: Sequence[int],
        src: Sequence[torch.Tensor],
        src_ids: Sequence[int],
        stream: torch.Stream | None = None,
    ) -> None:
        """Copy KV blocks pairwise between two lists of block tensors (the leading dimension
        indexes blocks): `dst[i][dst_ids[j]] = src[i][src_ids[j]]` for every i and j.

        This is how KV blocks move between device memory and host memory (either way, or
        within one side). Returns once the data is in `dst`. With a `stream` (from
        `new_stream`) the copies run on it and only it is waited for, so they overlap with
        work queued on the device's other streams.
        """
        if len(dst) != len(src) or len(dst_ids) != len(src_ids):
            raise ValueError(
                f"copy_blocks needs as many dst as src tensors and ids, got {len(dst)}/"
                f"{len(src)} tensors and {len(dst_ids)}/{len(src_ids)} ids"
            )
        if not dst_ids:
            return
        for d, s in zip(dst, src, strict=True):
            self._check_copy("copy_blocks needs matching blocks", d, s, d.shape[1:], s.shape[1:])
        indexes: dict[tuple[str, torch.device], torch.Tensor] = {}

        def index(which: str, ids: Sequence[int], device: torch.device) -> torch.Tensor:
            if (which, device) not in indexes:
                indexes[which, device] = torch.tensor(list(ids), dtype=torch.long, device=device)
            return indexes[which, device]

        devices = {t.device for t in (*dst, *src) if t.device.type != "cpu"}
        with stream if stream is not None else contextlib.nullcontext():
            for d, s in zip(dst, src, strict=True):
                rows = s.index_select(0, index("src", src_ids, s.device))
                if rows.device != d.device:
                    # device -> host must land before index_copy_ reads it: blocking there
                    rows = rows.to(d.device, non_blocking=d.device.type != "cpu")
                d.index_copy_(0, index("dst", dst_ids, d.device), rows)
            if stream is not None:
                stream.synchronize()
            else:
                for device in devices:
                    self.synchronize(device)

    def native_decode_attention(self, kv_dtype: torch.dtype, kernel_dir: Path) -> bool:
        """True when this backend runs decode attention over a paged cache of `kv_dtype` (nd
        layout) through the kernel of backends/paged_decode.py, built into and loaded from
        `kernel_dir` (a private folder); False (the default) leaves attention to the
        portable path."""
        return False

    def native_rms_norm(self, dtype: torch.dtype, kernel_dir: Path) -> bool:
        """True when this backend runs RMSNorm in `dtype` through the kernel of
        backends/rms_norm.py, built into and loaded from `kernel_dir` (a private folder);
        False (the default) leaves it to torch's ops."""
        return False

    def linear_kernel(self, weight: torch.Tensor, bias: torch.Tensor | None) -> LinearKernel | None:
        """A faster equivalent of `F.linear(x, weight, bias)` for inference, or None when plain
        `F.linear` is already the best this backend has (the default).

        The kernel keeps its own copy of the weight (e.g. pre-packed for the GEMM library),
        so later changes to `weight` do not reach it.
        """
        return None

    def moe_kernel(self, dtype: torch.dtype) -> MoEKernel | None:
        """A fused kernel for the routed experts of a mixture-of-experts layer in `dtype`, or
        None (the default) when the model's grouped path (tokens grouped by expert, one matmul
        pair per expert: hetero_pd/models/moe.py) is the best this backend has. Eager steps
        call it; a compiled step keeps the `hetero_pd::moe_experts` op."""
        return None

    def profile_threads(self) -> int:
        """Host threads used by this backend's kernels (0 for accelerators)."""
        return 0

    def compile_step(self, fn: F) -> F:
        """`fn`, a unit of the engine's decode step, compiled for this device kind (see
        `backends.compiler`); the first call compiles, and may take minutes."""
        return compiler.inductor(fn)

    def step_padding(self) -> StepPadding | None:
        """The static shapes compiled steps need, or None when any shape runs."""
        return None

    def compile_by_default(self, decode_kernel: bool) -> bool:
        """Whether `compile: auto` compiles on this backend, for an engine whose decode
        attention runs (`decode_kernel`) or not through the backend's own kernel."""
        return False

    def default_threads(self) -> int:
        """torch intra-op threads an engine on this backend should use; 0 keeps torch's
        default (accelerators, whose host threads do little)."""
        return 0

    def auto_dtype(
        self, device: torch.device, checkpoint: torch.dtype | None = None
    ) -> DtypeChoice:
        """What `dtype: auto` means on `device` for a checkpoint saved in `checkpoint`: its
        fastest dtype that keeps the model's answers (float32 unless a backend knows better)."""
        self.index_of(device)
        return DtypeChoice(torch.float32, f"auto: no faster dtype known for {self.kind}")

    def probe_plan(self, quick: bool) -> probe.ProbePlan:
        """Sizes of the capability probes (accelerators need larger work to time)."""
        return probe.ACCELERATOR_QUICK if quick else probe.ACCELERATOR_FULL

    def profile(self, device: torch.device, *, quick: bool = True) -> CapabilityProfile:
        """Measure (once per process, per device and `quick`) and return `device`'s profile."""
        index = self.index_of(device)
        key = (self.kind, index, quick)
        with _profile_lock:
            cached = _profile_cache.get(key)
            if cached is not None:
                return cached
            dev = self.device(index)
            free, total = self.memory_info(dev)
            plan = self.probe_plan(quick)

            def sync() -> None:
                self.synchronize(dev)

            fp32 = probe.matmul_gflops(dev, torch.float32, plan.matmul_n, plan, sync)
            half = probe.half_gflops(dev, self.half_dtype, plan, sync)
            gbps = probe.copy_gbps(dev, min(plan.copy_bytes, free // 8), plan, sync)
            result = CapabilityProfile(
                kind=self.kind,
                index=index,
                name=self.device_name(dev),
                fp32_gflops=fp32,
                half_gflops=half,
                mem_gbps=gbps,
                memory_bytes=total,
                threads=self.profile_threads(),
            )
            _profile_cache[key] = result
            return result


def generic_accelerator_is(kind: str) -> bool:
    """Whether torch's generic `torch.accelerator` API currently drives devices of `kind`."""
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is None:
        return False
    current = accelerator.current_accelerator()
    return current is not None and current.type == kind
