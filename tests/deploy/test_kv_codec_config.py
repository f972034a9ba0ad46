"""`transfer.kv_codec` from the deployment file to every worker's transfer engine."""

from __future__ import annotations

import pytest

from hetero_pd.deploy.launcher import worker_configs
from hetero_pd.deploy.schema import parse_text
from hetero_pd.deploy.source import ConfigError
from hetero_pd.serving.worker.config import WorkerConfig, transfer_config

YAML = "version: 1\nmodel: smollm2-135m-instruct\nworkers:\n  - role: prefill\n  - role: decode\n"


def test_kv_codec_reaches_every_workers_transfer_engine() -> None:
    dep = parse_text(YAML + "transfer:\n  kv_codec: int8\n")
    configs = worker_configs(dep)
    assert [c.transfer.kv_codec for c in configs] == ["int8", "int8"]
    again = WorkerConfig.from_json(configs[0].to_json())  # how a worker process receives it
    deployed = transfer_config(again)
    assert deployed.kv_codec == "int8"
    assert worker_configs(parse_text(YAML))[0].transfer.kv_codec == "none"  # the default


def test_an_unknown_kv_codec_names_the_key_and_the_choices() -> None:
    with pytest.raises(ConfigError) as info:
        parse_text(YAML + "transfer:\n  kv_codec: int4\n")
    text = str(info.value)
    assert "transfer.kv_codec" in text and "int4" in text and "none, int8" in text
