"""Decode attention over the paged KV cache on CPU, read in place by a small C kernel.

Profiling the compiled decode step (batch 64, ~270 tokens of context, SmolLM2 on two AMD
vCPUs) put half of its time in attention: inductor's fused loops read K/V at ~4 GB/s and
barely gained from a second thread, while a copy of the same bytes ran at ~11 GB/s. The
kernel (csrc/paged_decode.c) reads each K row and each V row once per KV head, for all the
query heads that share it, with one task per (sequence, KV head) on torch's OpenMP threads.

It is built on first use with the machine's C compiler (`-march=native`, so it uses the
vector units this CPU has, detected by the compiler) into hetero-pd's cache, keyed by the
source, the compiler and the CPU's flags. No compiler, or a failed build: `available()` is
False and attention takes the portable path (inductor's loops or SDPA), said in the log.
HETERO_PD_NATIVE_ATTENTION=0 turns it off.

The op `hetero_pd::paged_decode` wraps it, so a compiled step calls it as one opaque op.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from backends.cpu import cpu_flags
from hetero_pd import envs

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "paged_decode.c"
#: The dtypes the kernel reads. Not bfloat16: transformers' SDPA rounds the softmax to
#: bfloat16 before multiplying by V, and greedy tokens must stay equal to it.
KV_DTYPES = (torch.float32,)
_ERRORS = {
    -1: "a cache slot lies outside the KV cache",
    -2: "more than 256 query heads",
    -3: "no memory for the kernel's scratch",
}


def _compiler() -> str | None:
    cc = os.environ.get("CC")
    return cc if cc else next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)


def _build(cc: str, out: Path) -> None:
    """Compiles the kernel into `out` (written beside it, then renamed: never half a file)."""
    out.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        cmd = [cc, "-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", str(SOURCE), "-o", tmp]
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def _library() -> ctypes.CDLL | None:
    cc = _compiler()
    if cc is None:
        log.warning("no C compiler (cc, gcc, clang or $CC): decode attention runs portable")
        return None
    key = hashlib.sha256(SOURCE.read_bytes())
    key.update(cc.encode())
    key.update(" ".join(sorted(cpu_flags())).encode())
    path = envs.cache_dir() / "kernels" / f"paged_decode-{key.hexdigest()[:16]}.so"
    try:
        if not path.exists():
            _build(cc, path)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or e
        log.warning("building the decode attention kernel failed (%s): running portable", detail)
        return None
    fn = lib.paged_decode
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr] * 6
    fn.argtypes += [i64] * 6 + [ctypes.c_float, ctypes.c_int]
    fn.restype = ctypes.c_int
    return lib


def available(kv_dtype: torch.dtype) -> bool:
    """True when the kernel is wanted (HETERO_PD_NATIVE_ATTENTION), built, and reads K/V of
    `kv_dtype`."""
    return envs.native_attention() and kv_dtype in KV_DTYPES and _library() is not None


@torch.library.custom_op("hetero_pd::paged_decode", mutates_args=())
def paged_decode(
    q: torch.Tensor,
    k_flat: torch.Tensor,
    v_flat: torch.Tensor,
    slots: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of one query token per sequence over its cached context.

    q [n, heads, dim]; k_flat, v_flat [num_slots, kv_heads, dim] (the cache's blocks as
    rows, layout nd, float32); slots [n * ctx] int64 cache slots; mask [n * ctx] bool,
    True = attend. Returns [n, heads, dim] float32."""
    lib = _library()
    assert lib is not None, "hetero_pd::paged_decode called where available() is False"
    n, heads, dim = q.shape
    num_slots, kv_heads = k_flat.shape[0], k_flat.shape[1]
    for t in (k_flat, v_flat):
        if t.dtype not in KV_DTYPES or not t.is_contiguous() or t.shape != k_flat.shape:
            raise ValueError("paged_decode: K/V must be contiguous float32 of one shape")
    qf = q.float().contiguous()
    slots = slots.to(torch.int64).contiguous()
    mask = mask.to(torch.bool).contiguous()
    ctx = slots.numel() // max(n, 1)
    if slots.numel() != n * ctx or mask.numel() != n * ctx or heads % kv_heads:
        raise ValueError("paged_decode: slots and mask must hold n x ctx entries")
    out = torch.empty((n, heads, dim), dtype=torch.float32)
    rc = lib.paged_decode(
        qf.data_ptr(),
        k_flat.data_ptr(),
        v_flat.data_ptr(),
        slots.data_ptr(),
        mask.data_ptr(),
        out.data_ptr(),
        n,
        ctx,
        kv_heads,
        heads // kv_heads,
        dim,
        num_slots,
        scale,
        torch.get_num_threads(),
    )
    if rc:
        raise RuntimeError(f"paged_decode: {_ERRORS.get(rc, f'error {rc}')}")
    return out


@paged_decode.register_fake
def _(q, k_flat, v_flat, slots, mask, scale):  # type: ignore[no-untyped-def]
    return q.new_empty(q.shape, dtype=torch.float32)
