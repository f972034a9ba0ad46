"""Per-worker speeds for the P/D plan: a short calibration of the real model on the device,
or an estimate from the device's capability profile and the model's cost per token.

Calibration (a few seconds on a CPU with the default model) loads the engine once, then
times `prefill_runs` prefills of `prompt_tokens` tokens and `steps` decode steps at batch 1
and at `batch`; the two decode points give the step time and its growth per sequence. Each
number is a median, and a measure whose runs spread by more than MAX_SPREAD (slowest over
fastest, the single slowest run dropped) is noted: the host was busy. `check_agreement`
then compares the result with the capability profile's estimate and refuses a calibration
that disagrees with it by more than PROFILE_DISAGREEMENT times (one of them is wrong: a
busy or throttled host, or a bad probe), where the model is large enough for the estimate
to mean something.

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
#: Slowest over fastest run of one measure (the single slowest dropped) beyond which the
#: calibration is noted as noisy.
MAX_SPREAD = 1.5
#: Calibration and profile estimate further apart than this are refused.
PROFILE_DISAGREEMENT = 5.0
#: Below this much estimated work per measured unit, fixed per-step overheads (Python,
#: kernel launches) dominate and the profile estimate says nothing: no comparison.
COMPARABLE_S = 0.02


class CalibrationError(ValueError):
    """A calibration that cannot be trusted; the message says why and what to do."""


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


def spread(samples: list[float]) -> float:
    """Slowest over fastest run, the single slowest dropped when there are four or more (one
    outlier, e.g. a garbage collection, is not noise)."""
    ordered = sorted(samples)
    kept = ordered[:-1] if len(ordered) >= 4 else ordered
    return kept[-1] / kept[0] if kept[0] > 0 else float("inf")


def noise_notes(measures: dict[str, list[float]]) -> list[str]:
    """A note for each measure (name -> run times in seconds) spread beyond MAX_SPREAD."""
    notes = []
    for name, samples in measures.items():
        if (sp := spread(samples)) > MAX_SPREAD:
            notes.append(
                f"calibration: {name} took {min(samples) * 1e3:.1f}..{max(samples) * 1e3:.1f} ms "
                f"over {len(samples)} runs (spread x{sp:.1f} > x{MAX_SPREAD}): the host is busy, "
                "so these speeds may be off; calibrate on an idle host or declare pd.capacity"
            )
    return notes


def calibrate(
    model: str,
    device: str,
    dtype: str = "float32",
    prompt_tokens: int = 96,
    batch: int = 4,
    steps: int = 5,
    num_threads: int | None = None,
    prefill_runs: int = 3,
) -> WorkerSpeed:
    """Times the real model on `device`: several prefills and decode steps (medians)."""
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

    def drain() -> None:
        while engine.has_unfinished_requests():
            engine.step()

    add(ids[:16], 2)  # warm-up: first-call allocations, kernels
    drain()
    prefill_s = []
    for _ in range(prefill_runs):
        add(ids, 1)
        prefill_s.append(timed_step())
        drain()

    def decode_steps(b: int) -> list[float]:
        for j in range(b):
            add(ids[j : j + 8], steps + 1)
        engine.step()  # their prefills
        times = [timed_step() for _ in range(steps)]
        drain()
        return times

    one, many = decode_steps(1), decode_steps(batch)
    notes = noise_notes(
        {
            f"prefill of {prompt_tokens} tokens": prefill_s,
            "decode step at batch 1": one,
            f"decode step at batch {batch}": many,
        }
    )
    step_one, step_many = statistics.median(one), statistics.median(many)
    per_seq = max(0.0, (step_many - step_one) / (batch - 1))
    took = time.perf_counter() - started
    return WorkerSpeed(
        device=str(engine.device),
        prefill_tokens_per_s=prompt_tokens / statistics.median(prefill_s),
        decode_step_ms=step_one * 1e3,
        decode_ms_per_seq=per_seq * 1e3,
        source=f"calibrated in {took:.1f} s: medians of {prefill_runs} prefills of "
        f"{prompt_tokens} tokens and {steps} decode steps at batch 1 and {batch}",
        notes=tuple(notes),
    )


def check_agreement(
    calibrated: WorkerSpeed, estimate: WorkerSpeed, prompt_tokens: int = 96
) -> list[str]:
    """Raises CalibrationError when calibration and profile estimate disagree by more than
    PROFILE_DISAGREEMENT times; returns what was compared (or why not)."""
    checks = [
        (
            "prefill",
            prompt_tokens / estimate.prefill_tokens_per_s,
            calibrated.prefill_tokens_per_s,
            estimate.prefill_tokens_per_s,
            "tokens/s",
        ),
        (
            "decode step",
            estimate.decode_step_ms / 1e3,
            calibrated.decode_step_ms,
            estimate.decode_step_ms,
            "ms",
        ),
    ]
    done = []
    for name, work_s, got, want, unit in checks:
        if work_s < COMPARABLE_S:
            done.append(f"{name}: model too small to compare with the profile")
            continue
        ratio = max(got, want) / min(got, want)
        if ratio > PROFILE_DISAGREEMENT:
            raise CalibrationError(
                f"{calibrated.device}: calibrated {name} {got:.1f} {unit} but the capability "
                f"profile predicts {want:.1f} {unit} ({estimate.source}): they disagree "
                f"{ratio:.0f}x (more than {PROFILE_DISAGREEMENT:g}x), so neither is trusted. "
                "A busy or throttled host slows calibration; check `hetero-pd devices --full` "
                "and rerun on an idle host, or declare pd.capacity (or plan with --no-calibrate)"
            )
        done.append(f"{name}: within {ratio:.1f}x of the profile")
    return done
