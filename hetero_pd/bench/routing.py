"""`hetero-pd bench routing`: routing policies on a shared-system-prompt, multi-turn workload.

Workload: `sessions` chats share one system prompt; turn 1 of a chat is the system prompt
plus a user message, and each next turn appends the model's greedy reply (its text
tokenized again through the server's /tokenize) and another user message to the previous
turn's prompt, so the prompts are the same in every configuration as long as the replies
are (checked). Turns go turn by turn over all chats, `concurrency` requests at a time,
streamed through the router.

One deployment (`prefill` prefill workers + 1 decode worker, one thread each) per
configuration, one after the other in one run, the same prompts in each:

    least_loaded        the old default: the decode worker's cache is not counted
    prefix_aware        longest prefix held (records and the workers' reports)
    kv_aware            Dynamo's cost, without prefix pulls
    kv_aware+pull       Dynamo's cost; a prefix held elsewhere is pulled, not computed
    kv_aware-full-push  kv_aware, but decode receives the whole prompt's KV even where its
                        own cache holds the prefix (router.decode_prefix_reuse: false): the
                        KV bytes suffix-only transfer saves

Reported per configuration: TTFT p50/p99, prompt tokens computed over all workers (the
rest came from a prefix cache or a pull), prefix pulls, KV bytes pushed, and the routing
decisions. Greedy replies must be identical in every configuration (checked). The last
stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from typing import Any

import aiohttp

from hetero_pd.bench.client import send_request
from hetero_pd.bench.datasets import BenchRequest
from hetero_pd.bench.metrics import RequestResult, latency_stats
from hetero_pd.deploy.schema import parse_deployment
from hetero_pd.deploy.serve import serve
from hetero_pd.deploy.testing import metric_value
from hetero_pd.models.config import ModelConfig
from hetero_pd.models.fetch import resolve_model
from hetero_pd.serving.router.router import Router

CONFIGS: dict[str, dict[str, Any]] = {
    "least_loaded": {"policy": "least_loaded"},
    "prefix_aware": {"policy": "prefix_aware"},
    "kv_aware": {"policy": "kv_aware", "prefix_pull_min_tokens": 0},
    "kv_aware+pull": {"policy": "kv_aware"},
    "kv_aware-full-push": {
        "policy": "kv_aware",
        "prefix_pull_min_tokens": 0,
        "decode_prefix_reuse": False,
    },
}


def messages(args: argparse.Namespace, vocab: int) -> tuple[list[int], list[list[list[int]]]]:
    """(system prompt, user[turn][session]): token ids past the special tokens, seeded."""
    rng = random.Random(args.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(vocab // 4, vocab) for _ in range(n)]

    system = tokens(args.system_tokens)
    return system, [
        [tokens(args.user_tokens) for _ in range(args.sessions)] for _ in range(args.turns)
    ]


async def run_turns(url: str, model: str, args: Any) -> tuple[list[RequestResult], str]:
    """Every turn of every chat; a chat's next prompt is its last prompt, the reply (its
    text tokenized again) and the next user message."""
    vocab = ModelConfig.from_dir(resolve_model(args.model)).vocab_size
    system, users = messages(args, vocab)
    gate = asyncio.Semaphore(args.concurrency)
    history = [list(system) for _ in range(args.sessions)]
    results: list[RequestResult] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:

        async def one(prompt: list[int]) -> RequestResult:
            payload = {
                "model": model, "prompt": prompt, "max_tokens": args.max_tokens,
                "temperature": 0.0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True},
            }  # fmt: skip
            req = BenchRequest("", len(prompt), args.max_tokens)
            async with gate:
                return await send_request(session, f"{url}/v1/completions", "completions",
                                          payload, req)  # fmt: skip

        async def tokenize(text: str) -> list[int]:
            body = {"prompt": text, "add_special_tokens": False}
            async with session.post(f"{url}/tokenize", json=body) as resp:
                return list((await resp.json())["tokens"])

        for turn in users:
            for chat, user in zip(history, turn, strict=True):
                chat += user
            done = await asyncio.gather(*(one(list(chat)) for chat in history))
            results += done
            for chat, r in zip(history, done, strict=True):
                chat += await tokenize(r.generated_text) if args.feed_replies else []
        async with session.get(f"{url}/metrics") as resp:
            metrics = await resp.text()
    return results, metrics


async def fresh_heartbeats(router: Router, timeout_s: float = 10.0) -> None:
    """Until every worker's heartbeat has arrived since the call: sent after the worker's
    last output (one socket keeps their order), its load counts every request."""
    before = {w.worker_id: w.load for w in router.workers.values()}
    deadline = time.monotonic() + timeout_s
    while any(w.load is before[w.worker_id] for w in router.workers.values()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no heartbeat from every worker within {timeout_s} s")
        await asyncio.sleep(0.02)


def run_config(name: str, args: argparse.Namespace) -> dict[str, Any]:
    raw = {
        "model": args.model,
        "workers": [{"role": "prefill", "count": args.prefill}, {"role": "decode"}],
        "router": {"host": "127.0.0.1", "port": 0, "elastic_prefill": False, **CONFIGS[name]},
        "engine": {"num_threads": 1, "dtype": args.dtype, "max_num_batched_tokens": 512},
    }
    dep = parse_deployment(raw, f"<bench routing {name}>")
    out: dict[str, Any] = {}
    stop = asyncio.Event()

    async def on_ready(url: str, launcher: Any, router: Router) -> None:
        try:
            start = time.perf_counter()
            results, metrics = await run_turns(url, dep.model, args)
            out["wall_s"] = time.perf_counter() - start
            await fresh_heartbeats(router)
            out["results"], out["metrics"] = results, metrics
            out["loads"] = {w.worker_id: w.load for w in router.workers.values()}
        finally:
            stop.set()

    asyncio.run(serve(dep, on_ready=on_ready, stop=stop))
    results: list[RequestResult] = out["results"]
    failed = [r.error for r in results if not r.success]
    if failed:
        raise RuntimeError(f"{name}: {len(failed)} requests failed, e.g. {failed[0]}")
    loads = out["loads"].values()
    metrics = out["metrics"]
    decisions = ("disaggregated", "local_prefill", "prefix_pull", "recompute")
    ttft = latency_stats([r.ttft for r in results])
    assert ttft is not None
    return {
        "config": name,
        "requests": len(results),
        "ttft_p50_ms": round(ttft.median, 1),
        "ttft_p99_ms": round(ttft.percentiles[99], 1),
        "prompt_tokens": sum(r.prompt_len for r in results),
        "prompt_tokens_computed": sum(w.prompt_tokens_computed for w in loads),
        "prefix_pulls": sum(w.prefix_pulls for w in loads),
        "prefix_pulled_tokens": sum(w.prefix_pulled_tokens for w in loads),
        "prefix_pull_failures": sum(w.prefix_pull_failures for w in loads),
        "kv_bytes_pushed": metric_value(
            metrics, "hetero_pd_kv_transfer_bytes_total", transport="kv"
        ),
        "decisions": {
            d: metric_value(metrics, "hetero_pd_policy_decisions_total", decision=d)
            for d in decisions
        },
        "wall_s": round(out["wall_s"], 2),
        "replies": [r.generated_text for r in results],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hetero-pd bench routing", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--prefill", type=int, default=2, help="prefill workers (one decode worker)")
    p.add_argument("--sessions", type=int, default=4)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=256)
    p.add_argument("--user-tokens", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument(
        "--feed-replies", action=argparse.BooleanOptionalAction, default=True,
        help="a chat's next turn holds the model's reply (its text tokenized again)",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--configs", default=",".join(CONFIGS), help="comma-separated, of " + ", ".join(CONFIGS)
    )
    args = p.parse_args(argv)
    names = [n for n in args.configs.split(",") if n]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        p.error(f"unknown configs {unknown}; choose from {list(CONFIGS)}")
    rows = [run_config(name, args) for name in names]
    agree = all(r["replies"] == rows[0]["replies"] for r in rows)
    cols = (
        "config",
        "ttft_p50_ms",
        "ttft_p99_ms",
        "prompt_tokens_computed",
        "prefix_pulls",
        "kv_bytes_pushed",
    )
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(str(r[c]) for c in cols), "|", r["decisions"])
    for r in rows:
        del r["replies"]
    print(json.dumps({"workload": vars(args), "greedy_replies_identical": agree, "runs": rows}))
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
