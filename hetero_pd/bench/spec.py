"""`hetero-pd bench spec`: speculative decoding (ngram or draft_model) against plain
decoding, side by side.

Two engines of one model in this process, one plain and one with `speculative_config`,
run the same requests, `--concurrency` at a time, the two engines taking turns group by
group (so background load drifts fall on both alike), on these workloads:

- copy-heavy: chat prompts that ask to repeat or lightly edit a paragraph given in the
  prompt, where prompt lookup finds most of the output;
- random: random token prompts (`bench serve`'s random dataset), generating past EOS,
  greedy (`random`) and sampled at temperature 1 with a seed per request (`random-t1`).

Per workload and engine: output tok/s (output tokens over wall time), TPOT p50/p99 (per
request, (last token - first token) / (tokens - 1)), and for the speculative engine the
mean acceptance length (1 + accepted / drafts) and the acceptance rate; then the ratios
spec / plain, and whether the two engines' outputs were identical token for token.

`--method draft_model` proposes with a draft model (`--draft DIR`, else the model's first
`--draft-layers` layers with its final norm and lm_head, built into a temporary folder),
and each speculative engine's step time is split into proposing (the draft's passes) and
the rest (verification: the target's forward pass over 1 + k tokens, sampling, scheduling).
`--worst-case` adds a third engine whose draft is a random model of the vocabulary: its
proposals are wrong, so that row is what rejected proposals cost (until the per-request
back-off stops them), beside the same plain runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hetero_pd import envs
from hetero_pd.bench.datasets import TokenizerText, random_requests
from hetero_pd.bench.machine import cpu_info
from hetero_pd.llm import LLM, chat_prompt_ids
from hetero_pd.models.draft_models import save_early_exit, save_random_draft
from hetero_pd.models.fetch import DEFAULT_MODEL, resolve_model
from hetero_pd.sampling_params import SamplingParams

PARAGRAPHS = (
    "The river town wakes early. Fishermen check their nets at the harbour, the baker "
    "opens his shutters on the square, and the first bus leaves for the city at six.",
    "To reset the router, unplug it for ten seconds, plug it back in, wait until the "
    "status light turns green, then connect to the network named on the label.",
    "Our meeting on Thursday moves to room 4B at half past two. Please bring the budget "
    "figures for the third quarter and the draft of the hiring plan.",
    "Water the tomatoes every morning, feed them once a week, and pinch out the side "
    "shoots so that the plant puts its strength into the fruit.",
)
ASKS = (
    "Repeat this text exactly, word for word:\n\n{}",
    "Rewrite this text with every sentence in the past tense, changing nothing else:\n\n{}",
)


@dataclass(slots=True)
class Side:
    name: str
    llm: LLM
    elapsed_s: float = 0.0
    tokens: int = 0
    tpots: list[float] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)
    steps: int = 0

    def reset(self) -> None:
        self.elapsed_s, self.tokens, self.tpots, self.outputs, self.steps = 0.0, 0, [], [], 0


def copy_prompts(llm: LLM, n: int) -> list[list[int]]:
    tok = llm.tokenizer
    texts = [ASKS[i % len(ASKS)].format(PARAGRAPHS[i % len(PARAGRAPHS)]) for i in range(n)]
    return [chat_prompt_ids(tok, [{"role": "user", "content": t}]) for t in texts]


def run_batch(
    side: Side, group: list[list[int]], max_tokens: int, temperature: float, seed: int = 0
) -> None:
    """Runs the prompts together through the side's engine (sampled ones seeded from
    `seed` on, so both engines give the same tokens)."""
    engine = side.llm.engine
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    ids = [f"{side.name}-{time.monotonic_ns()}-{i}" for i in range(len(group))]
    t0 = time.perf_counter()
    for i, (rid, prompt) in enumerate(zip(ids, group, strict=True)):
        params = SamplingParams(
            temperature=temperature, seed=seed + i, max_tokens=max_tokens, ignore_eos=True
        )
        engine.add_request(prompt, params, rid)
    outs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        side.steps += 1
        for out in engine.step():
            now = time.perf_counter()
            first.setdefault(out.request_id, now)
            last[out.request_id] = now
            outs[out.request_id] = out.outputs[0].token_ids
    side.elapsed_s += time.perf_counter() - t0
    for rid in ids:
        n = len(outs[rid])
        side.tokens += n
        side.outputs.append(outs[rid])
        if n > 1:
            side.tpots.append((last[rid] - first[rid]) / (n - 1))


def _pct(values: list[float], q: int) -> float:
    if len(values) < 2:
        return values[0] if values else 0.0
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def summary(side: Side) -> dict[str, Any]:
    return {
        "output_tok_s": round(side.tokens / side.elapsed_s, 2),
        "tpot_p50_ms": round(_pct(side.tpots, 50) * 1e3, 2),
        "tpot_p99_ms": round(_pct(side.tpots, 99) * 1e3, 2),
        "step_ms": round(side.elapsed_s / max(side.steps, 1) * 1e3, 2),
    }


def _counts(side: Side) -> tuple[int, int, int, float]:
    speculator = side.llm.engine.speculator
    assert speculator is not None
    s = speculator.stats
    return s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens, s.propose_s


def spec_summary(
    plain: dict[str, Any], side: Side, before: tuple[int, int, int, float]
) -> dict[str, Any]:
    """A speculative side's numbers since `before` (its counts then), with its ratios."""
    drafts, proposed, accepted, propose_s = (
        a - b for a, b in zip(_counts(side), before, strict=True)
    )
    b = summary(side)
    propose_ms = propose_s / max(side.steps, 1) * 1e3
    return {
        **b,
        "drafts": drafts,
        "draft_tokens": proposed,
        "mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else 1.0,
        "acceptance_rate": round(accepted / proposed, 3) if proposed else 0.0,
        # a step's time: proposing, then the rest (verification, sampling, scheduling)
        "propose_ms_per_step": round(propose_ms, 2),
        "verify_ms_per_step": round(b["step_ms"] - propose_ms, 2),
        "tok_s_ratio": round(b["output_tok_s"] / plain["output_tok_s"], 3),
        "tpot_p50_ratio": round(b["tpot_p50_ms"] / plain["tpot_p50_ms"], 3),
    }


