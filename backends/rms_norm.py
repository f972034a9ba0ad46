"""RMSNorm (and residual add + RMSNorm) on CPU by a small C kernel, one pass per row.

`hetero-pd bench profile` (docs/BENCHMARKS.md section 14) found bfloat16 paying for casts
around RMSNorm: in eager prefill torch writes a float32 copy of the hidden states
(`x.float()`) and casts back, and in the compiled decode step inductor's fused norm loop
with its `_to_copy` took 16-18% (a parallel region per norm, on a decode step's few rows).
The kernel (csrc/rms_norm.c) reads bf16, accumulates in float32 in registers and writes
bf16, with transformers' LlamaRMSNorm's roundings in its order (x * rsqrt(mean(x^2) + eps)
rounded to bf16, then times the weight, rounded); only the order of the sum of squares
differs from torch's. The residual add the decoder layer does before its second norm runs
in the same pass (vLLM's `fused_add_rms_norm`). float32 rows take the same kernel. A
decode step's few rows run on the calling thread (no parallel region to wait in).

bfloat16 takes AVX-512 BF16 (`vcvtneps2bf16` rounds) where /proc/cpuinfo says the CPU has
it, else the portable path (the same results bit for bit); `rms_norm(..., portable=True)`
forces the portable one (tests compare the two). Built and loaded by backends/native.py (a
private folder, keyed by source, command, compiler and CPU); no compiler: `available()` is
False and the model keeps torch's ops. The ops `hetero_pd::rms_norm` and
`hetero_pd::add_rms_norm` wrap the functions for compiled graphs (eager code calls the
functions: an op's first call imports ~800 modules).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from backends import native
from backends.cpuinfo import cpu_flags

SOURCE = native.CSRC / "rms_norm.c"
DTYPES = (torch.float32, torch.bfloat16)
PATHS = {"portable": 0, "avx512_bf16": 1}
PATH_FLAGS = {"avx512_bf16": "avx512_bf16"}
# Sums of squares as written (no fused multiply-add), on every path alike.
FLAGS = ("-ffp-contract=off",)

_loaded: ctypes.CDLL | None = None
_fast_path = "portable"


def _use(path: Path) -> ctypes.CDLL:
    global _loaded, _fast_path
    lib = ctypes.CDLL(str(path))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.rms_norm.argtypes = [ptr] * 5 + [i64] * 6 + [ctypes.c_float] + [ctypes.c_int] * 3
    lib.rms_norm.restype = ctypes.c_int
    lib.rms_norm_paths.argtypes = []
    lib.rms_norm_paths.restype = ctypes.c_int
    compiled, flags = lib.rms_norm_paths(), cpu_flags()
    fast = (n for n, f in PATH_FLAGS.items() if compiled >> PATHS[n] & 1 and f in flags)
    _loaded, _fast_path = lib, next(fast, "portable")
    return lib


@functools.cache
def _library(kernel_dir: Path) -> ctypes.CDLL | None:
    return native.build(SOURCE, kernel_dir, "RMSNorm", _use, FLAGS)


def available(dtype: torch.dtype, kernel_dir: Path) -> bool:
    """True when the kernel normalises rows of `dtype` and is built (or found) in
    `kernel_dir`."""
    return dtype in DTYPES and _library(kernel_dir) is not None


def bf16_path(portable: bool = False) -> str:
    """The path bfloat16 rows take: "avx512_bf16" where the CPU and the library have it."""
    return "portable" if portable else _fast_path


def _rows(t: torch.Tensor, dim: int) -> torch.Tensor:
    """t as [rows, dim] with unit stride along dim (a view where one exists)."""
    t2 = t if t.dim() == 2 else t.reshape(-1, dim)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _run(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    portable: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    lib = _loaded
    if lib is None:
        raise RuntimeError("rms_norm called before available() loaded the kernel")
    dim = x.shape[-1]
    if (
        x.device.type != "cpu"
        or x.dtype not in DTYPES
        or weight.dtype != x.dtype
        or weight.shape != (dim,)
        or (residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype))
    ):
        raise ValueError(
            f"rms_norm: cpu rows [..., {dim}] of {DTYPES} with a weight [{dim}] and a "
            f"residual of the rows' shape and dtype, got {x.dtype} {tuple(x.shape)} on "
            f"{x.device.type}, weight {weight.dtype} {tuple(weight.shape)}, residual "
            f"{None if residual is None else (residual.dtype, tuple(residual.shape))}"
        )
    rows = _rows(x, dim)
    w = weight.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype)
    res = _rows(residual, dim) if residual is not None else None
    total = torch.empty(rows.shape, dtype=x.dtype) if res is not None else None
    rc = lib.rms_norm(
        rows.data_ptr(),
        res.data_ptr() if res is not None else None,
        total.data_ptr() if total is not None else None,
        w.data_ptr(),
        out.data_ptr(),
        rows.shape[0],
        dim,
        rows.stride(0),
        res.stride(0) if res is not None else 0,
        dim,
        dim,
        eps,
        torch.get_num_threads(),
        int(x.dtype == torch.bfloat16),
        PATHS[bf16_path(portable)],
    )
    if rc:
        raise RuntimeError(f"rms_norm: the {bf16_path(portable)} path is not compiled in")
    shape = x.shape
    return out.view(shape), None if total is None else total.view(shape)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, portable: bool = False
) -> torch.Tensor:
    """transformers' LlamaRMSNorm of x [..., dim] (float32 or bfloat16) by `weight` [dim]."""
    return _run(x, None, weight, eps, portable)[0]


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    portable: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(s), s) for s = x + residual rounded to x's dtype, in one pass."""
    out, total = _run(x, residual, weight, eps, portable)
    assert total is not None
    return out, total


rms_norm_op = torch.library.custom_op("hetero_pd::rms_norm", rms_norm, mutates_args=())
add_rms_norm_op = torch.library.custom_op("hetero_pd::add_rms_norm", add_rms_norm, mutates_args=())


@rms_norm_op.register_fake
def _(x, weight, eps, portable=False):  # type: ignore[no-untyped-def]
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@add_rms_norm_op.register_fake
def _(x, residual, weight, eps, portable=False):  # type: ignore[no-untyped-def]
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    return out, torch.empty_like(out)
