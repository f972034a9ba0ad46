"""Speculative decoding per worker group in a deployment file, and `--speculative-config`
on `serve MODEL`."""

from __future__ import annotations

from pathlib import Path

import pytest

from hetero_pd.deploy.launcher import worker_config
from hetero_pd.deploy.model_deployment import deployment_for_model
from hetero_pd.deploy.serve import build_parser
from hetero_pd.deploy.source import ConfigError
from hetero_pd.deploy.testing import deployment
from hetero_pd.deploy.validate import validate
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


def test_a_draft_model_reaches_the_worker_and_a_foreign_one_is_named(
    tiny_llama_dir: Path, tmp_path: Path, tokenizer_dir: Path
) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.conftest import TINY, _save_tiny

    draft = {"method": "draft_model", "model": str(tiny_llama_dir), "num_speculative_tokens": 2}
    workers = [{"role": "prefill"}, {"role": "decode", "speculative_config": draft}]
    dep = deployment(tiny_llama_dir, workers=workers)
    validate(dep, "local", check_ports=False)
    (decode,) = [w for w in expand_workers(dep.workers) if w.role == "decode"]
    sent = WorkerConfig.from_json(worker_config(dep, decode, threads=1).to_json())
    assert sent.engine.speculative_config == SpeculativeConfig(
        2, "draft_model", model=draft["model"]
    )
    other = _save_tiny(
        LlamaConfig(**{**TINY, "vocab_size": 256}), LlamaForCausalLM, tmp_path, tokenizer_dir, 3
    )
    workers[1]["speculative_config"] = {**draft, "model": str(other)}
    with pytest.raises(ConfigError, match=r"workers\[1\]\.speculative_config\.model") as e:
        validate(deployment(tiny_llama_dir, workers=workers), "local", check_ports=False)
    assert f"{other}' has vocab_size 256 (target: 512)" in str(e.value)
    assert str(tiny_llama_dir) in str(e.value)
