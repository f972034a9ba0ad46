"""`hetero-pd bench offline`: this engine vs transformers `generate` on one workload, one run.

Both sides get the same token ids, the same number of new tokens (greedy, EOS not
suppressed and not stopping), the same dtype (the engine's choice when `--dtype auto`) and
the same torch thread count; throughput counts generated tokens only. Each side runs in a
process of its own (its peak RSS is its own), warms up on prompts the measurement never
uses, and the sides take turns going first over `--repeats` rounds: the ratio reported is
the median of the rounds' ratios, with their spread. Both sides must generate the same
greedy tokens; prompts where they do not are reported. The last stdout line is one JSON
object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass, replace
from typing import Any

from hetero_pd.bench.background import background_load, check_count
from hetero_pd.bench.offline_side import Side, SideResult, SideSpec

TEXT = (
    "the cache moves between devices while tokens stream back to the user and every block "
    "carries an epoch so that late writes are rejected before anyone can read them"
)


def make_prompts(
    num: int, min_words: int, max_words: int, seed: int, tag: str = "Request"
) -> list[str]:
    import torch  # here: `compare_tokens` alone (scripts/side_by_side.py) needs no torch

    rng = torch.Generator().manual_seed(seed)
    words = TEXT.split(" ")
    prompts = []
    for i in range(num):
        n = int(torch.randint(min_words, max_words + 1, (1,), generator=rng))
        idx = torch.randint(0, len(words), (n,), generator=rng).tolist()
        prompts.append(f"{tag} {i}: " + " ".join(words[j] for j in idx))
    return prompts


@dataclass(frozen=True, slots=True)
class TokenCheck:
    """Where two sides' greedy tokens differ: prompt indices and the first position."""

    mismatched: list[int]
    first_difference: tuple[int, int] | None  # (prompt, position)
    agreement_pct: float  # tokens before each prompt's first difference / all tokens


def compare_tokens(a: list[list[int]], b: list[list[int]]) -> TokenCheck:
    if len(a) != len(b):
        raise ValueError(f"the sides answered {len(a)} and {len(b)} prompts")
    mismatched, first, same, total = [], None, 0, 0
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        n = next(
            (j for j, (s, t) in enumerate(zip(x, y, strict=False)) if s != t), min(len(x), len(y))
        )
        same += n
        total += max(len(x), len(y))
        if x != y:
            mismatched.append(i)
            first = first or (i, n)
    return TokenCheck(mismatched, first, round(100 * same / max(total, 1), 2))


def run_in_process(spec: SideSpec, timeout_s: float) -> SideResult:
    """Runs one side in a fresh Python process (`hetero_pd.bench.offline_side`)."""
    proc = subprocess.run(
        [sys.executable, "-m", "hetero_pd.bench.offline_side"],
        input=json.dumps(asdict(spec)),
        stdout=subprocess.PIPE,
        text=True,
        timeout=timeout_s,
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"the {spec.side} side exited with status {proc.returncode}")
    return SideResult(**json.loads(lines[-1]))


def _median(values: list[float]) -> float:
    return round(statistics.median(values), 3)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="hetero-pd bench offline", description=__doc__)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--min-words", type=int, default=8)
    p.add_argument("--max-words", type=int, default=48)
    p.add_argument("--warmup-prompts", type=int, default=4)
    p.add_argument(
        "--threads",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="torch threads per side (default: the CPUs this process may run on)",
    )
    p.add_argument(
        "--kv-cache-gb", type=float, default=1.0, help="the engine's KV cache (allocated at start)"
    )
    p.add_argument("--repeats", type=int, default=3, help="rounds; the sides alternate first")
    p.add_argument("--background-load", type=int, default=0, metavar="N", help="busy processes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--compile", default="auto", choices=["auto", "on", "off"], help="the engine's step"
    )
    p.add_argument(
        "--eager-baseline",
        action="store_true",
        help="also run the engine with compile off (compile_speedup, tokens compared)",
    )
    p.add_argument("--side-timeout", type=float, default=3600.0, help="seconds per side run")
    p.add_argument("--skip-transformers", action="store_true")
    args = p.parse_args(argv)
    if min(args.num_prompts, args.max_tokens, args.repeats, args.warmup_prompts) < 1:
        p.error("--num-prompts, --max-tokens, --repeats and --warmup-prompts must be >= 1")
    if not 1 <= args.min_words <= args.max_words:
        p.error("need 1 <= --min-words <= --max-words")
    try:
        check_count(args.background_load)
    except ValueError as e:
        p.error(str(e))
    return args


