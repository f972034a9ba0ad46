"""`hetero-pd bench profile`: where a prefill step and a decode step spend their time, in
float32 and bfloat16 side by side, against the machine's GEMM rate in each dtype.

For each dtype, one engine of the model (thread count fixed, no thread governor):

1. the GEMM rate: the model's own projections (every layer's linears, a distinct weight
   each; the LM head too at the decode batch, where it runs on every row) at the prefill
   token count and at the decode batch, `F.linear` and oneDNN's packed linear, median of
   `--repeats` (profile_ops.gemm_rate; the faster way is the rate);
2. one prefill step (`--prompts` prompts of `--prompt-len` tokens, all in one step) and
   `--decode-steps` decode steps (`--batch` requests at `--context` tokens), each timed
   unprofiled after a warm-up, then profiled with torch.profiler: the self CPU time of
   every op grouped into categories (profile_ops), the wall time no op accounts for as
   Python and scheduling overhead;
3. the achieved model FLOP/s (2 x weights x tokens + attention) of the unprofiled step and
   its share of the GEMM rate at that shape, the "roofline share".

The last stdout line is one JSON object: per dtype and step, the shares, FLOP/s and
roofline share; and the machine.

    hetero-pd bench profile [--prompts 8] [--prompt-len 256] [--batch 32] [--context 300]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.autograd.profiler import record_function
from torch.profiler import ProfilerActivity, profile

from hetero_pd import LLM, SamplingParams, envs
from hetero_pd.bench import profile_ops
from hetero_pd.bench.machine import cpu_info
from hetero_pd.engine import model_runner
from hetero_pd.models.fetch import DEFAULT_MODEL, resolve_model


@contextlib.contextmanager
def sampling_scope() -> Iterator[None]:
    """Runs the engine's sampler inside a profiler scope (profile_ops.SAMPLING_SCOPE)."""
    inner = model_runner.sample_runs

    def scoped(*a: Any, **kw: Any) -> Any:
        with record_function(profile_ops.SAMPLING_SCOPE):
            return inner(*a, **kw)

    model_runner.sample_runs = scoped
    try:
        yield
    finally:
        model_runner.sample_runs = inner


class Prompts:
    """Random prompts of the model's vocabulary, new ids each time (no prefix cache hits)."""

    def __init__(self, llm: LLM) -> None:
        self.llm, self.gen, self.n = llm, torch.Generator().manual_seed(0), 0
        self.vocab = llm.engine.model_config.vocab_size

    def add(self, count: int, length: int, max_tokens: int) -> None:
        params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=max_tokens)
        for _ in range(count):
            low = min(100, self.vocab // 2)
            ids = torch.randint(low, self.vocab, (length,), generator=self.gen)
            self.llm.engine.add_request(ids.tolist(), params, request_id=f"p{self.n}")
            self.n += 1


def _drain(llm: LLM) -> None:
    while llm.engine.has_unfinished_requests():
        llm.engine.step()


def measure(run: Callable[[], None], steps: int) -> dict[str, Any]:
    """Unprofiled seconds per step of `run` (which runs `steps` steps), then a profiled run's
    seconds per category per step."""
    t0 = time.perf_counter()
    run()
    wall = (time.perf_counter() - t0) / steps
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        run()
        profiled = time.perf_counter() - t0
    secs, by_name = profile_ops.breakdown(prof.events(), profiled)
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:8]
    return {
        "wall_s": wall,
        "profiled_s": profiled / steps,
        "secs": secs,
        "top_ops": {name: round(s / profiled, 4) for name, s in top},
    }


