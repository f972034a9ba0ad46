"""Speculative decoding (ngram) in the engine: greedy and seeded output equal to the
non-speculative engine's token for token, in mixed batches, with logprobs, stop strings,
stop tokens and preemption."""

from __future__ import annotations

from pathlib import Path

import pytest

from hetero_pd.engine.spec.config import SpeculativeConfig
from hetero_pd.engine.spec.ngram import NgramProposer
from hetero_pd.llm import LLM
from hetero_pd.outputs import RequestOutput
from hetero_pd.sampling_params import SamplingParams

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
# Repetitive prompts (proposals from the first step) beside ones with no repeated token.
PROMPTS: list[list[int]] = [
    [5, 6, 7, 8, 9] * 5,
    list(range(100, 131)),
    [40, 41, 42] * 7 + [43],
    list(range(200, 209)),
]


def test_ngram_proposes_what_followed_the_latest_match() -> None:
    p = NgramProposer(SpeculativeConfig(3, prompt_lookup_min=1, prompt_lookup_max=3))
    assert p.propose([1, 2, 3, 9, 1, 2, 3, 7, 1, 2], 8) == [3, 7, 1]  # latest "1 2"
    assert p.propose([1, 2, 3, 4, 2, 3], 8) == [4, 2, 3]  # "2 3" matched, n=3 fails
    assert p.propose([1, 2, 3, 4, 2, 3], 2) == [4, 2]  # capped by the room left
    assert p.propose([1, 2, 3, 4], 8) == []  # no earlier occurrence
    assert p.propose([5, 5], 8) == [5]  # a continuation stops at the end of the sequence


def test_speculative_config_rejects_what_is_wrong() -> None:
    with pytest.raises(ValueError, match=r"unknown speculative_config key.*'lookahead'"):
        SpeculativeConfig.parse({"num_speculative_tokens": 2, "lookahead": 3})
    with pytest.raises(ValueError, match="method must be one of"):
        SpeculativeConfig.parse({"num_speculative_tokens": 2, "method": "eagle"})
    with pytest.raises(ValueError, match="needs num_speculative_tokens"):
        SpeculativeConfig.parse({"method": "ngram"})
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpeculativeConfig.parse({"num_speculative_tokens": 2, "prompt_lookup_min": 0})


def _llm(path: Path, spec: bool, **kwargs: object) -> LLM:
    options = {"block_size": 4, "num_kv_blocks": 96, **kwargs}
    if spec:
        options["speculative_config"] = SPEC
    return LLM(str(path), dtype="float32", **options)


@pytest.fixture(scope="module")
def plain(tiny_llama_dir: Path) -> LLM:
    return _llm(tiny_llama_dir, spec=False)


@pytest.fixture(scope="module")
def spec(tiny_llama_dir: Path) -> LLM:
    return _llm(tiny_llama_dir, spec=True)


def _accepted(llm: LLM) -> int:
    assert llm.engine.speculator is not None
    return llm.engine.speculator.stats.num_accepted_tokens


def _generate(llm: LLM, params: SamplingParams | list[SamplingParams]) -> list[RequestOutput]:
    outs = llm.generate(PROMPTS, params)
    llm.engine.check_integrity()  # rejected proposals' blocks all given back
    return outs


