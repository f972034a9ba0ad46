"""What structured outputs cost in the engine's decode loop, side by side in one run.

    python -m hetero_pd.bench.grammar_cost [--model DIR] [--batch 4] [--tokens 48]

The same prompts and lengths (``min_tokens = max_tokens``, so nothing stops early) run
unconstrained, under a regex and under a JSON schema, the grammar masks computed on their
thread while the forward pass runs (the engine's way) and, for comparison, after it
(synchronously). Prints output tok/s and the per-step time (TPOT) p50/p99 of each, and each
one's ratio to the unconstrained run; then a schema's first compile against a cached one.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager

from hetero_pd.bench.grammar import SCHEMA
from hetero_pd.bench.machine import cpu_info
from hetero_pd.config import EngineConfig
from hetero_pd.engine.llm_engine import LLMEngine
from hetero_pd.engine.sampler import Sampler
from hetero_pd.sampling_params import SamplingParams
from hetero_pd.structured_outputs import StructuredOutputsParams

PROMPTS = ["Write about the sea:", "A list of fruits:", "Tell me a story:", "Some JSON:"]
#: An open-ended array: long enough that no run ends before its tokens.
LONG_JSON = {"type": "array", "items": {"type": "string", "maxLength": 40}, "minItems": 64}
LONG_REGEX = r"[A-Za-z ,.']{1,2000}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hetero-pd bench grammar-cost", description=__doc__)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the engine")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    engine = LLMEngine(EngineConfig(model=args.model, dtype="float32", num_threads=args.threads))
    cpu = cpu_info()
    print(f"cpu: {cpu['model']} ({cpu['cores']} cores; {cpu['features']})")
    print(f"batch {args.batch}, {args.tokens} tokens each, greedy, {args.threads} torch threads")
    cases: list[tuple[str, StructuredOutputsParams | None, bool]] = [
        ("unconstrained", None, True),
        ("regex, overlapped", StructuredOutputsParams(regex=LONG_REGEX), True),
        ("json schema, overlapped", StructuredOutputsParams(json=LONG_JSON), True),
        ("json schema, synchronous", StructuredOutputsParams(json=LONG_JSON), False),
    ]
    for _, so, _ in cases:  # warm up: the step, and the tokenizer's index (~1 s, once)
        _run(engine, args.batch, 4, so)
    # Rounds interleave the cases, so that a change in the machine's load hits them alike.
    rates: dict[str, list[float]] = {name: [] for name, _, _ in cases}
    steps: dict[str, list[float]] = {name: [] for name, _, _ in cases}
    for _ in range(args.rounds):
        for name, so, overlap in cases:
            with _masks_overlapped(overlap):
                tokens, times, wall = _run(engine, args.batch, args.tokens, so)
            rates[name].append(tokens / wall)
            steps[name] += times
    base = statistics.median(rates["unconstrained"])
    print(f"{'case (median of rounds)':<28}{'tok/s':>8}{'TPOT p50 ms':>13}{'p99 ms':>9}"
          f"{'tok/s ratio':>13}")  # fmt: skip
    for name, _, _ in cases:
        rate, times = statistics.median(rates[name]), sorted(steps[name])
        p99 = times[min(len(times) - 1, int(len(times) * 0.99))]
        print(f"{name:<28}{rate:>8.1f}{statistics.median(times) * 1e3:>13.1f}"
              f"{p99 * 1e3:>9.1f}{rate / base:>13.3f}")  # fmt: skip
    fresh = {**SCHEMA, "title": f"t{time.time_ns()}"}
    for label in ("first compile", "cached"):
        start = time.perf_counter()
        engine.grammars.matcher(StructuredOutputsParams(json=fresh))
        print(f"schema {label}: {(time.perf_counter() - start) * 1e3:.2f} ms")
    return 0


def _run(
    engine: LLMEngine, batch: int, tokens: int, so: StructuredOutputsParams | None
) -> tuple[int, list[float], float]:
    params = SamplingParams(
        temperature=0, max_tokens=tokens, min_tokens=tokens, structured_outputs=so
    )
    for i in range(batch):
        engine.add_request(PROMPTS[i % len(PROMPTS)], params)
    steps, made = [], 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        made += len(engine.step())
        steps.append(time.perf_counter() - t)
    # Decode steps only: the first (prefill) is the same work in every case.
    return made, steps[1:], time.perf_counter() - start


@contextmanager
def _masks_overlapped(overlap: bool) -> Iterator[None]:
    """Off: the model runner starts no masks, so sample_requests computes them after the
    forward pass."""
    if overlap:
        yield
        return
    original = Sampler.start_masks
    Sampler.start_masks = lambda self, reqs: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        Sampler.start_masks = original  # type: ignore[method-assign]


if __name__ == "__main__":
    raise SystemExit(main())