def profile_dtype(dtype: str, args: argparse.Namespace) -> dict[str, Any]:
    """One engine of `dtype`: its GEMM rates, a profiled prefill step and decode steps."""
    tokens = args.prompts * args.prompt_len
    decode_ctx = args.context + 3 * args.decode_steps + 4
    blocks = -(-tokens // 16) + args.prompts + args.batch * -(-decode_ctx // 16) + 16
    llm = LLM(
        args.model,
        dtype=dtype,
        compile=args.compile,
        num_threads=args.threads,
        num_kv_blocks=blocks,
        max_num_batched_tokens=max(tokens, args.context),
        max_num_seqs=max(args.batch, args.prompts),
    )
    runner = llm.engine.runner
    torch_dtype = next(runner.model.parameters()).dtype
    cfg, shapes = runner.model.cfg, profile_ops.linear_shapes(runner.model)
    layers = [s for s in shapes if s[0] != "lm_head"]
    prompts = Prompts(llm)
    out: dict[str, Any] = {"dtype": str(torch_dtype).removeprefix("torch.")}
    out["gemm_gflops"] = {
        # the LM head runs on the sampled rows only, not on every prompt token
        "prefill": profile_ops.gemm_rate(layers, tokens, torch_dtype, args.repeats),
        "decode": profile_ops.gemm_rate(shapes, args.batch, torch_dtype, args.repeats),
    }

    def prefill() -> None:  # all prompts in one step, one token each: done after it
        prompts.add(args.prompts, args.prompt_len, 1)
        if len(llm.engine.step()) < args.prompts:
            raise SystemExit("the prompts took more than one step: raise the token budget")
        _drain(llm)

    prefill()  # warm-up
    pre = measure(prefill, 1)
    pre_flops = profile_ops.step_flops(
        cfg, shapes, [(args.prompt_len, 0)] * args.prompts, args.prompts
    )
    prompts.add(args.batch, args.context, 10**6)
    seen: dict[str, int] = {}
    while len(seen) < args.batch or min(seen.values()) < 3:  # prefilled, then two decodes
        for o in llm.engine.step():
            seen[o.request_id] = seen.get(o.request_id, 0) + 1
    ctx = args.context + 3

    def decode() -> None:
        for _ in range(args.decode_steps):
            llm.engine.step()

    dec = measure(decode, args.decode_steps)
    # contexts grew by decode_steps during the unprofiled run: its middle step's context
    dec_flops = profile_ops.step_flops(
        cfg, shapes, [(1, ctx + args.decode_steps // 2)] * args.batch, args.batch
    )
    for name, m, flops, rows in (
        ("prefill", pre, pre_flops, tokens),
        ("decode", dec, dec_flops, args.batch),
    ):
        gemm = out["gemm_gflops"][name]["best"]
        achieved = flops / m["wall_s"] / 1e9
        out[name] = {
            "tokens": rows,
            "ms_per_step": round(m["wall_s"] * 1e3, 2),
            "profiled_ms_per_step": round(m["profiled_s"] * 1e3, 2),
            "shares": {k: round(v, 4) for k, v in profile_ops.shares(m["secs"]).items()},
            "model_gflop": round(flops / 1e9, 3),
            "achieved_gflops": round(achieved, 2),
            "gemm_gflops": round(gemm, 2),
            "roofline_share": round(achieved / gemm, 3),
            "top_ops": m["top_ops"],
        }
    out["compiled_steps"] = runner.compiled_steps
    for name in ("prefill", "decode"):
        out["gemm_gflops"][name] = {k: round(v, 2) for k, v in out["gemm_gflops"][name].items()}
    return out


def table(results: dict[str, dict[str, Any]]) -> None:
    dtypes = list(results)
    for step in ("prefill", "decode"):
        print(f"{step}: " + "  ".join(f"{d:>10s}" for d in dtypes))
        for key in ("ms_per_step", "achieved_gflops", "gemm_gflops", "roofline_share"):
            print(f"  {key:20s}" + "  ".join(f"{results[d][step][key]:10}" for d in dtypes))
        for cat in profile_ops.CATEGORIES:
            vals = "  ".join(f"{results[d][step]['shares'][cat]:10.3f}" for d in dtypes)
            print(f"  share {cat:14s}{vals}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hetero-pd bench profile", description=__doc__)
    ap.add_argument("--model", default=str(resolve_model(DEFAULT_MODEL)))
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--prompts", type=int, default=8, help="prompts prefilled in one step")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=32, help="decoding requests")
    ap.add_argument("--context", type=int, default=300, help="their prompt length")
    ap.add_argument("--decode-steps", type=int, default=4, help="decode steps per measurement")
    ap.add_argument("--repeats", type=int, default=5, help="GEMM timings per shape (median)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compile", default="auto", choices=("auto", "on", "off"))
    args = ap.parse_args(argv)
    os.environ[envs.ADAPTIVE_THREADS] = "0"  # one thread count for every dtype
    # inductor's fused loops appear in the profile by name (they count as elementwise)
    torch._inductor.config.cpp.enable_kernel_profile = True
    load = os.getloadavg()[0]
    results: dict[str, dict[str, Any]] = {}
    with sampling_scope():
        for dtype in args.dtypes.split(","):
            r = profile_dtype(dtype, args)
            results[r["dtype"]] = r
    table(results)
    result = {
        "prompts": args.prompts,
        "prompt_len": args.prompt_len,
        "batch": args.batch,
        "context": args.context,
        "threads": args.threads,
        "load_before_after": [round(load, 2), round(os.getloadavg()[0], 2)],
        "results": results,
        "cpu": cpu_info(),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
