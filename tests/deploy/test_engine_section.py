"""The `engine:` section holds EngineConfig's options under its names and defaults."""

from __future__ import annotations

import dataclasses

from hetero_pd.config import EngineConfig
from hetero_pd.deploy.sections import EngineSpec
from hetero_pd.deploy.testing import deployment


def test_the_section_has_every_engine_option_with_its_default() -> None:
    spec = {f.name: f.default for f in dataclasses.fields(EngineSpec)}
    engine = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    # per worker, not per deployment: what it runs, as what, and on which device(s)
    per_worker = {"model", "role", "device", "tensor_parallel_size", "speculative_config"}
    assert set(spec) == set(engine) - per_worker
    # "" = the deployment's dtype; every other option defaults as the engine does
    assert {k: v for k, v in spec.items() if engine[k] != v} == {"dtype": ""}


def test_the_section_becomes_one_engine_config() -> None:
    assert EngineSpec().engine_config("m", "cpu") == EngineConfig(model="m")
    dep = deployment("m", engine={"max_num_seqs": 4, "dtype": "bfloat16"})
    config = dep.engine.engine_config("m", "cpu", num_threads=2)
    assert (config.max_num_seqs, config.dtype, config.num_threads) == (4, "bfloat16", 2)
    assert config.max_model_len == 1024  # the test helper's small engine
