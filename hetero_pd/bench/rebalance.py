"""`hetero-pd bench rebalance`: the router's rebalancing policy (Llumnix-style, opt-in:
`router.rebalance`) against none, on the same imbalanced load, side by side in one run on
one 1P2D stack of the default model whose decode workers have a small KV cache.

The imbalance is the one a fleet has after a scale-up or a restart: decode-1 joins late.
It is kept out of rotation while a first wave of `--requests` long requests starts, so all
of them decode on decode-0, whose KV they fill past `high` as they grow (and, left alone,
past its whole cache: it then preempts and recomputes); decode-1 then joins, and a second
wave of half as many requests arrives, which the router places on the lighter worker.
With rebalancing on, the router also live-migrates first-wave requests from decode-0 to
decode-1. Each run (off, then on, after a warm-up that compiles the decode step's batch
shapes on both workers) reports TTFT and TPOT (mean gap after the first token) p50/p99 over
all requests, output throughput (output tokens / the run's wall time) and migrations.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import time
from typing import Any

from hetero_pd.bench.migrate import percentile
from hetero_pd.deploy.testing import Stack, deployment, random_prompts, running_stack
from hetero_pd.models.fetch import DEFAULT_MODEL, resolve_model
from hetero_pd.sampling_params import SamplingParams

BLOCK = 16  # the engine's default block size
LATE = "decode-1"


def set_rebalancing(stack: Stack, enabled: bool) -> None:
    assert stack.router is not None
    rebalancer = stack.router.rebalancer
    rebalancer.cfg = dataclasses.replace(rebalancer.cfg, enabled=enabled)


def run_load(
    stack: Stack, requests: int, prompt_len: int, max_tokens: int, rebalance: bool, seed: int
) -> dict[str, Any]:
    """One run of the imbalanced load (prompts of their own: nothing cached)."""
    router = stack.router
    assert router is not None
    second = max(requests // 2, 1)
    prompts = random_prompts([prompt_len] * (requests + second), seed=seed)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    moved = stack.metric("hetero_pd_migrations_by_reason_total", reason="rebalance")
    set_rebalancing(stack, False)
    router.migrator.draining.add(LATE)

    decoded = [0]  # requests that had their first token

    async def one(i: int) -> tuple[float, float, int]:
        start, first, last, n = time.monotonic(), 0.0, 0.0, 0
        async for out in router.generate(f"bench-rebalance-{seed}-{i}", prompts[i], params):
            last = time.monotonic()
            if not first:
                first, decoded[0] = last, decoded[0] + 1
            n += len(out.token_ids)
        if n != max_tokens:
            raise RuntimeError(f"request {i}: {n} tokens of {max_tokens}")
        return first - start, (last - first) / max(n - 1, 1), n

    async def wave(lo: int, hi: int) -> list[tuple[float, float, int]]:
        return list(await asyncio.gather(*(one(i) for i in range(lo, hi))))

    started = time.monotonic()
    first_wave = stack.submit(wave(0, requests))
    deadline = time.monotonic() + 600
    while decoded[0] < requests:  # every one of them on decode-0
        if first_wave.done() or time.monotonic() > deadline:
            raise RuntimeError(f"the first wave never all decoded: {first_wave.result()}")
        time.sleep(0.01)
    router.migrator.undrain(LATE)
    set_rebalancing(stack, rebalance)
    results = stack.submit(wave(requests, requests + second)).result(1800)
    results += first_wave.result(1800)
    wall = time.monotonic() - started
    set_rebalancing(stack, False)
    stack.wait_idle(120)
    ttft, tpot = [r[0] * 1e3 for r in results], [r[1] * 1e3 for r in results]
    return {
        "rebalance": rebalance,
        "requests": len(results),
        "ttft_p50_ms": round(percentile(ttft, 0.5), 1),
        "ttft_p99_ms": round(percentile(ttft, 0.99), 1),
        "tpot_p50_ms": round(percentile(tpot, 0.5), 1),
        "tpot_p99_ms": round(percentile(tpot, 0.99), 1),
        "output_tok_s": round(sum(r[2] for r in results) / wall, 2),
        "wall_s": round(wall, 1),
        "migrations": int(
            stack.metric("hetero_pd_migrations_by_reason_total", reason="rebalance") - moved
        ),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hetero-pd bench rebalance", description=__doc__)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--requests", type=int, default=8, help="the first wave (on decode-0)")
    ap.add_argument("--prompt-len", type=int, default=96)
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument(
        "--kv-share",
        type=float,
        default=0.75,
        help="each decode worker's KV blocks, as a share of what the first wave needs at its end",
    )
    ap.add_argument("--high", type=float, default=0.6)
    ap.add_argument("--low", type=float, default=0.4)
    ap.add_argument("--json", action="store_true", help="print the rows as JSON too")
    args = ap.parse_args(argv)
    per_request = -(-(args.prompt_len + args.max_tokens) // BLOCK)
    engine = {
        "num_kv_blocks": max(int(args.requests * per_request * args.kv_share), 2 * per_request),
        "max_model_len": args.prompt_len + args.max_tokens + BLOCK,
    }
    rebalance = {
        "enabled": True, "high": args.high, "low": args.low, "interval_s": 0.5,
        "max_moves": 2, "cooldown_s": 2.0,
    }  # fmt: skip
    workers = [{"role": "prefill"}, {"role": "decode"}, {"role": "decode"}]
    dep = deployment(
        resolve_model(args.model), workers=workers, engine=engine, router={"rebalance": rebalance}
    )
    print(f"decode workers: {engine['num_kv_blocks']} KV blocks of {BLOCK} tokens each; "
          f"first wave {args.requests} x ({args.prompt_len} + {args.max_tokens}) tokens "
          f"= {args.requests * per_request} blocks at its end", flush=True)  # fmt: skip
    with running_stack(dep) as stack:
        run_load(stack, args.requests, args.prompt_len, 16, True, seed=1)  # warm-up
        rows = [
            run_load(stack, args.requests, args.prompt_len, args.max_tokens, on, seed=2 + on)
            for on in (False, True)
        ]
    print(f"{'rebalance':>9} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9} "
          f"{'tok/s':>7} {'wall':>6} {'migrations':>10}")  # fmt: skip
    for r in rows:
        print(f"{'on' if r['rebalance'] else 'off':>9} {r['ttft_p50_ms']:>7.0f}ms "
              f"{r['ttft_p99_ms']:>7.0f}ms {r['tpot_p50_ms']:>7.0f}ms {r['tpot_p99_ms']:>7.0f}ms "
              f"{r['output_tok_s']:>7.2f} {r['wall_s']:>5.0f}s {r['migrations']:>10}")  # fmt: skip
    off, on = rows
    for key in ("ttft_p99_ms", "tpot_p99_ms", "output_tok_s"):
        print(f"rebalance on / off, {key}: {on[key] / max(off[key], 1e-9):.2f}")
    if args.json:
        print(json.dumps(rows))
    return 0
