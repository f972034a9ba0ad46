"""The host CPU as a backend: always available, a single device "cpu", no streams."""

from __future__ import annotations

import functools
import logging
import math
import mmap
import os
import shutil
from collections.abc import Collection
from pathlib import Path

import torch

from backends import compiler, probe
from backends.base import Backend, LinearKernel
from backends.compiler import F
from backends.cpuinfo import cpu_flags, host_cpu_name
from backends.dtype import FAST_BF16_CPU_FLAGS, DtypeChoice, choose_cpu_dtype

log = logging.getLogger(__name__)

# Module-level so tests can point them at fixture files.
MEMINFO_PATH = Path("/proc/meminfo")
# cgroup v2 first, then v1: inside a container the limit, not the host, is what we may use.
CGROUP_LIMIT_PATHS = (
    (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory.current")),
    (
        Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"),
        Path("/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ),
)
# cgroup v1 reports "no limit" as a huge page-aligned number.
_NO_LIMIT = 1 << 60
# Where this process's cgroups are listed, and where the hierarchies are mounted.
PROC_SELF_CGROUP = Path("/proc/self/cgroup")
CGROUP_ROOT = Path("/sys/fs/cgroup")


def _read_meminfo() -> tuple[int, int] | None:
    """(MemAvailable, MemTotal) in bytes from /proc/meminfo, or None if unreadable."""
    try:
        text = MEMINFO_PATH.read_text()
    except OSError:
        return None
    fields: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            scale = 1024 if parts[1:2] == ["kB"] else 1
            fields[key.strip()] = int(parts[0]) * scale
    if "MemTotal" not in fields:
        return None
    return fields.get("MemAvailable", fields.get("MemFree", 0)), fields["MemTotal"]


def _read_sysconf() -> tuple[int, int]:
    """(available, total) physical memory in bytes from sysconf."""
    page = os.sysconf("SC_PAGE_SIZE")
    return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page


def _read_cgroup_limit() -> tuple[int, int] | None:
    """(limit - usage, limit) of this process's memory cgroup, or None if unlimited."""
    for limit_path, usage_path in CGROUP_LIMIT_PATHS:
        try:
            limit_text = limit_path.read_text().strip()
            usage = int(usage_path.read_text().strip())
        except (OSError, ValueError):
            continue
        if not limit_text.isdigit() or int(limit_text) >= _NO_LIMIT:
            return None  # "max" (v2) or the v1 sentinel: unlimited
        limit = int(limit_text)
        return max(limit - usage, 0), limit
    return None


def host_memory_info() -> tuple[int, int]:
    """(free_bytes, total_bytes) this process can use: /proc/meminfo (or sysconf), clamped
    to the memory cgroup limit when there is one."""
    free, total = _read_meminfo() or _read_sysconf()
    cgroup = _read_cgroup_limit()
    if cgroup is not None:
        free, total = min(free, cgroup[0]), min(total, cgroup[1])
    return free, total


def affinity_cpus() -> Collection[int]:
    """The CPUs this process may run on: its affinity mask (all CPUs where there is none)."""
    try:
        return os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return range(os.cpu_count() or 1)


def usable_cpus() -> int:
    """How many CPUs this process may keep busy: its affinity mask (what it is pinned to),
    capped by its cgroup's CPU quota (a Kubernetes CPU limit), rounded down, at least 1.

    Threads beyond this only wait for each other: a quota of 1.5 CPUs throttles two busy
    threads for part of every period, and an OpenMP barrier then waits for the throttled one.
    """
    count = len(affinity_cpus())
    quota = cgroup_cpu_quota()
    if quota is not None:
        count = min(count, int(quota))
    return max(1, count)


def cgroup_cpu_quota() -> float | None:
    """CPUs per period this process's cgroups allow (the smallest along the path to the
    root, cgroup v2 `cpu.max` or v1 `cpu.cfs_quota_us`), or None when unlimited."""
    try:
        lines = PROC_SELF_CGROUP.read_text().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        if controllers == "":  # v2: "0::/path" (hybrid hosts mount it at unified/)
            dirs = [CGROUP_ROOT, CGROUP_ROOT / "unified"]
        elif "cpu" in controllers.split(","):  # v1: "4:cpu,cpuacct:/path"
            dirs = [CGROUP_ROOT / controllers, CGROUP_ROOT / "cpu"]
        else:
            continue
        for base in dirs:
            limits += [q for d in _up_to(base, path) if (q := _cpu_quota_in(d)) is not None]
    return min(limits, default=None)


def _up_to(base: Path, path: str) -> list[Path]:
    """base/a/b, base/a, base for path "/a/b" (inside a container the cgroup namespace
    makes the container's own group the mount root, so the root counts too)."""
    parts = [p for p in path.split("/") if p and p != ".."]
    return [base.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]


def _cpu_quota_in(group: Path) -> float | None:
    """quota / period of one cgroup directory, or None (no limit, or not a cpu group)."""
    try:
        if (group / "cpu.max").is_file():  # v2: "max 100000" or "150000 100000"
            quota, period = (group / "cpu.max").read_text().split()[:2]
        else:  # v1: quota -1 means no limit
            quota = (group / "cpu.cfs_quota_us").read_text().strip()
            period = (group / "cpu.cfs_period_us").read_text().strip()
        if quota == "max" or int(quota) <= 0 or int(period) <= 0:
            return None
        return int(quota) / int(period)
    except (OSError, ValueError):
        return None


# The x86 flags of native bfloat16 matmuls (`dtype: auto`'s), where oneDNN's packed bf16
# linear is the fast one; Arm's `bf16` is left out: not measured there.
NATIVE_BF16 = FAST_BF16_CPU_FLAGS - {"bf16"}


@functools.cache
def native_bf16() -> bool:
    """The CPU multiplies bfloat16 natively: AMX or AVX-512 BF16 (read once:
    `linear_kernel` asks for every weight)."""
    return bool(cpu_flags() & NATIVE_BF16)


def packed_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> LinearKernel:
    """oneDNN's linear over `weight` reordered once into its blocked layout (bfloat16 needs
    AVX-512 BW/VL/DQ or AVX-NE-CONVERT in the CPU)."""
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
    b = None if bias is None else bias.detach()

    def linear(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")

    return linear


@functools.cache
def _unpacked(dtype: torch.dtype, why: str) -> None:
    log.warning("cpu: %s linears stay on F.linear: oneDNN cannot pack them (%s)", dtype, why)


class CpuBackend(Backend):
    """The host. Copies are synchronous, there are no streams or events, and host buffers
    are ordinary (unpinned) memory: pinning needs an accelerator runtime."""

    kind = "cpu"
    # Measured as bf16 because CPUs have no fast fp16 GEMM; on AVX2-only machines it is
    # several times slower than fp32, which the profile then shows.
    half_dtype = torch.bfloat16

    def is_available(self) -> bool:
        """Always True."""
        return True

    def compile_by_default(self, decode_kernel: bool) -> bool:
        """Eager where the C decode-attention kernel runs: both steps then call the same
        kernels (attention, packed linears, RMSNorm), inductor only fuses the elementwise
        ops between them, and dynamo's guards and graph call per layer cost more than that
        saves (the compiled step 1.02-1.17x the eager one's time in float32 and bfloat16,
        batch 4-64: docs/BENCHMARKS.md section 14). Without the kernel (an MLA model, a
        dtype it lacks, HETERO_PD_NATIVE_ATTENTION=0), compiled where inductor can build its
        C++ (a compiler on PATH, or $CXX): its loops read K/V in place where eager gathers a
        copy (1.8x at ~300 tokens of context, section 4)."""
        if decode_kernel:
            return False
        cxx = os.environ.get("CXX")
        return any(shutil.which(c) for c in ((cxx,) if cxx else ("g++", "c++", "clang++")))

    def compile_step(self, fn: F) -> F:
        """inductor, its OpenMP loops sized by the thread count at each call rather than
        fixed when the C++ is generated, so the engine's ThreadGovernor still applies, and
        without a recompile when the governor changes the count (`any_thread_count`)."""
        import torch._inductor.config  # only when compiling: importing it costs seconds

        torch._inductor.config.cpp.dynamic_threads = True
        return compiler.inductor(fn, any_thread_count=True)

    def device_count(self) -> int:
        """Always 1: the host is one device, however many cores it has."""
        return 1

    def make_device(self, index: int) -> torch.device:
        """`torch.device("cpu")` (the host has no numbered devices)."""
        return torch.device("cpu")

    def index_of(self, device: torch.device) -> int:
        """0 for the host; ValueError for another kind or a nonzero index."""
        index = super().index_of(device)
        if index != 0:
            raise ValueError(f"the host is the single device 'cpu', got {device}")
        return index

    def device_name(self, device: torch.device) -> str:
        """CPU model name."""
        self.index_of(device)
        return host_cpu_name()

    def synchronize(self, device: torch.device | None = None) -> None:
        """No-op: cpu work is synchronous."""
        if device is not None:
            self.index_of(device)

    def new_stream(self, device: torch.device) -> torch.Stream | None:
        """None: the host has no streams."""
        self.index_of(device)
        return None

    def new_event(self, device: torch.device, enable_timing: bool = False) -> torch.Event | None:
        """None: the host has no events."""
        self.index_of(device)
        return None

    def memory_info(self, device: torch.device) -> tuple[int, int]:
        """(available, total) host memory in bytes; see `host_memory_info`."""
        self.index_of(device)
        return host_memory_info()

    def pinned_empty(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """An ordinary host tensor (nothing to pin for)."""
        return torch.empty(tuple(shape), dtype=dtype, device="cpu")

    def zeros(
        self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """A zero tensor in a fresh anonymous mapping: the kernel's zero pages, each made
        resident when first written, so a KV cache costs memory as its blocks are used.
        `torch.zeros` writes every byte up front (~1-2 s of one core per GiB at start-up,
        and all of it resident at once)."""
        self.index_of(device)
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < mmap.PAGESIZE:
            return torch.zeros(tuple(shape), dtype=dtype)
        # The tensor holds the mapping; it is unmapped when the last view of it goes.
        return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(tuple(shape))

    def native_decode_attention(self, kv_dtype: torch.dtype, kernel_dir: Path) -> bool:
        """The C kernel of backends/paged_decode.py, built on first use into `kernel_dir`;
        float32 and bfloat16 caches."""
        from backends import paged_decode  # registers the op

        return paged_decode.available(kv_dtype, kernel_dir)

    def native_rms_norm(self, dtype: torch.dtype, kernel_dir: Path) -> bool:
        """The C kernel of backends/rms_norm.py (float32 and bfloat16), built on first use
        into `kernel_dir`."""
        from backends import rms_norm

        return rms_norm.available(dtype, kernel_dir)

    def linear_kernel(self, weight: torch.Tensor, bias: torch.Tensor | None) -> LinearKernel | None:
        """oneDNN's linear on a weight reordered once into its blocked layout: float32, and
        bfloat16 where the CPU multiplies it natively (AMX, AVX-512 BF16).

        float32, measured on the 2-core AMD development machine at 32 rows: 1.6x faster than
        `F.linear` (MKL) over SmolLM2's layers and 2.5x on its LM head, because MKL does
        not use its fast kernels on AMD CPUs. bfloat16 on an Intel Xeon with AMX (2 cores,
        SmolLM2's layer shapes): 1.6x faster than `F.linear` at 16-64 rows (a decode step),
        equal at 512; on a Zen 5 EPYC with AVX-512 BF16 (2 cores, all 30 layers' shapes):
        1.2-1.7x at 1-64 rows, 1.01-1.08x at 256-2048 (docs/BENCHMARKS.md section 14); on
        a busy Zen 4 it measured within noise of `F.linear`. None for other dtypes, for
        bfloat16 where it is emulated, without oneDNN, or where oneDNN refuses to pack the
        weight (held below the CPU's ISA by ONEDNN_MAX_CPU_ISA: said once in the log).
        """
        if not torch.backends.mkldnn.is_available():
            return None
        if weight.dtype != torch.float32 and not (weight.dtype == torch.bfloat16 and native_bf16()):
            return None
        try:
            return packed_linear(weight, bias)
        except RuntimeError as e:
            _unpacked(weight.dtype, str(e).splitlines()[0])
            return None

    def profile_threads(self) -> int:
        """torch's intra-op thread count."""
        return torch.get_num_threads()

    def default_threads(self) -> int:
        """`usable_cpus()`: the CPUs this process is pinned to, capped by its CPU quota."""
        return usable_cpus()

    def auto_dtype(
        self, device: torch.device, checkpoint: torch.dtype | None = None
    ) -> DtypeChoice:
        """bfloat16 on CPUs with native bf16 matmuls (AMX, AVX512-BF16, Arm BF16) that the
        profile confirms are faster than float32; float32 elsewhere (decided from the
        flags alone, without probing, on CPUs that lack them)."""

        def measure() -> tuple[float, float | None]:
            profile = self.profile(device)
            return profile.fp32_gflops, profile.half_gflops

        self.index_of(device)
        return choose_cpu_dtype(cpu_flags(), measure)

    def probe_plan(self, quick: bool) -> probe.ProbePlan:
        """Small sizes: a few hundred milliseconds in all on a 2-core machine."""
        return probe.CPU_QUICK if quick else probe.CPU_FULL
