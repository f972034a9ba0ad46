"""RMSNorm side by side: the C kernel (backends/rms_norm.py) against torch's ops (the
model's own formula), on one layer's norm at a decode batch and at a prefill step's rows,
and a whole bf16 prefill step of the default model with the kernel on and off. The ways
take turns (take_turns), so a load that changes weighs on both; ratios = torch / kernel.

    python scripts/bench_rms_norm.py [--threads 2] [--rounds 5] [--prompts 4]
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from backends import rms_norm
from hetero_pd import LLM, SamplingParams, envs
from hetero_pd.bench.machine import cpu_info, take_turns
from hetero_pd.models.fetch import DEFAULT_MODEL, resolve_model


def torch_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=4, help="prompts of 256 tokens per step")
    args = ap.parse_args()
    os.environ[envs.ADAPTIVE_THREADS] = "0"
    torch.set_num_threads(args.threads)
    assert rms_norm.available(torch.bfloat16, envs.compile_cache_dir() / "kernels")
    result: dict[str, float] = {}
    w = torch.randn(576).bfloat16()
    for rows, calls in ((32, 200), (2048, 10)):
        x = torch.randn(rows, 576).bfloat16()
        ways = {
            "kernel": lambda x=x: rms_norm.rms_norm(x, w, 1e-5),
            "torch": lambda x=x: torch_norm(x, w, 1e-5),
        }
        ms = take_turns(ways, args.rounds, calls)
        result[f"norm_{rows}_rows_torch_over_kernel"] = ms["torch"] / ms["kernel"]
        print(f"norm of {rows} x 576 bf16: kernel {ms['kernel']:.3f}, torch {ms['torch']:.3f} ms")
    engines = {}
    for name, on in (("kernel", "1"), ("torch", "0")):
        os.environ[envs.NATIVE_NORM] = on
        engines[name] = LLM(
            str(resolve_model(DEFAULT_MODEL)),
            dtype="bfloat16",
            compile="off",
            num_threads=args.threads,
            num_kv_blocks=args.prompts * 17 + 8,
            max_num_batched_tokens=args.prompts * 256,
        )
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=1)

    def prefill(llm: LLM) -> None:
        for _ in range(args.prompts):
            ids = torch.randint(100, 40000, (256,), generator=gen).tolist()
            llm.engine.add_request(ids, params)
        while llm.engine.has_unfinished_requests():
            llm.engine.step()

    for llm in engines.values():
        prefill(llm)  # warm-up
    steps = {n: (lambda llm=llm: prefill(llm)) for n, llm in engines.items()}
    ms = take_turns(steps, args.rounds, 1)
    result["prefill_step_torch_over_kernel"] = ms["torch"] / ms["kernel"]
    print(f"bf16 prefill {args.prompts} x 256: kernel {ms['kernel']:.0f}, torch {ms['torch']:.0f}")
    print(json.dumps({**{k: round(v, 3) for k, v in result.items()}, "cpu": cpu_info()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
