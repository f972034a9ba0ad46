"""Decode attention over the paged KV cache on CPU, read in place by a small C kernel.

Profiling the compiled decode step (batch 64, ~270 tokens of context, SmolLM2 on two AMD
vCPUs) put half of its time in attention: inductor's fused loops read K/V at ~4 GB/s and
barely gained from a second thread, while a copy of the same bytes ran at ~11 GB/s. The
kernel (csrc/paged_decode.c) runs one task per sequence on torch's OpenMP threads and reads
each slot's K row and V row once, for every query head.

It reads float32 and bfloat16 caches. bfloat16 accumulates in float32 and rounds the
softmax's weights to bfloat16 before they multiply V, as torch's CPU SDPA does (and so
transformers in bfloat16). Where /proc/cpuinfo says the CPU has AVX-512 BF16, both dtypes
take the kernel's blocked AVX-512 loops (bf16 scores by `vdpbf16ps`; 16 positions' scores
summed at once, a vectorized softmax, outputs in registers across the context: head dims 64
and 128), else its portable path (bf16 widened to float32 by a shift); `bf16_path()` names
the one taken, and `decode(..., portable=True)` forces the portable one. `prefill_causal`
runs the same loops over prefill chunks, each row a decode query over the rows before it,
except bfloat16 at head dim 64 on the AVX-512 BF16 path: there the scores of 16 rows' query
heads against 16 positions, and their weights times V, are GEMMs by `vdpbf16ps` over K and V
laid out once per chunk (positions in the lanes), 1.5x the per-row loops.

It is built on first use and loaded by backends/native.py (the machine's compiler,
`-march=native`, the AVX-512 BF16 path compiled in by a target attribute on any x86-64 and
called only where the CPU has it; a library loaded only from a folder no one else may
write). No compiler, or a failed build: `available()` is False and attention takes the
portable path (inductor's loops or SDPA), said in the log. The engine asks only where
HETERO_PD_NATIVE_ATTENTION is not 0.

The op `hetero_pd::paged_decode` wraps `decode`, so a compiled step calls it as one opaque
op.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from backends import native
from backends.cpuinfo import cpu_flags

SOURCE = native.CSRC / "paged_decode.c"
#: The dtypes the kernel reads (q, K and V alike; float16 stays on the portable path).
KV_DTYPES = (torch.float32, torch.bfloat16)
MAX_HEADS = 256  # the kernel's MAX_HEADS
#: The kernel's bfloat16 paths, by the number it takes; the flag the CPU needs for each.
PATHS = {"portable": 0, "avx512_bf16": 1}
PATH_FLAGS = {"avx512_bf16": "avx512_bf16"}
_ERRORS = {
    -1: "a cache slot lies outside the KV cache",
    -2: f"more than {MAX_HEADS} query heads",
    -3: "no memory for the kernel's scratch",
    -4: "the path asked for is not compiled into the kernel",
}


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    fn = lib.paged_decode
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr] * 6 + [i64] * 6 + [ctypes.c_float, ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_int
    bf16 = lib.paged_decode_bf16
    bf16.argtypes = [*fn.argtypes, ptr]
    bf16.restype = ctypes.c_int
    prefill = lib.prefill_causal
    prefill.argtypes = [ptr] * 4 + [i64] * 5 + [ctypes.c_float] + [ctypes.c_int] * 3
    prefill.restype = ctypes.c_int
    lib.paged_decode_paths.argtypes = []
    lib.paged_decode_paths.restype = ctypes.c_int
    return lib


#: The library `decode` runs: the one last loaded by `_library`; its fastest bf16 path.
_loaded: ctypes.CDLL | None = None
_fast_path = "portable"


def _use(path: Path) -> ctypes.CDLL:
    global _loaded, _fast_path
    lib = _load(path)
    _loaded, _fast_path = lib, _fastest_path(lib)
    return lib


@functools.cache
def _library(kernel_dir: Path) -> ctypes.CDLL | None:
    """The kernel built into (or found in) `kernel_dir`, loaded; None where it cannot be."""
    return native.build(SOURCE, kernel_dir, "decode attention", _use)


def available(kv_dtype: torch.dtype, kernel_dir: Path) -> bool:
    """True when the kernel reads K/V of `kv_dtype` and is built (or found) in `kernel_dir`."""
    return kv_dtype in KV_DTYPES and _library(kernel_dir) is not None


def _fastest_path(lib: ctypes.CDLL) -> str:
    """The fastest bfloat16 path both `lib` and this CPU (its /proc/cpuinfo flags) have."""
    compiled, flags = lib.paged_decode_paths(), cpu_flags()
    fast = (n for n, f in PATH_FLAGS.items() if compiled >> PATHS[n] & 1 and f in flags)
    return next(fast, "portable")


def bf16_path(portable: bool = False) -> str:
    """The path bfloat16 takes in the loaded kernel: "avx512_bf16" where both the CPU and
    the library have it, else (or when `portable`) "portable"."""
    if _loaded is None:
        raise RuntimeError("paged_decode.bf16_path called before available() loaded the kernel")
    return "portable" if portable else _fast_path


def decode(
    q: torch.Tensor,
    k_flat: torch.Tensor,
    v_flat: torch.Tensor,
    slots: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    portable: bool = False,
    bf16_out: bool = False,
) -> torch.Tensor:
    """Attention of one query token per sequence over its cached context.

    q [n, heads, dim]; k_flat, v_flat [num_slots, kv_heads, dim] (the cache's blocks as
    rows, layout nd, float32 or bfloat16; q is read in their dtype); slots [n * ctx] int64
    cache slots; mask [n * ctx] bool, True = attend. `portable` keeps both dtypes off the
    AVX-512 loops (tests compare the paths). Returns [n, heads, dim] float32, or
    with `bf16_out` (bfloat16 K/V only) that rounded to bfloat16 by the kernel as it goes
    (the same bits as `.to(torch.bfloat16)`, without a float32 output to cast)."""
    lib = _loaded
    if lib is None:
        raise RuntimeError("paged_decode called before available() loaded the kernel")
    _check(q, k_flat, v_flat, slots, mask)
    n, heads, dim = q.shape
    num_slots, kv_heads = k_flat.shape[0], k_flat.shape[1]
    qk = q.to(k_flat.dtype).contiguous()
    slots = slots.contiguous()
    mask = mask.contiguous()
    ctx = slots.numel() // n if n else 0
    bf16 = k_flat.dtype == torch.bfloat16
    if bf16_out and not bf16:
        raise ValueError(f"paged_decode: a bfloat16 output needs bfloat16 K/V, got {k_flat.dtype}")
    out = torch.empty((n, heads, dim), dtype=torch.bfloat16 if bf16_out else torch.float32)
    fn = lib.paged_decode_bf16 if bf16 else lib.paged_decode
    extra = (out.data_ptr() if bf16_out else None,) if bf16 else ()
    rc = fn(
        qk.data_ptr(),
        k_flat.data_ptr(),
        v_flat.data_ptr(),
        slots.data_ptr(),
        mask.data_ptr(),
        None if bf16_out else out.data_ptr(),
        n,
        ctx,
        kv_heads,
        heads // kv_heads,
        dim,
        num_slots,
        scale,
        torch.get_num_threads(),
        PATHS[bf16_path(portable)],
        *extra,
    )
    if rc:
        raise RuntimeError(f"paged_decode: {_ERRORS.get(rc, f'error {rc}')}")
    return out


def prefill_causal(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tokens: int, scale: float,
    portable: bool = False,
) -> torch.Tensor:  # fmt: skip
    """Causal attention within prefill chunks of `tokens` rows each, back to back: q [size *
    tokens, heads, dim], k and v [size * tokens, kv_heads, dim], all float32 or all
    bfloat16. Row i of a chunk attends to its rows 0..i, as SDPA with `is_causal` over each
    chunk; the kernel computes each row as a decode query over the rows before it (only
    what a row attends to, where SDPA's blocks also score the masked half), on the fastest
    path unless `portable`. Returns [size * tokens, heads, dim] in their dtype."""
    lib = _loaded
    if lib is None:
        raise RuntimeError("prefill_causal called before available() loaded the kernel")
    tensors = {"q": q, "k": k, "v": v}
    if q.dtype not in KV_DTYPES or any(
        t.dtype != q.dtype or t.device.type != "cpu" for t in tensors.values()
    ):
        got = {name: (t.dtype, t.device.type) for name, t in tensors.items()}
        raise ValueError(f"prefill_causal: q, k and v of one of {KV_DTYPES} on the cpu, got {got}")
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape or k.shape[::2] != q.shape[::2]:
        raise ValueError(
            f"prefill_causal: q [rows, heads, dim] and K/V [rows, kv_heads, dim] of its rows "
            f"and dim, got {tuple(q.shape)}, {tuple(k.shape)} and {tuple(v.shape)}"
        )
    rows, heads, dim = q.shape
    kv_heads = k.shape[1]
    if not 0 < kv_heads <= heads <= MAX_HEADS or heads % kv_heads or not dim:
        raise ValueError(
            f"prefill_causal: {heads} query heads cannot share {kv_heads} KV heads "
            f"(at most {MAX_HEADS} query heads)"
        )
    if tokens <= 0 or rows % tokens:
        raise ValueError(f"prefill_causal: {rows} rows are not chunks of {tokens} tokens")
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = torch.empty((rows, heads, dim), dtype=q.dtype)
    rc = lib.prefill_causal(
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        out.data_ptr(),
        rows // tokens,
        tokens,
        kv_heads,
        heads // kv_heads,
        dim,
        scale,
        torch.get_num_threads(),
        PATHS[bf16_path(portable)],
        q.dtype == torch.float32,
    )
    if rc:
        raise RuntimeError(f"prefill_causal: {_ERRORS.get(rc, f'error {rc}')}")
    return out


def _check(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor
) -> None:
    """Every size the kernel reads by, checked: it trusts them."""
    tensors = {"q": q, "k_flat": k, "v_flat": v, "slots": slots, "mask": mask}
    where = {name: t.device.type for name, t in tensors.items() if t.device.type != "cpu"}
    if where:
        raise ValueError(f"paged_decode: every tensor must be on the cpu, got {where}")
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape:
        raise ValueError(
            f"paged_decode: q [n, heads, dim] and K/V [slots, kv_heads, dim] of one shape, "
            f"got {tuple(q.shape)}, {tuple(k.shape)} and {tuple(v.shape)}"
        )
    n, heads, dim = q.shape
    kv_heads = k.shape[1]
    if k.shape[2] != dim or not 0 < kv_heads <= heads <= MAX_HEADS or heads % kv_heads or not dim:
        raise ValueError(
            f"paged_decode: {heads} query heads of dim {dim} cannot share {kv_heads} KV heads "
            f"of dim {k.shape[2]} (at most {MAX_HEADS} query heads)"
        )
    if (
        k.dtype not in KV_DTYPES
        or v.dtype != k.dtype
        or not (k.is_contiguous() and v.is_contiguous())
    ):
        raise ValueError(f"paged_decode: K/V must be contiguous {KV_DTYPES}, got {k.dtype}")
    if slots.dtype != torch.int64 or mask.dtype != torch.bool:
        raise ValueError(
            f"paged_decode: slots int64 and mask bool, got {slots.dtype}, {mask.dtype}"
        )
    if slots.dim() != 1 or mask.shape != slots.shape or (n and slots.numel() % n):
        raise ValueError(
            f"paged_decode: slots and mask must be flat, n x ctx entries each for n = {n}, "
            f"got {tuple(slots.shape)} and {tuple(mask.shape)}"
        )


# The op a compiled graph calls (opaque to the compiler). Eager code calls `decode` itself:
# the op's first call imports ~800 modules (2 s), which stalled a worker's first request
# past its heartbeat.
paged_decode = torch.library.custom_op("hetero_pd::paged_decode", decode, mutates_args=())


@paged_decode.register_fake
def _(q, k_flat, v_flat, slots, mask, scale, portable=False, bf16_out=False):  # type: ignore[no-untyped-def]
    dtype = torch.bfloat16 if bf16_out else torch.float32
    return torch.empty(q.shape, dtype=dtype, device="cpu")
