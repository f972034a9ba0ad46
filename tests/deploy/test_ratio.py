"""The automatic P/D ratio on synthetic speeds: the counts, the reasoning, the edge cases."""

from __future__ import annotations

import pytest

from hetero_pd.deploy.ratio import RHO_CEILING, WorkerSpeed, plan_workers
from hetero_pd.deploy.sections import WorkloadSpec

WORKLOAD = WorkloadSpec(input_len=512, output_len=128, rate=4.0, ttft_ms=2000.0, tpot_ms=100.0)
PREFILL = WorkerSpeed("npu:0", 1024.0, 20.0, 2.0, "declared")
DECODE = WorkerSpeed("cuda:0", 4096.0, 20.0, 2.0, "declared")


def _ttft_ms(workload: WorkloadSpec, speed: WorkerSpeed, workers: int) -> float:
    """Mean TTFT of M/D/1 queues: service plus mean wait."""
    s = workload.input_len / speed.prefill_tokens_per_s
    rho = workload.rate * s / workers
    return float("inf") if rho >= 1 else (s + rho * s / (2 * (1 - rho))) * 1e3


def test_counts_worked_out_by_hand() -> None:
    # s_p = 512/1024 = 0.5 s; k = (2 - 0.5)/0.5 = 3; rho_max = 6/7; P = ceil(2 / 0.857) = 3.
    # step(b) = 20 + 2(b-1) <= 100 -> b_max = 41; N = 4 * 128 * 0.1 = 51.2; D = ceil(51.2/41).
    plan = plan_workers(WORKLOAD, PREFILL, DECODE, max_batch=64)
    assert (plan.prefill, plan.decode) == (3, 2)
    assert plan.ratio == "3:2"
    assert not plan.warnings
    text = plan.explain()
    assert text.startswith("plan: 3 prefill + 2 decode workers (P:D = 3:2)")
    for fragment in (
        "s_p = 512 / 1024 = 500.0 ms",
        "ρ_max = 2k/(1+2k) = 0.857",
        "P = ceil(",
        "b_max = 41",
        "N = λ",
        "= 51.20",
        "D = ceil(51.20 / 41) = 2",
    ):
        assert fragment in text, fragment


@pytest.mark.parametrize("rate", [0.5, 1.0, 2.0, 4.0, 7.0, 13.0])
def test_prefill_count_is_the_smallest_that_meets_ttft(rate: float) -> None:
    workload = WorkloadSpec(512, 128, rate, 2000.0, 100.0)
    plan = plan_workers(workload, PREFILL, DECODE, max_batch=64)
    assert _ttft_ms(workload, PREFILL, plan.prefill) <= workload.ttft_ms + 1e-6
    if plan.prefill > 1:
        assert _ttft_ms(workload, PREFILL, plan.prefill - 1) > workload.ttft_ms


@pytest.mark.parametrize("rate", [0.5, 2.0, 8.0, 32.0])
def test_decode_batches_stay_within_tpot(rate: float) -> None:
    workload = WorkloadSpec(512, 128, rate, 2000.0, 100.0)
    plan = plan_workers(workload, PREFILL, DECODE, max_batch=64)
    concurrent = rate * 128 * 0.1  # step(b_max) = 100 ms here
    per_worker = concurrent / plan.decode
    assert DECODE.step_ms(max(1, round(per_worker))) <= workload.tpot_ms + 1e-6
    assert (plan.decode - 1) * 41 < concurrent or plan.decode == 1


def test_more_traffic_never_needs_fewer_workers() -> None:
    counts = [
        plan_workers(WorkloadSpec(512, 128, r, 2000.0, 100.0), PREFILL, DECODE, 64)
        for r in (1, 2, 4, 8, 16)
    ]
    assert [p.prefill for p in counts] == sorted(p.prefill for p in counts)
    assert [p.decode for p in counts] == sorted(p.decode for p in counts)


def test_faster_prefill_device_shifts_the_ratio_towards_decode() -> None:
    fast = WorkerSpeed("npu:0", 8192.0, 20.0, 2.0, "declared")
    slow_plan = plan_workers(WORKLOAD, PREFILL, DECODE, 64)
    fast_plan = plan_workers(WORKLOAD, fast, DECODE, 64)
    assert fast_plan.prefill < slow_plan.prefill
    assert fast_plan.decode == slow_plan.decode


def test_engine_batch_limit_caps_the_decode_batch() -> None:
    plan = plan_workers(WORKLOAD, PREFILL, DECODE, max_batch=8)
    # b_max = 8: step(8) = 34 ms; N = 4 * 128 * 0.034 = 17.4 -> D = ceil(17.4 / 8) = 3.
    assert plan.decode == 3
    assert "b_max = 8 (engine max_num_seqs 8)" in plan.explain()


def test_low_load_is_capped_at_the_rho_ceiling() -> None:
    workload = WorkloadSpec(64, 16, 0.1, 60_000.0, 100.0)
    plan = plan_workers(workload, PREFILL, DECODE, 64)
    assert (plan.prefill, plan.decode) == (1, 1)
    assert f"capped at {RHO_CEILING}" in plan.explain()


def test_unreachable_targets_are_warned_about_not_hidden() -> None:
    slow = WorkerSpeed("cpu", 100.0, 150.0, 10.0, "calibrated")
    plan = plan_workers(WORKLOAD, slow, slow, 64)
    text = plan.explain()
    assert "one prefill alone takes 5120 ms ≥ TTFT target 2000 ms" in text
    assert "a decode step at batch 1 takes 150.0 ms > TPOT target 100 ms" in text
    # Still sized for throughput: 4 req/s x 5.12 s at rho 0.5 -> 41 prefill workers.
    assert plan.prefill == 41


def test_max_instances_caps_the_total_keeping_the_proportion() -> None:
    heavy = WorkloadSpec(512, 128, 40.0, 2000.0, 100.0)
    free = plan_workers(heavy, PREFILL, DECODE, 64)
    capped = plan_workers(heavy, PREFILL, DECODE, 64, max_instances=8)
    assert free.prefill + free.decode > 8
    assert capped.prefill + capped.decode == 8
    assert capped.prefill >= 1 and capped.decode >= 1
    assert "exceeds max_instances 8" in capped.explain()
