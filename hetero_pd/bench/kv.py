"""`hetero-pd bench kv`: the prefix cache's host-DRAM and SSD tiers, offline on the engine.

Workload: `sessions` multi-turn chats share one system prompt; each turn's prompt is the
whole conversation so far (system, earlier user turns and the model's own greedy replies)
plus a new user message. Turns run closed-loop, `concurrency` at a time; the next turn is
that of a chat drawn at random (seeded) among those waiting, so between two turns of one
chat the others push its KV out of a device cache sized below the working set, at varying
reuse distances (strict round-robin would be LRU's worst case: any tier smaller than the
working set would miss every time). The same workload runs with tiers off, DRAM, and
DRAM+SSD, one after the other in one process; reported per configuration: TTFT p50/p99,
prompt tokens computed (the rest came from the prefix cache), tier hits and onload times.
Greedy replies must be identical in every configuration (checked). The last stdout line is
one JSON object; its `kv` part gives the model's KV size (`--model` takes any model folder:
dense, MoE, or MLA whose latent KV has no heads) and the bytes a prefill-to-decode hand-off
of each request's prompt moves, all of it or only what the prefix cache lacked.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import torch

from hetero_pd.bench.metrics import latency_stats
from hetero_pd.config import EngineConfig, parse_dtype
from hetero_pd.engine.kv_cache_manager import cdiv
from hetero_pd.engine.llm_engine import LLMEngine
from hetero_pd.models.config import ModelConfig
from hetero_pd.models.fetch import resolve_model
from hetero_pd.sampling_params import SamplingParams

CONFIGS = ("off", "dram", "dram+ssd")
GB = 2**30


@dataclass(frozen=True, slots=True)
class Workload:
    sessions: int = 8
    turns: int = 5
    system_tokens: int = 128
    user_tokens: int = 32
    max_tokens: int = 8
    concurrency: int = 2
    seed: int = 0

    def tokens(self, vocab: int, n: int, *key: int) -> list[int]:
        rng = random.Random(f"{self.seed}:{key}")
        return [rng.randrange(vocab // 4, vocab) for _ in range(n)]  # past special tokens

    def working_set_blocks(self, block_size: int) -> int:
        """Blocks of KV every chat's last turn needs: the system prompt once, plus each
        chat's own history."""
        per_chat = self.turns * (self.user_tokens + self.max_tokens)
        return cdiv(self.system_tokens, block_size) + self.sessions * cdiv(per_chat, block_size)

    def max_context_blocks(self, block_size: int) -> int:
        ctx = self.system_tokens + self.turns * (self.user_tokens + self.max_tokens)
        return cdiv(ctx, block_size)


@dataclass(slots=True)
class Result:
    name: str
    ttft_s: list[float]
    prompt_tokens: int
    cached_tokens: int
    wall_s: float
    replies: dict[str, list[int]]
    tiers: dict[str, Any] | None

    def summary(self) -> dict[str, Any]:
        ttft = latency_stats(self.ttft_s)
        assert ttft is not None
        out: dict[str, Any] = {
            "requests": len(self.ttft_s),
            "ttft_p50_ms": round(ttft.percentiles[50], 1),
            "ttft_p99_ms": round(ttft.percentiles[99], 1),
            "ttft_mean_ms": round(ttft.mean, 1),
            "prompt_tokens": self.prompt_tokens,
            "prefill_tokens_computed": self.prompt_tokens - self.cached_tokens,
            "wall_s": round(self.wall_s, 2),
        }
        if self.tiers is not None:
            t = self.tiers
            disk = t["disk"] or {}
            onload_ms = 1000 * t["onload_seconds_total"] / max(t["onloads"], 1)
            out |= {
                "host_hits": t["host"]["hits"],
                "host_hit_mb": round(t["host"]["hit_bytes"] / 2**20, 1),
                "disk_hits": disk.get("hits", 0),
                "disk_hit_mb": round(disk.get("hit_bytes", 0) / 2**20, 1),
                "onloads": t["onloads"],
                "onload_mean_ms": round(onload_ms, 2),
                "onload_max_ms": round(1000 * t["onload_seconds_max"], 2),
            }
        return out


def run_workload(engine: LLMEngine, w: Workload, name: str) -> Result:
    """Runs every turn of every chat closed-loop; TTFT is from add_request to the step that
    returns the request's first token."""
    vocab = engine.model_config.vocab_size
    engine.add_request(w.tokens(vocab, 32, -2), SamplingParams(max_tokens=2), "warm-up")
    while engine.has_unfinished_requests():
        engine.step()
    params = SamplingParams(temperature=0, max_tokens=w.max_tokens, ignore_eos=True)
    history = [w.tokens(vocab, w.system_tokens, -1) for _ in range(w.sessions)]
    turn = [0] * w.sessions
    ready = list(range(w.sessions))
    order = random.Random(w.seed)
    in_flight: dict[str, tuple[int, list[int], float]] = {}
    ttft: dict[str, float] = {}
    replies: dict[str, list[int]] = {}
    prompt_tokens = cached = 0
    start = time.perf_counter()
    while ready or in_flight:
        while ready and len(in_flight) < w.concurrency:
            s = ready.pop(order.randrange(len(ready)))
            prompt = history[s] + w.tokens(vocab, w.user_tokens, s, turn[s])
            rid = f"chat{s}-turn{turn[s]}"
            engine.add_request(prompt, params, request_id=rid)
            in_flight[rid] = (s, prompt, time.perf_counter())
        for out in engine.step():
            s, prompt, sent = in_flight[out.request_id]
            ttft.setdefault(out.request_id, time.perf_counter() - sent)
            if not out.finished:
                continue
            del in_flight[out.request_id]
            replies[out.request_id] = out.outputs[0].token_ids
            history[s] = prompt + out.outputs[0].token_ids
            prompt_tokens += len(prompt)
            cached += out.num_cached_tokens
            turn[s] += 1
            if turn[s] < w.turns:
                ready.append(s)
    wall = time.perf_counter() - start
    stats = engine.kv_tier_stats()
    return Result(
        name,
        list(ttft.values()),
        prompt_tokens,
        cached,
        wall,
        replies,
        stats.to_dict() if stats else None,
    )


