"""The automatic P/D ratio: how many prefill and decode workers a workload needs.

Inputs are measured per-worker speeds (`WorkerSpeed`, from calibration, the capability
profile, or numbers declared in the file) and the declared workload: arrival rate λ,
input/output lengths and the TTFT/TPOT targets. Every step is printed with its numbers.

Prefill (one queue per worker, deterministic service, Poisson arrivals: M/D/1):
    s_p   = input_len / prefill_tokens_per_s            service time of one prompt
    wait  = ρ·s_p / (2(1-ρ))                            mean queueing delay at load ρ
    ρ_max = 2k / (1 + 2k),  k = (TTFT - s_p) / s_p      highest load with s_p + wait ≤ TTFT
    P     = ceil(λ·s_p / ρ_max)

Decode (continuous batching; one step advances every sequence in the batch):
    step(b) = decode_step_ms + (b-1)·decode_ms_per_seq  time of one step at batch b
    b_max   = largest b ≤ max_batch with step(b) ≤ TPOT
    N       = λ · output_len · step(b_max)               sequences decoding at once (Little)
    D       = ceil(N / b_max)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hetero_pd.deploy.sections import WorkloadSpec

#: Never plan a prefill queue above this load, whatever the TTFT slack says.
RHO_CEILING = 0.95


@dataclass(frozen=True, slots=True)
class WorkerSpeed:
    """What one worker on one device does per second, and where the numbers came from."""

    device: str
    prefill_tokens_per_s: float
    decode_step_ms: float  # one decode step at batch 1
    decode_ms_per_seq: float  # added per extra sequence in the batch
    source: str  # "calibrated" | "profile" | "declared"
    #: What makes these numbers less certain (e.g. calibration timings that varied).
    notes: tuple[str, ...] = ()

    def step_ms(self, batch: int) -> float:
        """Time of one decode step with `batch` sequences."""
        return self.decode_step_ms + (batch - 1) * self.decode_ms_per_seq


@dataclass(frozen=True, slots=True)
class Plan:
    """Worker counts and the reasoning that led to them."""

    prefill: int
    decode: int
    steps: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    #: Devices (tensor-parallel ranks) per prefill and per decode worker.
    ranks: tuple[int, int] = (1, 1)

    def devices(self, prefill_device: str, decode_device: str) -> dict[str, int]:
        """Devices the workers take, by kind (`cpu`: ranks, each on its own cores)."""
        out: dict[str, int] = {}
        for device, n, tp in (
            (prefill_device, self.prefill, self.ranks[0]),
            (decode_device, self.decode, self.ranks[1]),
        ):
            kind = device.split(":", 1)[0]
            out[kind] = out.get(kind, 0) + n * tp
        return out

    @property
    def ratio(self) -> str:
        """P:D in lowest terms, e.g. "1:3"."""
        g = math.gcd(self.prefill, self.decode)
        return f"{self.prefill // g}:{self.decode // g}"

    def explain(self) -> str:
        """The counts, then every step of the reasoning with its numbers, then warnings."""
        lines = [f"  {i}. {s}" for i, s in enumerate(self.steps, 1)]
        lines += [f"  warning: {w}" for w in self.warnings]
        head = f"plan: {self.prefill} prefill + {self.decode} decode workers (P:D = {self.ratio})"
        if self.ranks != (1, 1):
            tp_p, tp_d = self.ranks
            head += (
                f", {self.prefill} × {tp_p} + {self.decode} × {tp_d} = "
                f"{self.prefill * tp_p + self.decode * tp_d} devices (tensor-parallel ranks)"
            )
        return "\n".join([head, *lines])


def plan_workers(
    workload: WorkloadSpec,
    prefill: WorkerSpeed,
    decode: WorkerSpeed,
    max_batch: int,
    max_instances: int = 0,
) -> Plan:
    """Prefill and decode worker counts for `workload` (see the module docstring)."""
    steps: list[str] = []
    warnings: list[str] = []
    lam, ttft, tpot = workload.rate, workload.ttft_ms / 1e3, workload.tpot_ms
    steps.append(
        f"workload: λ = {lam:g} req/s, {workload.input_len} input + {workload.output_len} "
        f"output tokens, targets TTFT ≤ {workload.ttft_ms:g} ms, TPOT ≤ {tpot:g} ms"
    )
    s_p = workload.input_len / prefill.prefill_tokens_per_s
    steps.append(
        f"prefill on {prefill.device} ({prefill.source}): {prefill.prefill_tokens_per_s:.0f} "
        f"tokens/s → s_p = {workload.input_len} / {prefill.prefill_tokens_per_s:.0f} "
        f"= {s_p * 1e3:.1f} ms per prompt"
    )
    if s_p >= ttft:
        rho = 0.5
        warnings.append(
            f"one prefill alone takes {s_p * 1e3:.0f} ms ≥ TTFT target {workload.ttft_ms:g} ms: "
            "no number of workers meets it; sized for throughput at ρ = 0.5 instead"
        )
    else:
        k = (ttft - s_p) / s_p
        rho = min(RHO_CEILING, 2 * k / (1 + 2 * k))
        steps.append(
            f"TTFT slack k = (TTFT - s_p) / s_p = ({ttft * 1e3:.0f} - {s_p * 1e3:.1f}) / "
            f"{s_p * 1e3:.1f} = {k:.2f} → M/D/1 load limit ρ_max = 2k/(1+2k) = {rho:.3f}"
            + (f" (capped at {RHO_CEILING})" if rho == RHO_CEILING else "")
        )
    load_p = lam * s_p
    n_p = max(1, math.ceil(load_p / rho - 1e-9))
    steps.append(
        f"prefill load λ·s_p = {lam:g} × {s_p:.4f} s = {load_p:.3f} busy workers → "
        f"P = ceil({load_p:.3f} / {rho:.3f}) = {n_p}"
    )
    step1, per = decode.decode_step_ms, decode.decode_ms_per_seq
    steps.append(
        f"decode on {decode.device} ({decode.source}): step(b) = {step1:.2f} + (b-1) × {per:.3f} ms"
    )
    if step1 > tpot:
        b_max = 1
        warnings.append(
            f"a decode step at batch 1 takes {step1:.1f} ms > TPOT target {tpot:g} ms: "
            "the target cannot be met on this device; sized at batch 1"
        )
    else:
        b_max = max_batch if per <= 0 else min(max_batch, 1 + int((tpot - step1) / per))
        steps.append(
            f"largest batch with step(b) ≤ {tpot:g} ms: b_max = {b_max} "
            f"(engine max_num_seqs {max_batch}), step({b_max}) = {decode.step_ms(b_max):.2f} ms"
        )
    n_conc = lam * workload.output_len * decode.step_ms(b_max) / 1e3
    n_d = max(1, math.ceil(n_conc / b_max - 1e-9))
    steps.append(
        f"sequences decoding at once N = λ × output_len × step = {lam:g} × "
        f"{workload.output_len} × {decode.step_ms(b_max) / 1e3:.4f} s = {n_conc:.2f} → "
        f"D = ceil({n_conc:.2f} / {b_max}) = {n_d}"
    )
    if max_instances and n_p + n_d > max_instances:
        share = n_p / (n_p + n_d)
        capped_p = min(max_instances - 1, max(1, round(max_instances * share)))
        warnings.append(
            f"{n_p}P + {n_d}D exceeds max_instances {max_instances}: capped to "
            f"{capped_p}P + {max_instances - capped_p}D in the same proportion; "
            "the SLOs will not hold at the declared rate"
        )
        n_p, n_d = capped_p, max_instances - capped_p
    return Plan(n_p, n_d, steps, warnings)
