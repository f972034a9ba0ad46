"""The test-only `transfer.faults` setting: validated with the key named, and handed to
exactly the worker it names (through the worker's JSON config); its "step" rules delay
that worker's engine steps, counted as frames are."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from hetero_pd.deploy.launcher import worker_configs
from hetero_pd.deploy.schema import ConfigError, parse_deployment
from hetero_pd.serving.worker.config import WorkerConfig
from hetero_pd.serving.worker.step_faults import StepFaults
from transfer import FaultPlan, FaultRule


def raw(faults: Any) -> dict[str, Any]:
    return {
        "model": "m",
        "workers": [{"role": "prefill", "count": 2}, {"role": "decode"}],
        "transfer": {"faults": faults, "grant_s": 2.0, "remote_kv_timeout_s": 5.0},
    }


def test_faults_reach_only_the_named_worker() -> None:
    rule = {"kind": "corrupt", "msg_type": "data", "nth": 1, "count": 3}
    dep = parse_deployment(raw({"prefill-1": [rule]}))
    configs = {c.worker_id: WorkerConfig.from_json(c.to_json()) for c in worker_configs(dep)}
    assert set(configs) == {"prefill-0", "prefill-1", "decode-0"}
    faults = configs["prefill-1"].transfer.faults
    assert faults is not None and [dataclasses.asdict(r) for r in faults.rules] == [
        {**dataclasses.asdict(FaultRule("drop", "*")), **rule}
    ]
    assert configs["prefill-0"].transfer.faults is None is configs["decode-0"].transfer.faults
    assert {c.transfer.grant_s for c in configs.values()} == {2.0}
    assert {c.remote_kv_timeout_s for c in configs.values()} == {5.0}
    assert all(c.step_faults is None for c in configs.values())


def test_step_rules_reach_the_named_workers_steps_not_its_frames() -> None:
    step = {"kind": "delay", "msg_type": "step", "nth": 2, "count": 9, "delay_s": 0.05}
    frame = {"kind": "drop", "msg_type": "*"}
    dep = parse_deployment(raw({"decode-0": [step, frame], "prefill-0": [step]}))
    configs = {c.worker_id: WorkerConfig.from_json(c.to_json()) for c in worker_configs(dep)}
    assert configs["decode-0"].step_faults == FaultPlan((FaultRule(**step),))
    assert configs["decode-0"].transfer.faults == FaultPlan((FaultRule(**frame),))
    assert configs["prefill-0"].step_faults == FaultPlan((FaultRule(**step),))
    assert configs["prefill-0"].transfer.faults is None
    assert configs["prefill-1"].step_faults is None


def test_delayed_steps_are_counted_like_frames() -> None:
    """Steps 2 and 3 start 0.5 s after the step before them started, at the earliest (step
    3, asked about long after step 2 began, waits no more); the others wait for nothing,
    and asking again while one waits counts nothing."""
    rule = FaultRule("delay", "step", nth=2, count=2, delay_s=0.5)
    faults = StepFaults(FaultPlan((rule,)))
    starts, waits = [], []
    for asked in (0.0, 0.125, 8.0, 8.0):  # binary fractions: exact sums
        waits.append(faults.wait_s(asked))
        assert faults.wait_ms(asked) == waits[-1] * 1000
        starts.append(asked + waits[-1])
        assert faults.wait_s(starts[-1]) == 0.0
        faults.stepped(starts[-1])
    assert waits == [0.0, 0.375, 0.0, 0.0] and starts == [0.0, 0.5, 8.0, 8.0]
    assert faults.injector is not None and faults.injector.fired == 2
    assert StepFaults(None).wait_s(0.0) == 0.0


@pytest.mark.parametrize(
    ("faults", "message"),
    [
        ({"prefill-7": []}, r"transfer\.faults\.prefill-7: no such worker"),
        ({"prefill-0": [{"kind": "explode"}]}, r"transfer\.faults\.prefill-0: .*kind"),
        ({"prefill-0": [{"kind": "drop", "when": 1}]}, r"transfer\.faults\.prefill-0: .*when"),
        ({"prefill-0": {"kind": "drop"}}, r"must be a list of mappings"),
        ({"prefill-0": [{"kind": "delay", "delay_s": -1}]}, r"prefill-0: .*delay_s"),
        ({"decode-0": [{"kind": "drop", "msg_type": "step"}]}, r"decode-0: .*only be delayed"),
        (["prefill-0"], r"transfer\.faults must map worker ids"),
    ],
)
def test_bad_faults_are_rejected_with_the_key(faults: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_deployment(raw(faults), "deploy.yaml")
