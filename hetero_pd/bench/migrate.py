"""`hetero-pd bench migrate`: how long a live migration pauses a decoding request, against
its context length, with pre-copy (the default: only the blocks filled during the last
round and the partial one move while it is paused) and without (stop-and-copy: every
block moves while it is paused), measured side by side in one run on one 1P2D stack.

For each context length one greedy request decodes while the router moves it between the
two decode workers `--migrations` times per mode, the modes taking turns. Per context and
mode it prints the pause (p50, p99; what the request's stream stops for: the last push and
the hand-over), the whole migration's time (p50) and the KV bytes moved, then the ratio of
the stop-and-copy pause to the pre-copy pause.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from typing import Any

from hetero_pd.deploy.testing import Stack, deployment, random_prompts, running_stack
from hetero_pd.models.fetch import DEFAULT_MODEL, resolve_model
from hetero_pd.sampling_params import SamplingParams
from hetero_pd.serving.router.migration import Migration

MODES = {"precopy": True, "stop-and-copy": False}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def output_tokens(migrations: int, gap: int) -> int:
    """The measured request's max_tokens. Tokens go on while a migration runs: on a Zen 5
    core the tests' tiny model decoded the 32 a migration once had to spare before the
    next one began (the request ended, "not decoding"). The request is cancelled after
    its last migration, so a machine that keeps up never decodes them all."""
    return 2 * migrations * (gap + 256) + 64


#: Tries again after a migration that failed and left its request decoding where it was
#: (on a fast CPU a small model can outgrow the destination's headroom during the copy).
RETRIES = 2


def measure(stack: Stack, context: int, migrations: int, gap: int) -> dict[str, list[Migration]]:
    """One request of `context` prompt tokens, moved `migrations` times per mode."""
    router = stack.router
    assert router is not None
    rid = f"bench-migrate-{context}"
    max_tokens = output_tokens(migrations, gap)
    prompt = random_prompts([context], seed=context)[0]

    async def consume() -> int:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        n = 0
        async for out in router.generate(rid, prompt, params):
            n += len(out.token_ids)
        return n

    run = stack.submit(consume())

    def wait(ready: Any) -> None:
        while not ready():
            if run.done():
                raise RuntimeError(f"the request ended early: {run.result()} tokens")
            time.sleep(0.005)

    results: dict[str, list[Migration]] = {mode: [] for mode in MODES}
    for turn in range(2 * migrations):
        mode = list(MODES)[turn % 2]
        wait(lambda: rid in router.streams and router.streams[rid].decoding)
        stream = router.streams[rid]
        start = stream.tokens
        wait(lambda: stream.tokens >= start + gap)  # noqa: B023 (the loop waits here)
        result = stack.call(router.migrator.migrate(rid, precopy=MODES[mode]), 120)
        for _ in range(RETRIES):  # a failed migration leaves the request decoding where it was
            if result.ok:
                break
            print(f"context {context} {mode}: failed ({result.reason}); again", file=sys.stderr)
            wait(lambda: rid in router.streams and router.streams[rid].decoding)
            result = stack.call(router.migrator.migrate(rid, precopy=MODES[mode]), 120)
        if not result.ok:
            raise RuntimeError(f"migration failed: {result.reason}")
        results[mode].append(result)
        print(
            f"context {context} {mode}: pause {result.pause_s * 1e3:.1f} ms, total "
            f"{result.total_s * 1e3:.1f} ms, {result.tokens} tokens",
            file=sys.stderr,
            flush=True,
        )
    run.cancel()  # the request is aborted: the next context starts on idle workers
    stack.wait_idle(60)
    return results


def under_load(
    stack: Stack, requests: int, prompt_len: int, max_tokens: int, restart: bool
) -> dict[str, Any]:
    """`requests` greedy requests at once; with `restart`, a rolling restart of every worker
    once a quarter of them decode. TTFT and TPOT (mean gap after the first token) per
    request, as the router streams them."""
    router, launcher = stack.router, stack.launcher
    assert router is not None and launcher is not None
    prompts = random_prompts([prompt_len] * requests, seed=prompt_len + restart)  # uncached
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    recomputed = stack.metric("hetero_pd_policy_decisions_total", decision="recompute")

    async def one(i: int) -> tuple[float, float]:
        start, first, last, n = time.monotonic(), 0.0, 0.0, 0
        async for out in router.generate(f"bench-load-{restart}-{i}", prompts[i], params):
            last = time.monotonic()
            first = first or last
            n += len(out.token_ids)
        if n != max_tokens:
            raise RuntimeError(f"request {i}: {n} tokens of {max_tokens}")
        return first - start, (last - first) / max(n - 1, 1)

    async def run_all() -> list[tuple[float, float] | BaseException]:
        return await asyncio.gather(*(one(i) for i in range(requests)), return_exceptions=True)

    runs = stack.submit(run_all())
    restarted: list[dict[str, Any]] = []
    if restart:
        while sum(s.decoding for s in router.streams.values()) < requests // 4:
            time.sleep(0.01)
        restarted = stack.call(launcher.rolling_restart(), 900)
    results = runs.result(900)
    done = [r for r in results if not isinstance(r, BaseException)]
    ttft, tpot = [r[0] * 1e3 for r in done], [r[1] * 1e3 for r in done]
    return {
        "restart": restart,
        "errors": len(results) - len(done),
        "recomputed": stack.metric("hetero_pd_policy_decisions_total", decision="recompute")
        - recomputed,
        "moved": sum(r["moved"] for r in restarted),
        "ttft_p50_ms": round(percentile(ttft, 0.5), 1),
        "ttft_p99_ms": round(percentile(ttft, 0.99), 1),
        "tpot_p50_ms": round(percentile(tpot, 0.5), 1),
        "tpot_p99_ms": round(percentile(tpot, 0.99), 1),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hetero-pd bench migrate", description=__doc__)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--contexts", default="128,512,2048", help="prompt lengths, tokens")
    ap.add_argument("--migrations", type=int, default=8, help="per context and mode")
    ap.add_argument("--gap", type=int, default=4, help="tokens decoded between migrations")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON too")
    ap.add_argument(
        "--rolling",
        type=int,
        default=0,
        metavar="N",
        help="also: N requests without, then with a rolling restart: TTFT/TPOT p50/p99",
    )
    args = ap.parse_args(argv)
    contexts = [int(c) for c in args.contexts.split(",")]
    engine: dict[str, Any] = {
        # the request's context, its output, and the router's headroom on a destination
        "max_model_len": max(contexts) + output_tokens(args.migrations, args.gap) + 128,
        "num_kv_blocks": (max(contexts) * 3) // 16 + 512,
        "max_num_batched_tokens": 2048,
    }
    workers = [{"role": "prefill"}, {"role": "decode"}, {"role": "decode"}]
    dep = deployment(resolve_model(args.model), workers=workers, engine=engine)
    rows: list[dict[str, Any]] = []
    with running_stack(dep) as stack:
        for context in contexts:
            results = measure(stack, context, args.migrations, args.gap)
            for mode, done in results.items():
                pauses = [r.pause_s * 1e3 for r in done]
                rows.append(
                    {
                        "context": context,
                        "mode": mode,
                        "pause_p50_ms": round(percentile(pauses, 0.5), 2),
                        "pause_p99_ms": round(percentile(pauses, 0.99), 2),
                        "total_p50_ms": round(statistics.median(r.total_s * 1e3 for r in done), 2),
                        "rounds_p50": statistics.median(r.rounds for r in done),
                        "kv_mb": round(statistics.median(r.bytes for r in done) / 2**20, 2),
                    }
                )
        loads = []
        if args.rolling:
            # The first run compiles the decode step's batch shapes; only the next two count.
            under_load(stack, args.rolling, 16, 8, False)
            loads = [under_load(stack, args.rolling, 128, 192, r) for r in (False, True)]
    print(f"{'context':>8} {'mode':>14} {'pause p50':>10} {'pause p99':>10} "
          f"{'total p50':>10} {'rounds':>6} {'KV MB':>7}")  # fmt: skip
    for r in rows:
        print(f"{r['context']:>8} {r['mode']:>14} {r['pause_p50_ms']:>8.1f}ms "
              f"{r['pause_p99_ms']:>8.1f}ms {r['total_p50_ms']:>8.1f}ms {r['rounds_p50']:>6} "
              f"{r['kv_mb']:>7.2f}")  # fmt: skip
    for context in contexts:
        pre, stop = (
            next(r for r in rows if r["context"] == context and r["mode"] == m) for m in MODES
        )
        ratio = float(stop["pause_p50_ms"]) / max(float(pre["pause_p50_ms"]), 1e-9)
        print(f"context {context}: stop-and-copy pause / pre-copy pause (p50) = {ratio:.2f}")
    for load in loads:
        print(json.dumps(load))
    if len(loads) == 2:
        for key in ("ttft_p99_ms", "tpot_p99_ms"):
            ratio = loads[1][key] / max(loads[0][key], 1e-9)
            print(f"rolling restart / none, {key}: {ratio:.2f}")
    if args.json:
        print(json.dumps(rows))
    return 0
