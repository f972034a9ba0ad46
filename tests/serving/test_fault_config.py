"""The test-only `transfer.faults` setting: validated with the key named, and handed to
exactly the worker it names (through the worker's JSON config)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from hetero_pd.deploy.launcher import worker_configs
from hetero_pd.deploy.schema import ConfigError, parse_deployment
from hetero_pd.serving.worker.config import WorkerConfig
from transfer import FaultRule


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


@pytest.mark.parametrize(
    ("faults", "message"),
    [
        ({"prefill-7": []}, r"transfer\.faults\.prefill-7: no such worker"),
        ({"prefill-0": [{"kind": "explode"}]}, r"transfer\.faults\.prefill-0: .*kind"),
        ({"prefill-0": [{"kind": "drop", "when": 1}]}, r"transfer\.faults\.prefill-0: .*when"),
        ({"prefill-0": {"kind": "drop"}}, r"must be a list of mappings"),
        ({"prefill-0": [{"kind": "delay", "delay_s": -1}]}, r"prefill-0: .*delay_s"),
        (["prefill-0"], r"transfer\.faults must map worker ids"),
    ],
)
def test_bad_faults_are_rejected_with_the_key(faults: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_deployment(raw(faults), "deploy.yaml")
