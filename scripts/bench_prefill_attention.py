"""Prefill attention for one step's chunks, side by side in one process:

    per_chunk  one SDPA call per chunk (what `paged_attention` did before prefill_groups)
    grouped    `paged_attention` on SDPA: one call per (length, context length) group
    padded     every chunk padded to the longest, one causal call (not used: to compare)
    kernel     `paged_attention` with `native_prefill`: the C kernel's causal prefill
               (backends/paged_decode.py), where its AVX-512 loops run on this CPU

Sizes are one layer of the default model (9 query heads, 3 KV heads, dim 64); `--lens` the
chunks' lengths (all without a cached prefix). The ways take turns over `--rounds`; each
prints its median per call and its largest difference from per_chunk, and the last line is
one JSON object with the ratios to per_chunk and the machine.

    python scripts/bench_prefill_attention.py [--lens 256,256,...] [--threads 2]
        [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

from backends import paged_decode
from hetero_pd import envs
from hetero_pd.bench.machine import cpu_info, take_turns
from hetero_pd.models.attention import AttentionMetadata, PrefillSpan, paged_attention

HEADS, KV_HEADS, DIM = 9, 3, 64


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lens", default="256,256,256,256,256,256,256,256")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--calls", type=int, default=5, help="calls per way per round")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(args.threads)
    lens = [int(n) for n in args.lens.split(",")]
    starts = [sum(lens[:i]) for i in range(len(lens))]
    tokens, scale = sum(lens), DIM**-0.5
    q = torch.randn(tokens, HEADS, DIM).to(dtype)
    k, v = (torch.randn(tokens, KV_HEADS, DIM).to(dtype) for _ in range(2))
    k_cache, v_cache = (torch.empty(tokens, 1, KV_HEADS, DIM, dtype=dtype) for _ in range(2))
    spans = [PrefillSpan(s, s + n) for s, n in zip(starts, lens, strict=True)]

    def per_chunk() -> torch.Tensor:
        out = torch.empty_like(q)
        for s in spans:
            op = F.scaled_dot_product_attention(
                *(t[s.start : s.end].transpose(0, 1)[None] for t in (q, k, v)),
                is_causal=True,
                scale=scale,
                enable_gqa=True,
            )
            out[s.start : s.end] = op[0].transpose(0, 1)
        return out

    def grouped() -> torch.Tensor:
        # A fresh metadata per call, as each step has (its groups are built on first use).
        meta = AttentionMetadata(slot_mapping=torch.arange(tokens), prefills=list(spans))
        return paged_attention(q, k, v, k_cache, v_cache, meta, scale)

    def padded() -> torch.Tensor:
        b, longest = len(lens), max(lens)
        qp, kp, vp = (t.new_zeros(b, t.shape[1], longest, DIM) for t in (q, k, v))
        for i, (s, n) in enumerate(zip(starts, lens, strict=True)):
            for dst, src in ((qp, q), (kp, k), (vp, v)):
                dst[i, :, :n] = src[s : s + n].transpose(0, 1)
        o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale, enable_gqa=True)
        return torch.cat([o[i, :, :n].transpose(0, 1) for i, n in enumerate(lens)])

    def kernel() -> torch.Tensor:
        meta = AttentionMetadata(
            slot_mapping=torch.arange(tokens), prefills=list(spans), native_prefill=True
        )
        return paged_attention(q, k, v, k_cache, v_cache, meta, scale)

    ways: dict[str, Callable[[], torch.Tensor]] = {
        "per_chunk": per_chunk,
        "grouped": grouped,
        "padded": padded,
    }
    if paged_decode.available(dtype, envs.compile_cache_dir() / "kernels"):
        if paged_decode.bf16_path() == "avx512_bf16":
            ways["kernel"] = kernel
        else:
            print("kernel: not timed (this CPU has no AVX-512 BF16: prefill stays on SDPA)")
    want = per_chunk()
    diff = {name: float((fn() - want).abs().max()) for name, fn in ways.items()}
    ms = take_turns(ways, args.rounds, args.calls)
    for name, t in ms.items():
        print(f"{name:9s} {t:8.2f} ms per layer  max |diff| from per_chunk {diff[name]:.1e}")
    result = {
        "lens": lens,
        "threads": args.threads,
        "dtype": args.dtype,
        "ms": {name: round(t, 3) for name, t in ms.items()},
        **{f"per_chunk_over_{name}": round(ms["per_chunk"] / t, 3) for name, t in ms.items()},
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "cpu": cpu_info(),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
