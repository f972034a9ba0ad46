"""`hetero-pd bench offline`: this engine vs transformers `generate` on one workload, one run.

Both sides get the same prompts, the same number of new tokens (EOS ignored, greedy),
the same dtype and the same torch thread count; throughput counts generated tokens only.
The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from typing import Any

import torch

TEXT = (
    "the cache moves between devices while tokens stream back to the user and every block "
    "carries an epoch so that late writes are rejected before anyone can read them"
)


def make_prompts(num: int, min_words: int, max_words: int, seed: int) -> list[str]:
    rng = torch.Generator().manual_seed(seed)
    words = TEXT.split(" ")
    prompts = []
    for i in range(num):
        n = int(torch.randint(min_words, max_words + 1, (1,), generator=rng))
        idx = torch.randint(0, len(words), (n,), generator=rng).tolist()
        prompts.append(f"Request {i}: " + " ".join(words[j] for j in idx))
    return prompts


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_engine(args: argparse.Namespace, prompts: list[str]) -> tuple[float, int]:
    from hetero_pd import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=max(args.num_prompts, 1))
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=2))  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outs)


def run_transformers(args: argparse.Namespace, prompts: list[str]) -> tuple[float, int]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hetero_pd.config import parse_dtype
    from hetero_pd.models.fetch import resolve_model

    path = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(path, padding_side="left")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, dtype=parse_dtype(args.dtype)).eval()
    gen: dict[str, Any] = dict(
        max_new_tokens=args.max_tokens,
        min_new_tokens=args.max_tokens,
        do_sample=False,
        pad_token_id=tok.pad_token_id,
    )
    batch = tok(prompts[:2], return_tensors="pt", padding=True)
    with torch.inference_mode():
        model.generate(**batch, **{**gen, "max_new_tokens": 2, "min_new_tokens": 2})
    batch = tok(prompts, return_tensors="pt", padding=True)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(**batch, **gen)
    elapsed = time.perf_counter() - start
    return elapsed, (out.shape[1] - batch["input_ids"].shape[1]) * len(prompts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hetero-pd bench offline", description=__doc__)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--min-words", type=int, default=8)
    p.add_argument("--max-words", type=int, default=48)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-transformers", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    prompts = make_prompts(args.num_prompts, args.min_words, args.max_words, args.seed)
    print(
        f"workload: {args.num_prompts} prompts x {args.max_tokens} new tokens, greedy, "
        f"{args.dtype}, {args.threads} threads",
        file=sys.stderr,
    )
    e_time, e_tokens = run_engine(args, prompts)
    engine_tok_s = e_tokens / e_time
    print(f"hetero-pd engine: {e_tokens} tokens in {e_time:.1f}s", file=sys.stderr)
    result: dict[str, Any] = {
        "num_prompts": args.num_prompts,
        "max_tokens": args.max_tokens,
        "threads": args.threads,
        "dtype": args.dtype,
        "engine_tok_s": round(engine_tok_s, 2),
    }
    if not args.skip_transformers:
        t_time, t_tokens = run_transformers(args, prompts)
        print(f"transformers generate: {t_tokens} tokens in {t_time:.1f}s", file=sys.stderr)
        result["transformers_tok_s"] = round(t_tokens / t_time, 2)
        result["ratio"] = round(engine_tok_s / result["transformers_tok_s"], 3)
    result["peak_rss_mb"] = round(peak_rss_mb(), 1)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
