"""Per-worker speeds for the P/D plan: a short calibration of the real model on the device,
or an estimate from the device's capability profile and the model's cost per token.

Calibration (a few seconds on a CPU with the default model) loads the engine once, then
times one prefill of `prompt_tokens` tokens and a few decode steps at batch 1 and at
`batch`; the two decode points give the step time and its growth per sequence.

The estimate (`--no-calibrate`) divides the model's FLOPs per token by the measured
GFLOP/s (prefill, compute-bound) and its weight bytes by the measured GB/s (decode,
bandwidth-bound), each scaled by an efficiency a real engine reaches on such kernels.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from hetero_pd.deploy.ratio import WorkerSpeed
from hetero_pd.models.config import ModelConfig

#: Share of the matmul probe's GFLOP/s (and of the copy probe's GB/s) a whole model reaches.
FLOPS_EFFICIENCY = 0.6
BANDWIDTH_EFFICIENCY = 0.6
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True, slots=True)
class ModelCosts:
    """What one token costs a Llama-family model: matmul FLOPs and bytes read."""

    flops_per_token: float
    weight_bytes: float
    kv_bytes_per_token: float

    @classmethod
    def of(cls, cfg: ModelConfig, dtype: str) -> ModelCosts:
        h, hd = cfg.hidden_size, cfg.head_dim
        attn = h * (cfg.num_heads * hd + 2 * cfg.num_kv_heads * hd) + cfg.num_heads * hd * h
        mlp = 3 * h * cfg.intermediate_size
        matmul_params = cfg.num_layers * (attn + mlp) + cfg.vocab_size * h  # + lm_head
        size = DTYPE_BYTES.get(dtype, 4)
        return cls(
            flops_per_token=2.0 * matmul_params,
            weight_bytes=float(matmul_params * size),
            kv_bytes_per_token=float(cfg.kv_bytes_per_token * size),
        )


def profile_speed(device: str, costs: ModelCosts, context_tokens: int) -> WorkerSpeed:
    """An estimate from `device`'s capability profile (it must exist on this host)."""
    from backends import backend_for, parse_device

    dev = parse_device(device)
    prof = backend_for(dev).profile(dev)
    flops = prof.prefill_score() * 1e9 * FLOPS_EFFICIENCY
    bw = prof.decode_score() * 1e9 * BANDWIDTH_EFFICIENCY
    per_seq_s = costs.flops_per_token / flops + context_tokens * costs.kv_bytes_per_token / bw
    return WorkerSpeed(
        device=str(dev),
        prefill_tokens_per_s=flops / costs.flops_per_token,
        decode_step_ms=(costs.weight_bytes / bw + per_seq_s) * 1e3,
        decode_ms_per_seq=per_seq_s * 1e3,
        source=f"profile: {prof.prefill_score():.0f} GFLOP/s, {prof.decode_score():.1f} GB/s",
    )


def calibrate(
    model: str,
    device: str,
    dtype: str = "float32",
    prompt_tokens: int = 96,
    batch: int = 4,
    steps: int = 3,
    num_threads: int | None = None,
) -> WorkerSpeed:
    """Times the real model on `device`: one prefill and a few decode steps."""
    from hetero_pd.config import EngineConfig
    from hetero_pd.engine.llm_engine import LLMEngine
    from hetero_pd.sampling_params import SamplingParams

    started = time.perf_counter()
    cfg = EngineConfig(
        model=model,
        device=device,
        dtype=dtype,
        max_num_seqs=batch,
        max_num_batched_tokens=max(prompt_tokens, 8 * batch),
        max_model_len=prompt_tokens + steps + 16,
        num_kv_blocks=batch * 2 + prompt_tokens // 16 + 8,
        enable_prefix_caching=False,
        num_threads=num_threads,
    )
    engine = LLMEngine(cfg)
    vocab = engine.model_config.vocab_size
    ids = [(7919 * i + 13) % vocab for i in range(prompt_tokens)]
    n = iter(range(1_000_000))

    def add(prompt: list[int], max_tokens: int) -> None:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        engine.add_request(prompt, params, f"calibrate-{next(n)}")

    def timed_step() -> float:
        t0 = time.perf_counter()
        engine.step()
        return time.perf_counter() - t0

    add(ids[:16], 2)  # warm-up: first-call allocations, kernels
    while engine.has_unfinished_requests():
        engine.step()
    prefill_s = []
    for _ in range(2):
        add(ids, 1)
        prefill_s.append(timed_step())
        while engine.has_unfinished_requests():
            engine.step()

    def decode_step_s(b: int) -> float:
        for j in range(b):
            add(ids[j : j + 8], steps + 1)
        engine.step()  # their prefills
        times = [timed_step() for _ in range(steps)]
        while engine.has_unfinished_requests():
            engine.step()
        return statistics.median(times)

    one, many = decode_step_s(1), decode_step_s(batch)
    per_seq = max(0.0, (many - one) / (batch - 1))
    took = time.perf_counter() - started
    return WorkerSpeed(
        device=str(engine.device),
        prefill_tokens_per_s=prompt_tokens / min(prefill_s),
        decode_step_ms=one * 1e3,
        decode_ms_per_seq=per_seq * 1e3,
        source=f"calibrated in {took:.1f} s: prefill {prompt_tokens} tokens, "
        f"{steps} decode steps at batch 1 and {batch}",
    )
