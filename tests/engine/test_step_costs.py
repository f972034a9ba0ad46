"""An engine measures what its steps cost (engine/step_costs.py): the seconds of a
decode-only step and per prompt token of a step that computes a prompt, which its
worker's heartbeat reports and elastic prefill weighs against a TPOT target."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from hetero_pd import SamplingParams
from hetero_pd.config import EngineConfig
from hetero_pd.engine import step_costs
from hetero_pd.engine.llm_engine import LLMEngine
from hetero_pd.engine.step_costs import StepCosts


def chunk(tokens: int, prompt: int, computed: int = 0) -> Any:
    request = SimpleNamespace(num_prompt_tokens=prompt, num_computed_tokens=computed)
    return SimpleNamespace(num_tokens=tokens, request=request)


def timed(costs: StepCosts, chunks: list[Any], seconds: float, now: list[float]) -> None:
    step = costs.start(SimpleNamespace(chunks=chunks))  # type: ignore[arg-type]
    now[0] += seconds
    costs.done(step)


def test_step_costs_average_decode_steps_and_prompt_tokens_apart(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [100.0]
    monkeypatch.setattr(step_costs.time, "perf_counter", lambda: now[0])
    costs = StepCosts()
    assert (costs.decode_step_s, costs.prompt_token_s) == (0.0, 0.0)  # nothing seen yet

    decoding = [chunk(1, 10, computed=12), chunk(1, 8, computed=30)]  # past their prompts
    timed(costs, decoding, 0.020, now)
    assert costs.decode_step_s == pytest.approx(0.020)
    assert costs.prompt_token_s == 0.0
    # 256 prompt tokens (a whole prompt and the end of another) beside a decode row.
    timed(costs, [chunk(200, 200), chunk(100, 156, computed=100), decoding[0]], 0.256, now)
    assert costs.prompt_token_s == pytest.approx(0.256 / 256)
    assert costs.decode_step_s == pytest.approx(0.020)  # a mixed step is not a decode step
    timed(costs, decoding, 0.040, now)
    assert costs.decode_step_s == pytest.approx(0.020 + step_costs.ALPHA * 0.020)
    # A short prompt part says little of a prompt token's cost: no average moves.
    before = (costs.decode_step_s, costs.prompt_token_s)
    timed(costs, [chunk(8, 8), decoding[0]], 0.5, now)
    assert (costs.decode_step_s, costs.prompt_token_s) == before
    assert costs.prompt_tokens_computed == 256 + 8

    # A step that fails is counted as computed (as before) but not timed.
    costs.start(SimpleNamespace(chunks=[chunk(300, 300)]))  # type: ignore[arg-type]
    assert costs.prompt_token_s == before[1]
    assert costs.prompt_tokens_computed == 256 + 8 + 300


def test_an_engine_reports_its_step_costs_in_its_load(tiny_llama_dir: Path) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), num_kv_blocks=64, num_threads=1))
    assert (engine.load().decode_step_s, engine.load().prompt_token_s) == (0.0, 0.0)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.add_request(list(range(1, 101)), params, "a")
    while engine.has_unfinished_requests():
        engine.step()
    load = engine.load()
    assert load.prompt_tokens_computed == 100
    assert 0.0 < load.prompt_token_s < 1.0
    assert 0.0 < load.decode_step_s < 10.0