def _tokens(outs: list[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_greedy_output_is_the_plain_one_in_a_mixed_batch(plain: LLM, spec: LLM) -> None:
    params = [SamplingParams(max_tokens=n, temperature=0) for n in (40, 23, 37, 9)]
    before = _accepted(spec)
    assert _tokens(_generate(spec, params)) == _tokens(_generate(plain, params))
    assert _accepted(spec) - before > 20  # the runs were long, not all rejected


def test_logprobs_of_accepted_tokens_are_the_plain_ones(plain: LLM, spec: LLM) -> None:
    params = SamplingParams(max_tokens=24, temperature=0, logprobs=3)
    a, b = _generate(plain, params), _generate(spec, params)
    assert _tokens(a) == _tokens(b)
    for x, y in zip(a, b, strict=True):
        xs, ys = x.outputs[0].logprobs, y.outputs[0].logprobs
        assert xs is not None and ys is not None and len(xs) == len(ys)
        for ex, ey in zip(xs, ys, strict=True):
            assert ex.keys() == ey.keys()
            for t in ex:
                assert abs(ex[t].logprob - ey[t].logprob) < 1e-4 and ex[t].rank == ey[t].rank
        assert x.outputs[0].cumulative_logprob == pytest.approx(y.outputs[0].cumulative_logprob)


def _runs(llm: LLM, prompt: list[int], params: SamplingParams) -> list[list[int]]:
    """The tokens each step gave the one request (its speculative runs)."""
    engine = llm.engine
    engine.add_request(prompt, params, "runs")
    runs = []
    while engine.has_unfinished_requests():
        runs += [o.outputs[0].delta_token_ids for o in engine.step()]
    return runs


def test_a_stop_inside_an_accepted_run_ends_the_output_where_plain_does(
    plain: LLM, spec: LLM
) -> None:
    prompt = PROMPTS[0]
    greedy = SamplingParams(max_tokens=40, temperature=0)
    runs = _runs(spec, prompt, greedy)
    # a token in the middle of a long run: the stop string (all text up to it) ends there
    start = next(i for i, r in enumerate(runs) if len(r) >= 3)
    stop_at = sum(len(r) for r in runs[:start]) + 1
    out = plain.generate([prompt], greedy)[0].outputs[0]
    tokens = out.token_ids
    text = spec.tokenizer.decode(tokens[: stop_at + 1])
    assert text and not text.endswith("\ufffd")
    for params in (
        SamplingParams(max_tokens=40, temperature=0, stop=[text], include_stop_str_in_output=True),
        SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[tokens[stop_at]]),
    ):
        a, b = plain.generate([prompt], params)[0], spec.generate([prompt], params)[0]
        assert (a.outputs[0].text, a.outputs[0].token_ids) == (
            b.outputs[0].text,
            b.outputs[0].token_ids,
        )
        assert b.outputs[0].finish_reason == "stop" and len(b.outputs[0].token_ids) <= stop_at + 1
        spec.engine.check_integrity()


def test_seeded_sampling_is_the_plain_one(plain: LLM, spec: LLM) -> None:
    """Each sampled row draws from the request's generator as a plain step does, so a seed
    gives the same tokens (penalties, min_tokens and top-p applied per position)."""
    params = [
        SamplingParams(max_tokens=30, temperature=0.05, top_p=0.9, seed=s, min_tokens=5)
        for s in range(3)
    ] + [SamplingParams(max_tokens=30, temperature=0.05, seed=9, presence_penalty=0.01)]
    before = _accepted(spec)
    assert _tokens(_generate(spec, params)) == _tokens(_generate(plain, params))
    assert _accepted(spec) > before


def test_preempted_requests_recompute_to_the_plain_output(tiny_llama_dir: Path) -> None:
    params = SamplingParams(max_tokens=40, temperature=0)
    few = {"num_kv_blocks": 40}  # too few for the batch's outputs: some are preempted
    want = _tokens(_llm(tiny_llama_dir, spec=False, **few).generate(PROMPTS, params))
    engine = _llm(tiny_llama_dir, spec=True, **few).engine
    reqs = [engine.add_request(p, params) for p in PROMPTS]
    while engine.has_unfinished_requests():
        engine.step()
    assert [r.output_token_ids for r in reqs] == want
    assert any(r.num_preemptions for r in reqs)
    engine.check_integrity()


def test_the_default_model_copies_a_text_with_accepted_runs(default_model_dir: Path) -> None:
    text = "Pack my box with five dozen liquor jugs. How vexingly quick daft zebras jump!"
    messages = [{"role": "user", "content": f"Repeat this text exactly: {text}"}]
    params = SamplingParams(max_tokens=24, temperature=0)
    small = {"num_kv_blocks": 64}  # 1024 tokens: the default's 1 GiB was zeroed for ~100
    plain = LLM(dtype="float32", **small)
    spec = LLM(dtype="float32", speculative_config={"num_speculative_tokens": 5}, **small)
    assert _tokens(spec.chat(messages, params)) == _tokens(plain.chat(messages, params))
    assert spec.engine.speculator is not None
    assert spec.engine.speculator.stats.mean_acceptance_length > 2


def test_a_request_whose_proposals_keep_failing_stops_proposing_for_a_while() -> None:
    from hetero_pd.engine.request import Request
    from hetero_pd.engine.scheduler import ScheduledChunk, SchedulerOutput
    from hetero_pd.engine.spec import speculator as S

    sp = S.Speculator(SpeculativeConfig(2, prompt_lookup_min=1), max_model_len=1000)
    req = Request("r", [1, 2, 3, 1, 2, 3, 1], SamplingParams(max_tokens=500))
    req.num_computed_tokens = req.num_tokens - 1

    def step(accepted: int) -> bool:
        """One step; whether the request had proposals (verified with `accepted` kept)."""
        sp.propose([req])
        if not req.spec_token_ids:
            return False
        chunk = ScheduledChunk(req, 1 + len(req.spec_token_ids), len(req.spec_token_ids))
        sp.observe(SchedulerOutput([chunk]), {"r": [0] * (1 + accepted)})
        return True

    assert [step(0) for _ in range(S.MISSES_BEFORE_BACKOFF)] == [True] * 3
    skipped = [step(0) for _ in range(S.BACKOFF_STEPS + 1)]
    assert skipped == [False] * S.BACKOFF_STEPS + [True]  # then one more miss: paused longer
    assert [step(1) for _ in range(2 * S.BACKOFF_STEPS)] == [False] * 8
    assert step(1) and step(0) and step(0)  # an accepted run resets the count
    assert sp.stats.num_drafts == 7
