"""`hetero-pd bench tp MODEL...`: what tensor parallelism costs and saves on this host.

For each model folder: the weight bytes each rank holds at TP 1 and TP 2 (from the shapes
each rank's shard has: parallel.shard_config), and the median decode step time of one
engine at TP 1 on `--threads` threads against TP 2 with `--threads / 2` threads per rank
(the same cores either way). With `--handoff`, also the KV hand-off from prefill at TP 2
to decode at TP 1 against TP 1 -> TP 1: writes per request and bytes/s (bench/tp_handoff.py).
Prints one JSON line per model, with the CPU it ran on.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from hetero_pd.bench import tp_handoff
from hetero_pd.bench.machine import cpu_info
from hetero_pd.llm import LLM
from hetero_pd.models.config import ModelConfig
from hetero_pd.models.loader import model_class
from hetero_pd.models.parallel import Parallel, shard_config
from hetero_pd.sampling_params import SamplingParams


def weight_bytes(cfg: ModelConfig, tp: int, rank: int, elem: int = 4) -> int:
    """Bytes of rank `rank`'s weights at TP `tp` (a tied LM head counted once)."""
    parallel = Parallel(rank, tp)
    with torch.device("meta"):
        model = model_class(cfg)(shard_config(cfg, parallel), 16, parallel)
    tied = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    return elem * sum(p.numel() for n, p in model.named_parameters() if n not in tied)


def decode_step_ms(model: str, tp: int, threads: int, batch: int, steps: int) -> float:
    """Median time of a decode-only engine step over `batch` running requests."""
    llm = LLM(
        model,
        dtype="float32",
        tensor_parallel_size=tp,
        num_threads=threads,
        compile="off",
        num_kv_blocks=batch * 16,
        block_size=16,
    )
    try:
        engine, params = llm.engine, SamplingParams(max_tokens=steps + 8, ignore_eos=True)
        vocab = engine.model_config.vocab_size
        for i in range(batch):
            engine.add_request([(7 * i + j) % vocab for j in range(32)], params)
        engine.step()  # every prompt prefilled in one step (32 * batch tokens)
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        return 1000 * statistics.median(times)
    finally:
        llm.engine.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hetero-pd bench tp", description=__doc__)
    p.add_argument("models", nargs="+", help="Hugging Face model folders")
    p.add_argument("--threads", type=int, default=2, help="threads in all (TP 2: half each)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--no-timing", action="store_true", help="no decode step timing")
    p.add_argument("--handoff", action="store_true", help="KV hand-off TP 2 -> 1 vs 1 -> 1")
    p.add_argument("--transport", choices=["tcp", "shm"], default="tcp")
    p.add_argument("--requests", type=int, default=8, help="hand-offs measured (--handoff)")
    p.add_argument("--prompt-tokens", type=int, default=256)
    args = p.parse_args(argv)
    for model in args.models:
        cfg = ModelConfig.from_dir(Path(model))
        row: dict[str, object] = {
            "model": Path(model).name,
            "architecture": cfg.architecture,
            "weight_bytes_tp1": weight_bytes(cfg, 1, 0),
            "weight_bytes_tp2_per_rank": [weight_bytes(cfg, 2, r) for r in range(2)],
        }
        if not args.no_timing:
            half = max(1, args.threads // 2)
            row["decode_step_ms_tp1"] = round(
                decode_step_ms(model, 1, args.threads, args.batch, args.steps), 2
            )
            row["decode_step_ms_tp2"] = round(
                decode_step_ms(model, 2, half, args.batch, args.steps), 2
            )
            row["threads"] = {"tp1": args.threads, "tp2_per_rank": half}
        if args.handoff:
            row["kv_handoff"] = tp_handoff.compare(
                Path(model), args.transport, args.requests, args.prompt_tokens
            )
        print(json.dumps({**row, "cpu": cpu_info()}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