def workload_spec(args: argparse.Namespace) -> SideSpec:
    """The measured and warm-up prompts as token ids, and how to run them (`parse_args`)."""
    from hetero_pd.models.fetch import resolve_model
    from hetero_pd.models.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model(args.model))
    texts = make_prompts(args.num_prompts, args.min_words, args.max_words, args.seed)
    # Warm-up prompts of their own: the measured ones must not hit a cache the warm-up filled.
    warm = make_prompts(
        args.warmup_prompts, args.min_words, args.max_words, args.seed + 1, "Warm-up"
    )
    return SideSpec(
        side="engine",
        model=args.model,
        dtype=args.dtype,
        threads=args.threads,
        prompts=[list(tok.encode(t)) for t in texts],
        warmup_prompts=[list(tok.encode(t)) for t in warm],
        max_tokens=args.max_tokens,
        kv_cache_gb=args.kv_cache_gb,
        compile=args.compile,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    spec = workload_spec(args)
    sides: list[Side] = ["engine", "eager"] if args.eager_baseline else ["engine"]
    sides += [] if args.skip_transformers else ["transformers"]
    print(
        f"workload: {args.num_prompts} prompts x {args.max_tokens} new tokens, greedy, "
        f"dtype {args.dtype}, {args.threads} threads, {args.repeats} rounds, "
        f"background load {args.background_load}",
        file=sys.stderr,
    )
    rounds: list[dict[str, SideResult]] = []
    dtype = spec.dtype
    with background_load(args.background_load):
        for r in range(args.repeats):
            results: dict[str, SideResult] = {}
            for side in sides if r % 2 == 0 else sides[::-1]:
                res = run_in_process(replace(spec, side=side, dtype=dtype), args.side_timeout)
                if side == "engine":
                    dtype = res.dtype  # round 0 runs the engine first: `auto` is resolved once
                print(
                    f"round {r + 1}: {side}: {res.tokens} tokens in {res.elapsed_s:.2f}s "
                    f"({res.tok_s:.1f} tok/s, {res.dtype}, peak RSS {res.peak_rss_mb:.0f} MB)",
                    file=sys.stderr,
                )
                results[side] = res
            rounds.append(results)
    print(json.dumps(summarize(args, rounds)))
    return 0


def summarize(args: argparse.Namespace, rounds: list[dict[str, SideResult]]) -> dict[str, Any]:
    engine = [r["engine"] for r in rounds]
    out: dict[str, Any] = {
        "num_prompts": args.num_prompts,
        "max_tokens": args.max_tokens,
        "threads": args.threads,
        "dtype": engine[0].dtype,
        "dtype_requested": args.dtype,
        "repeats": len(rounds),
        "background_load": args.background_load,
        "engine_tok_s": _median([e.tok_s for e in engine]),
        "engine_tok_s_runs": [round(e.tok_s, 2) for e in engine],
        "peak_rss_mb": max(e.peak_rss_mb for e in engine),
        "compile": args.compile,
        "compiled": engine[0].compiled,
    }
    if "eager" in rounds[0]:
        out.update(eager_baseline(engine, [r["eager"] for r in rounds]))
    if "transformers" not in rounds[0]:
        return out
    hf = [r["transformers"] for r in rounds]
    ratios = [e.tok_s / t.tok_s for e, t in zip(engine, hf, strict=True)]
    check = compare_tokens(engine[0].token_ids, hf[0].token_ids)
    if check.first_difference is not None:
        prompt, pos = check.first_difference
        print(
            f"greedy tokens differ on {len(check.mismatched)} of {args.num_prompts} prompts "
            f"(first: prompt {prompt} at token {pos}); {check.agreement_pct}% of tokens agree "
            "before each prompt's first difference",
            file=sys.stderr,
        )
    out.update(
        transformers_tok_s=_median([t.tok_s for t in hf]),
        transformers_tok_s_runs=[round(t.tok_s, 2) for t in hf],
        ratio=_median(ratios),
        ratio_min=round(min(ratios), 3),
        ratio_max=round(max(ratios), 3),
        first_side=[next(iter(r)) for r in rounds],
        transformers_peak_rss_mb=max(t.peak_rss_mb for t in hf),
        token_mismatches=len(check.mismatched),
        mismatched_prompts=check.mismatched,
        token_agreement_pct=check.agreement_pct,
    )
    return out


def eager_baseline(engine: list[SideResult], eager: list[SideResult]) -> dict[str, Any]:
    """The engine against itself with the compiled step off, round by round."""
    speedups = [e.tok_s / b.tok_s for e, b in zip(engine, eager, strict=True)]
    return {
        "engine_eager_tok_s": _median([b.tok_s for b in eager]),
        "engine_eager_tok_s_runs": [round(b.tok_s, 2) for b in eager],
        "compile_speedup": _median(speedups),
        "compile_speedup_min": round(min(speedups), 3),
        "compile_speedup_max": round(max(speedups), 3),
        "eager_token_mismatches": len(
            compare_tokens(engine[0].token_ids, eager[0].token_ids).mismatched
        ),
    }


if __name__ == "__main__":
    sys.exit(main())
