"""`hetero-pd bench decode-step`: the decode step of one model in float32 and bfloat16, with
the C decode-attention kernel on and off, side by side in one process.

Each of the four engines prefills the same `--batch` prompts of `--prompt-len` tokens, then
they take turns over `--rounds`: each times `--steps` decode steps (every request one token
per step) and the next engine goes. Contexts grow alike in every engine, so a round compares
like with like; the median per engine is printed, then the ratios (bf16 over float32, kernel
off over on). The thread count is fixed (no thread governor) so that all four run alike; the
last stdout line is one JSON object with the machine.

With `--torch-norm` a fifth engine runs bfloat16 with torch's RMSNorm instead of the C
kernel (backends/rms_norm.py), side by side with the others. With `--compiled-too` (the four
run eager) two more run float32 and bfloat16 with the kernel and the step compiled by inductor
(`compile: on`), and the ratios say what compiling gains over eager. `--dtypes float32` runs
the float32 engines only (ratios between absent engines are left out).

    hetero-pd bench decode-step [--batch 32] [--prompt-len 256] [--compile auto|on|off]
                                [--torch-norm] [--compiled-too] [--dtypes float32,bfloat16]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from hetero_pd import LLM, SamplingParams, envs
from hetero_pd.bench.machine import cpu_info
from hetero_pd.models.fetch import DEFAULT_MODEL, resolve_model

#: (name, dtype, kernel): the float32 kernel first, the baseline of every ratio.
CONFIGS = (
    ("float32+kernel", "float32", True),
    ("float32-kernel", "float32", False),
    ("bfloat16+kernel", "bfloat16", True),
    ("bfloat16-kernel", "bfloat16", False),
)
TORCH_NORM = "bfloat16+kernel,torch-norm"
#: (name, dtype, eager baseline) of `--compiled-too`'s engines
COMPILED = (
    ("float32+kernel,compiled", "float32", "float32+kernel"),
    ("bfloat16+kernel,compiled", "bfloat16", "bfloat16+kernel"),
)
#: (ratio, engine, baseline engine): printed where both ran
RATIOS = (
    ("bf16_over_fp32_kernel_on", "bfloat16+kernel", "float32+kernel"),
    ("bf16_over_fp32_kernel_off", "bfloat16-kernel", "float32-kernel"),
    ("fp32_off_over_on", "float32-kernel", "float32+kernel"),
    ("bf16_off_over_on", "bfloat16-kernel", "bfloat16+kernel"),
    ("bf16_torch_norm_over_c_norm", TORCH_NORM, "bfloat16+kernel"),
    *((f"{dtype}_compiled_over_eager", name, eager) for name, dtype, eager in COMPILED),
)


@dataclass(slots=True)
class Engine:
    name: str
    llm: LLM
    step_ms: list[float] = field(default_factory=list)


def start(
    name: str,
    dtype: str,
    kernel: bool,
    args: argparse.Namespace,
    norm: bool = True,
    compile: str | None = None,
) -> Engine:
    """An engine with every request prefilled and decoding (`norm`: the C RMSNorm kernel;
    `compile`: instead of `--compile`)."""
    os.environ[envs.NATIVE_ATTENTION] = "1" if kernel else "0"
    os.environ[envs.NATIVE_NORM] = "1" if norm else "0"
    blocks = args.batch * -(-(args.prompt_len + args.rounds * args.steps + 8) // 16)
    llm = LLM(
        args.model,
        dtype=dtype,
        compile=compile or args.compile,
        num_threads=args.threads,
        num_kv_blocks=blocks + 8,
        max_num_batched_tokens=max(2048, args.prompt_len),
    )
    if llm.engine.runner.native_decode != kernel:
        raise SystemExit(f"{name}: the decode kernel is not available here: nothing to compare")
    gen = torch.Generator().manual_seed(0)
    vocab = llm.engine.model_config.vocab_size
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=args.rounds * args.steps + 4)
    for i in range(args.batch):
        prompt = torch.randint(100, vocab, (args.prompt_len,), generator=gen).tolist()
        llm.engine.add_request(prompt, params, request_id=f"r{i}")
    tokens: dict[str, int] = {}
    while len(tokens) < args.batch or min(tokens.values()) < 2:  # prefilled, then one decode
        for out in llm.engine.step():
            tokens[out.request_id] = tokens.get(out.request_id, 0) + 1
    return Engine(name, llm)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hetero-pd bench decode-step", description=__doc__)
    ap.add_argument("--model", default=str(resolve_model(DEFAULT_MODEL)))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=8, help="decode steps per engine per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compile", default="auto", choices=("auto", "on", "off"))
    ap.add_argument(
        "--torch-norm",
        action="store_true",
        help=f"a fifth engine, {TORCH_NORM}: bf16 with the attention kernel and torch's RMSNorm "
        "(HETERO_PD_NATIVE_NORM=0), against bfloat16+kernel",
    )
    ap.add_argument(
        "--compiled-too",
        action="store_true",
        help="two more engines, float32 and bf16 with the kernel and the step compiled "
        "(compile: on), against the eager ones (needs the four eager: --compile off or auto "
        "where it means eager)",
    )
    ap.add_argument("--dtypes", default="float32,bfloat16", help="the engines' dtypes")
    args = ap.parse_args(argv)
    dtypes = set(args.dtypes.split(","))
    if not dtypes or dtypes - {"float32", "bfloat16"}:
        raise SystemExit(f"--dtypes: float32 and/or bfloat16, got {args.dtypes!r}")
    os.environ[envs.ADAPTIVE_THREADS] = "0"  # one thread count for all engines
    engines = [start(n, dtype, kernel, args) for n, dtype, kernel in CONFIGS if dtype in dtypes]
    if args.compiled_too and any(e.llm.engine.runner.compiled for e in engines):
        raise SystemExit("--compiled-too compares with eager engines: add --compile off")
    if args.torch_norm and "bfloat16" in dtypes:
        engines.append(start(TORCH_NORM, "bfloat16", True, args, norm=False))
    if args.compiled_too:
        extra = [(n, dtype) for n, dtype, _ in COMPILED if dtype in dtypes]
        engines += [start(n, dtype, True, args, compile="on") for n, dtype in extra]
    for _ in range(args.rounds):
        for e in engines:
            t0 = time.perf_counter()
            for _ in range(args.steps):
                e.llm.engine.step()
            e.step_ms.append((time.perf_counter() - t0) / args.steps * 1e3)
    ms = {e.name: statistics.median(e.step_ms) for e in engines}
    for e in engines:
        tok_s = args.batch / ms[e.name] * 1e3
        print(f"{e.name:24s} {ms[e.name]:8.1f} ms per step  ({tok_s:6.1f} tok/s)")
    ratios = {r: ms[a] / ms[b] for r, a, b in RATIOS if a in ms and b in ms}
    for name, r in ratios.items():
        print(f"{name:30s} {r:.3f}")
    compiled = {e.name: e.llm.engine.runner.compiled_steps for e in engines}
    result: dict[str, Any] = {
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "threads": args.threads,
        "compiled_steps": compiled,
        "ms_per_step": {k: round(v, 2) for k, v in ms.items()},
        "ratios": {k: round(v, 3) for k, v in ratios.items()},
        "cpu": cpu_info(),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
