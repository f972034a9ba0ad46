"""Speculative decoding per worker group in a deployment file, and `--speculative-config`
on `serve MODEL`."""

from __future__ import annotations

import pytest

from hetero_pd.deploy.launcher import worker_config
from hetero_pd.deploy.model_deployment import deployment_for_model
from hetero_pd.deploy.serve import build_parser
from hetero_pd.deploy.source import ConfigError
from hetero_pd.deploy.testing import deployment
from hetero_pd.deploy.workers import expand_workers
from hetero_pd.engine.spec.config import SpeculativeConfig
from hetero_pd.serving.worker.config import WorkerConfig

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}


def test_a_decode_group_runs_its_speculative_config_end_to_end() -> None:
    dep = deployment(
        "m", workers=[{"role": "prefill"}, {"role": "decode", "speculative_config": NGRAM}]
    )
    configs = {w.worker_id: worker_config(dep, w, threads=1) for w in expand_workers(dep.workers)}
    assert configs["prefill-0"].engine.speculative_config is None
    want = SpeculativeConfig(3, prompt_lookup_max=4)
    assert configs["decode-0"].engine.speculative_config == want
    # as the launcher hands it to the worker process
    sent = WorkerConfig.from_json(configs["decode-0"].to_json())
    assert sent.engine.speculative_config == want


@pytest.mark.parametrize(
    ("worker", "message"),
    [
        ({"role": "prefill", "speculative_config": NGRAM}, "set it on decode"),
        ({"role": "decode", "speculative_config": {"num_speculative_tokens": 0}}, ">= 1"),
        ({"role": "decode", "speculative_config": {**NGRAM, "method": "medusa"}}, "method must be"),
        ({"role": "decode", "speculative_config": {**NGRAM, "k": 2}}, "unknown .*'k'"),
    ],
)
def test_a_wrong_speculative_config_is_named(worker: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as e:
        deployment("m", workers=[{"role": "decode"}, worker])
    assert "workers[1].speculative_config" in str(e.value)


def test_serve_model_puts_the_flag_on_the_decode_workers(default_model_dir: object) -> None:
    parser = build_parser()
    model = "smollm2-135m-instruct"
    args = parser.parse_args([model, "--speculative-config", '{"num_speculative_tokens": 2}'])
    dep = deployment_for_model(model, args)
    by_role = {w.role: w.speculative_config for w in dep.workers}
    assert by_role == {"prefill": None, "decode": {"num_speculative_tokens": 2}}
    with pytest.raises(SystemExit):
        parser.parse_args([model, "--speculative-config", "[2]"])
    bad = parser.parse_args([model, "--speculative-config", '{"num_speculative_tokens": -1}'])
    with pytest.raises(ValueError, match=r"--speculative-config: .*>= 1"):
        deployment_for_model(model, bad)