def kv_sizes(cfg: ModelConfig, itemsize: int, block_size: int, result: Result) -> dict[str, Any]:
    """The model's KV bytes per token and per block, and per request of `result`'s run the
    prompt's KV (what a 1P1D hand-off moves) and its part the prefix cache did not hold (what
    a suffix-only hand-off moves)."""
    per_token = cfg.kv_bytes_per_token * itemsize
    requests = max(len(result.ttft_s), 1)
    computed = result.prompt_tokens - result.cached_tokens
    return {
        "architecture": cfg.architecture,
        "kv_tensors_per_layer": cfg.kv_tensors_per_layer,
        "kv_block_shape": list(cfg.kv_block_shape(block_size)),
        "bytes_per_token": per_token,
        "bytes_per_token_per_layer": per_token // cfg.num_layers,
        "block_bytes": per_token * block_size,
        "prompt_bytes_per_request": round(result.prompt_tokens * per_token / requests),
        "suffix_bytes_per_request": round(computed * per_token / requests),
    }


def engine_options(
    args: argparse.Namespace, config: str, block_bytes: int, disk_path: str
) -> dict[str, Any]:
    opts: dict[str, Any] = dict(
        device=args.device,
        dtype=args.dtype,
        block_size=args.block_size,
        num_kv_blocks=args.device_blocks,
        max_num_seqs=args.concurrency,
        max_num_batched_tokens=args.max_batched_tokens,
        num_threads=args.threads,
    )
    if config != "off":
        opts["kv_cache_host_gb"] = (args.host_blocks + 0.5) * block_bytes / GB
        opts["kv_cache_admit_after"] = args.admit_after
    if config == "dram+ssd":
        opts["kv_cache_disk_gb"] = args.disk_gb
        opts["kv_cache_disk_path"] = disk_path
    return opts


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hetero-pd bench kv", description=__doc__)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--system-tokens", type=int, default=128)
    p.add_argument("--user-tokens", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-batched-tokens", type=int, default=1024)
    p.add_argument(
        "--device-blocks", type=int, help="device KV blocks (default: a third of the working set)"
    )
    p.add_argument(
        "--host-blocks", type=int, help="host-DRAM tier blocks (default: half the working set)"
    )
    p.add_argument("--disk-gb", type=float, default=1.0, help="SSD tier size")
    p.add_argument("--disk-path", help="SSD tier folder (default: a fresh temporary folder)")
    p.add_argument(
        "--admit-after", type=int, default=2, help="uses before a block goes down a tier"
    )
    p.add_argument("--configs", default=",".join(CONFIGS), help="a subset of " + ",".join(CONFIGS))
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configs = [c for c in args.configs.split(",") if c]
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown:
        print(f"unknown --configs {unknown}; choose from {list(CONFIGS)}", file=sys.stderr)
        return 2
    w = Workload(
        args.sessions,
        args.turns,
        args.system_tokens,
        args.user_tokens,
        args.max_tokens,
        args.concurrency,
        args.seed,
    )
    cfg = ModelConfig.from_dir(resolve_model(args.model))
    elem = torch.tensor([], dtype=parse_dtype(args.dtype))
    block_bytes = args.block_size * cfg.kv_bytes_per_token * elem.element_size()
    ws = w.working_set_blocks(args.block_size)
    floor = args.concurrency * (w.max_context_blocks(args.block_size) + 1)
    args.device_blocks = args.device_blocks or max(ws // 3, floor)
    args.host_blocks = args.host_blocks or max(ws // 2, 1)
    print(
        f"workload: {w.sessions} chats x {w.turns} turns, system {w.system_tokens} + user "
        f"{w.user_tokens} + reply {w.max_tokens} tokens, {w.concurrency} at a time; working "
        f"set {ws} blocks of {block_bytes / 2**20:.2f} MiB; device {args.device_blocks}, "
        f"host tier {args.host_blocks}, SSD {args.disk_gb} GB",
        file=sys.stderr,
    )
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="hetero-pd-kv-") as tmp:
        for name in configs:
            opts = engine_options(args, name, block_bytes, args.disk_path or tmp)
            engine = LLMEngine(EngineConfig.from_kwargs(args.model, **opts))
            try:
                results.append(run_workload(engine, w, name))
            finally:
                engine.close()
            print(f"{name}: {json.dumps(results[-1].summary())}", file=sys.stderr)
    same = all(r.replies == results[0].replies for r in results)
    report = {
        "kv": kv_sizes(cfg, elem.element_size(), args.block_size, results[0]),
        "model": args.model,
        "dtype": args.dtype,
        "threads": args.threads,
        "working_set_blocks": ws,
        "device_blocks": args.device_blocks,
        "host_blocks": args.host_blocks,
        "disk_gb": args.disk_gb,
        "admit_after": args.admit_after,
        "block_mib": round(block_bytes / 2**20, 3),
        "replies_identical": same,
        "configs": {r.name: r.summary() for r in results},
    }
    print(json.dumps(report))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