def run_workload(
    plain: Side,
    specs: list[Side],
    prompts: list[list[int]],
    temperature: float,
    args: argparse.Namespace,
) -> dict[str, Any]:
    before = [_counts(side) for side in specs]
    step = args.concurrency
    for _ in range(args.rounds):  # side by side group by group: load drifts hit both alike
        for start in range(0, len(prompts), step):
            for side in (plain, *specs):
                group = prompts[start : start + step]
                run_batch(side, group, args.max_tokens, temperature, start)
    a = summary(plain)
    rows = [spec_summary(a, side, b) for side, b in zip(specs, before, strict=True)]
    result = {
        "plain": a,
        "spec": rows[0],
        "tok_s_ratio": rows[0]["tok_s_ratio"],
        "tpot_p50_ratio": rows[0]["tpot_p50_ratio"],
        "identical_outputs": all(plain.outputs == side.outputs for side in specs),
    }
    if len(rows) > 1:
        result["worst"] = rows[1]
    return result


def spec_configs(args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    """The speculative engines' configs: the method's, then the worst case's if asked."""
    k = args.num_speculative_tokens
    if args.method == "ngram":
        main: dict[str, Any] = {
            "method": "ngram",
            "num_speculative_tokens": k,
            "prompt_lookup_min": args.prompt_lookup_min,
            "prompt_lookup_max": args.prompt_lookup_max,
        }
    else:
        draft = args.draft or str(
            save_early_exit(resolve_model(args.model), work / "early-exit", args.draft_layers)
        )
        main = {"method": "draft_model", "model": draft, "num_speculative_tokens": k}
    configs = [main]
    if args.worst_case:
        random = save_random_draft(resolve_model(args.model), work / "random-draft")
        configs.append({"method": "draft_model", "model": str(random), "num_speculative_tokens": k})
    return configs


def _line(name: str, label: str, r: dict[str, Any], plain: dict[str, Any]) -> str:
    line = (
        f"{name:9s} {label:5s} plain {plain['output_tok_s']:7.1f} tok/s  spec "
        f"{r['output_tok_s']:7.1f} tok/s  ratio {r['tok_s_ratio']:.3f}  "
        f"TPOT p50 {plain['tpot_p50_ms']:.1f} -> {r['tpot_p50_ms']:.1f} ms  "
        f"p99 {plain['tpot_p99_ms']:.1f} -> {r['tpot_p99_ms']:.1f} ms  "
        f"acceptance length {r['mean_acceptance_length']:.2f}  "
        f"step {plain['step_ms']:.1f} -> {r['step_ms']:.1f} ms "
        f"(propose {r['propose_ms_per_step']:.1f} + verify {r['verify_ms_per_step']:.1f})"
    )
    return line


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hetero-pd bench spec", description=__doc__)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-cache-gb", type=float, default=1.0, help="each engine's KV cache, GiB")
    ap.add_argument("--num-prompts", type=int, default=4, help="per workload")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--random-input-len", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=1, help="requests decoding together")
    ap.add_argument("--rounds", type=int, default=2, help="alternating plain/spec runs")
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--prompt-lookup-min", type=int, default=2)
    ap.add_argument("--prompt-lookup-max", type=int, default=5)
    ap.add_argument("--workloads", default="copy,random,random-t1")
    ap.add_argument("--method", choices=("ngram", "draft_model"), default="ngram")
    ap.add_argument("--draft", default=None, help="draft_model: the draft's folder")
    ap.add_argument(
        "--draft-layers", type=int, default=4, help="draft_model without --draft: early exit"
    )
    ap.add_argument(
        "--worst-case", action="store_true", help="also a random draft (proposals wrong)"
    )
    args = ap.parse_args(argv)
    os.environ[envs.ADAPTIVE_THREADS] = "0"  # both engines at one thread count
    common = {"dtype": args.dtype, "num_threads": args.threads, "kv_cache_gb": args.kv_cache_gb}
    with tempfile.TemporaryDirectory(prefix="bench-spec-") as work:
        configs = spec_configs(args, Path(work))
        plain = Side("plain", LLM(args.model, **common))
        specs = [
            Side(name, LLM(args.model, speculative_config=cfg, **common))
            for name, cfg in zip(("spec", "worst"), configs, strict=False)
        ]
    for side in (plain, *specs):
        run_batch(side, copy_prompts(side.llm, 1), 8, 0.0)  # warm-up, not counted

    def random_prompts() -> list[list[int]]:
        source = TokenizerText(plain.llm.engine.model_path)
        reqs = random_requests(args.num_prompts, args.random_input_len, args.max_tokens, source)
        return [plain.llm.engine.tokenize(r.prompt) for r in reqs]

    # (prompts, temperature): random-t1 samples at temperature 1, where proposals are
    # rarely accepted (greedy output of a random prompt falls into loops that they match)
    workloads = {
        "copy": (lambda: copy_prompts(plain.llm, args.num_prompts), 0.0),
        "random": (random_prompts, 0.0),
        "random-t1": (random_prompts, 1.0),
    }
    results: dict[str, Any] = {}
    for name in args.workloads.split(","):
        for side in (plain, *specs):
            side.reset()
        make, temperature = workloads[name]
        results[name] = r = run_workload(plain, specs, make(), temperature, args)
        print(_line(name, "spec", r["spec"], r["plain"]))
        if "worst" in r:
            print(_line(name, "worst", r["worst"], r["plain"]))
        print(f"{name:9s} outputs identical: {r['identical_outputs']}")
    config = dict(vars(args))
    print(json.dumps({"config": config, "results": results, "cpu": cpu_info()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
