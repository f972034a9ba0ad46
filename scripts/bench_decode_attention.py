"""Decode attention over a paged KV cache, three ways, side by side in one process:

    native    the C kernel (backends/paged_decode.py), reading K/V where they lie
    inductor  `_decode_fused` compiled by inductor (the portable compiled path)
    eager     SDPA over a gathered copy of K/V (the portable eager path)

Sizes are one layer of the default model (9 query heads, 3 KV heads, dim 64) with a batch
of sequences whose blocks are scattered over a cache larger than the CPU's caches. The ways
take turns over `--rounds`; each prints its median per call, and the last line is one JSON
object with the ratios to native and the machine.

The kernel runs both of its paths: `native` (the blocked AVX-512 loops where the CPU has
AVX-512 BF16) and `portable` (plain C loops; bf16 widened by a shift).

`--layers N` gives each call N layers' caches in turn, as a decode step reads them: with the
default 1 the touched K/V (~15 MB at batch 64) stay in the last-level cache between calls,
with 30 (the default model's) they come from memory, as they do in the engine.

    python scripts/bench_decode_attention.py [--batch 64] [--context 272] [--threads 2]
        [--dtype float32|bfloat16] [--layers 1]
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Callable

import torch

from backends import paged_decode
from hetero_pd import envs
from hetero_pd.bench.machine import cpu_info, take_turns
from hetero_pd.models.attention import _decode_fused


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=272, help="tokens per sequence")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=5, help="calls per way per round")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--layers", type=int, default=1, help="caches read in turn (30: DRAM)")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    if not paged_decode.available(dtype, envs.cache_dir() / "kernels"):
        raise SystemExit("the kernel is not available here (no C compiler?): nothing to compare")
    torch.set_num_threads(args.threads)
    n, ctx, kv_heads, group, dim, block = args.batch, args.context, 3, 3, 64, 16
    width = -(-ctx // block)
    # One layer: ~120 MB per K or V, past the last-level cache. Several: each its own.
    num_blocks = max(20000 if args.layers == 1 else 0, 2 * n * width)
    caches = [
        (
            torch.randn(num_blocks * block, kv_heads, dim).to(dtype),
            torch.randn(num_blocks * block, kv_heads, dim).to(dtype),
        )
        for _ in range(args.layers)
    ]
    k, v = caches[0]
    tables = torch.randperm(num_blocks)[: n * width].view(n, width)
    offsets = torch.arange(width * block)
    slots = (tables[:, offsets // block] * block + offsets % block).reshape(-1)
    mask = (offsets < ctx).repeat(n)
    q = torch.randn(n, kv_heads * group, dim).to(dtype)
    scale = dim**-0.5
    fused = torch.compile(_decode_fused, backend="inductor")
    portable = paged_decode.decode

    def eager(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kd = k.index_select(0, slots).view(n, -1, kv_heads, dim).transpose(1, 2)
        vd = v.index_select(0, slots).view(n, -1, kv_heads, dim).transpose(1, 2)
        m = mask.view(n, 1, 1, -1)
        out = torch.nn.functional.scaled_dot_product_attention(
            q.unsqueeze(2), kd, vd, attn_mask=m, scale=scale, enable_gqa=True
        )
        return out.reshape(n, -1, dim)

    ways: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
        "native": lambda k, v: paged_decode.paged_decode(q, k, v, slots, mask, scale).to(dtype),
        "inductor": lambda k, v: fused(q, k, v, slots, mask.view(n, 1, 1, -1), scale),
        "eager": eager,
        "portable": lambda k, v: portable(q, k, v, slots, mask, scale, portable=True).to(dtype),
    }
    want = eager(k, v)
    for name, fn in ways.items():  # warm up (and compile), and check they agree
        tol = (
            {"atol": 1e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 4e-3, "rtol": 2e-2}
        )
        torch.testing.assert_close(fn(k, v), want, **tol, msg=f"{name} differs")
    turn = itertools.cycle(caches)  # each call the next layer's cache

    def rotating(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Callable[[], object]:
        return lambda: fn(*next(turn))

    ms = take_turns({name: rotating(fn) for name, fn in ways.items()}, args.rounds, args.calls)
    kv_mb = 2 * n * ctx * kv_heads * dim * k.element_size() / 1e6
    for name, t in ms.items():
        print(f"{name:9s} {t:7.2f} ms per layer  ({kv_mb / t:.1f} GB/s of K/V)")
    result = {
        "batch": n,
        "context": ctx,
        "threads": args.threads,
        "layers": args.layers,
        "dtype": args.dtype,
        "ms": {name: round(t, 3) for name, t in ms.items()},
        **{
            f"{name}_over_native": round(t / ms["native"], 3)
            for name, t in ms.items()
            if name != "native"
        },
        "cpu": cpu_info(),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
