"""A request that raises inside a step fails alone: it ends with an error naming it, the
other requests of the batch go on to the same tokens as without it; only an engine that
fails every request, step after step, gives up (its worker is then restarted)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hetero_pd import SamplingParams
from hetero_pd.config import EngineConfig
from hetero_pd.engine.health import EngineFault
from hetero_pd.engine.llm_engine import LLMEngine
from hetero_pd.engine.stop import StopChecker, _Automaton


def engine(model: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model), num_kv_blocks=64, num_threads=1))


def run(eng: LLMEngine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            tokens[out.request_id] = list(out.outputs[0].token_ids)
    return tokens


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


PROMPTS = {"a": [1, 2, 3, 4], "b": [5, 6, 7], "c": [9, 8, 7, 6, 5]}


def test_out_of_vocabulary_stop_ids_are_refused_at_admission(tiny_llama_dir: Path) -> None:
    eng = engine(tiny_llama_dir)
    params = SamplingParams(stop_token_ids=[1_000_000], min_tokens=1)
    with pytest.raises(ValueError, match=r"stop_token_ids \[1000000\] are outside"):
        eng.add_request([1, 2, 3], params, "x")
    assert not eng.has_request("x")
    eng.check_integrity()


def test_a_request_that_raises_fails_alone(tiny_llama_dir: Path) -> None:
    reference = engine(tiny_llama_dir)
    for rid, prompt in PROMPTS.items():
        reference.add_request(prompt, greedy(), rid)
    expected = run(reference)

    eng = engine(tiny_llama_dir)
    for rid, prompt in PROMPTS.items():
        eng.add_request(prompt, greedy(), rid)
    # A fault only request "b" carries past admission: its sampler suppression indexes
    # the logits out of range on its first sampled token.
    bad = eng.scheduler.get("b").params
    bad.stop_token_ids, bad.min_tokens = [1_000_000], 4
    got = run(eng)
    failures = eng.pop_failures()
    assert [f.request_id for f in failures] == ["b"]
    assert "request b" in failures[0].message
    assert {rid: got[rid] for rid in ("a", "c")} == {rid: expected[rid] for rid in ("a", "c")}
    assert not eng.has_request("b")
    eng.check_integrity()
    assert eng.load().used_blocks == 0


def test_an_engine_failing_every_request_is_a_fault(tiny_llama_dir: Path) -> None:
    eng = engine(tiny_llama_dir)
    for rid, prompt in PROMPTS.items():
        eng.add_request(prompt, greedy(), rid)

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("device lost")

    eng.runner.execute = broken  # type: ignore[method-assign]  # stands in for a dead device
    with pytest.raises(EngineFault, match="every request"):
        eng.step()


def test_stop_matching_is_linear_in_the_output() -> None:
    """1,000 stop strings of 16k characters once cost 282 ms per token (the hold-back scan
    was quadratic in the stop strings' length); each character is now fed once to each
    stop string's automaton."""
    fed = 0
    original = _Automaton.feed

    def counting(self: _Automaton, text: str, start: int) -> list[int]:
        nonlocal fed
        fed += len(text) - start
        return original(self, text, start)

    stops = ["ab" * 512, "ba" * 511 + "x", "abc"]
    checker = StopChecker(stops)
    _Automaton.feed = counting  # type: ignore[method-assign]
    try:
        text = ""
        for _ in range(2000):
            text += "abab"
            checker.check(text, 4)
            checker.streamable_text_len(text)
    finally:
        _Automaton.feed = original  # type: ignore[method-assign]
    assert fed == len(text) * len(stops)
