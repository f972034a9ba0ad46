"""Sampling fields end to end through the router and real worker processes: logprobs, prompt
logprobs, n > 1, penalties and logit_bias give what the single-process engine gives, whether
the prompt is computed on the decode worker or on the prefill worker and handed off."""

from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Any

import pytest

from hetero_pd import SamplingParams
from hetero_pd.deploy.testing import Stack, metric_value, random_prompts
from hetero_pd.outputs import Logprob, RequestOutput
from hetero_pd.serving.control import protocol as P
from hetero_pd.serving.control import sampling as W
from hetero_pd.serving.router.errors import RouterError

TOL = 1e-4
#: Up to 32 prompt tokens are prefilled on the decode worker (conditional disaggregation);
#: longer ones on the prefill worker, whose KV is handed off.
SHORT, LONG = 20, 120
DECISIONS = "hetero_pd_policy_decisions_total"


@pytest.fixture(scope="module")
def stack(tiny_pd_stack: Stack) -> Stack:
    return tiny_pd_stack


async def _collect(stack: Stack, rid: str, ids: list[int], params: SamplingParams) -> list[Any]:
    assert stack.router is not None
    async with contextlib.aclosing(stack.router.generate(rid, ids, params)) as stream:
        return [msg async for msg in stream]


def run(stack: Stack, rid: str, ids: list[int], params: SamplingParams) -> list[P.Output]:
    return stack.call(_collect(stack, rid, ids, params), timeout_s=120)


def assert_same_positions(
    got: list[dict[int, Logprob] | None], want: list[dict[int, Logprob] | None]
) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        if w is None:
            assert g is None
            continue
        assert g is not None and list(g) == list(w)  # same tokens, chosen first, by rank
        for token, lp in w.items():
            assert abs(g[token].logprob - lp.logprob) < TOL and g[token].rank == lp.rank


def assert_matches(outputs: list[P.Output], ref: RequestOutput) -> None:
    tokens: dict[int, list[int]] = defaultdict(list)
    logprobs: dict[int, list[dict[int, Logprob] | None]] = defaultdict(list)
    prompt = [m.prompt_logprobs for m in outputs if m.prompt_logprobs is not None]
    assert [m.seq for m in outputs] == list(range(len(outputs)))
    for m in outputs:
        tokens[m.index] += m.token_ids
        if m.logprobs is not None:
            logprobs[m.index] += W.entries(m.logprobs)
    assert sorted(tokens) == list(range(len(ref.outputs)))
    for c in ref.outputs:
        assert tokens[c.index] == c.token_ids, f"completion {c.index}"
        if c.logprobs is not None:
            assert_same_positions(logprobs[c.index], list(c.logprobs))
    if ref.prompt_logprobs is None:
        assert prompt == []
    else:
        assert len(prompt) == 1, "the prompt's logprobs come once"
        assert_same_positions(W.prompt_entries(prompt[0]), ref.prompt_logprobs)


@pytest.mark.parametrize("length", [SHORT, LONG], ids=["local_prefill", "disaggregated"])
def test_logprobs_and_n_match_the_engine(stack: Stack, tiny_reference: Any, length: int) -> None:
    ids = random_prompts([length], seed=length + 1)[0]
    before = stack.metrics()
    cases = {
        "greedy": SamplingParams(
            temperature=0, max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=2
        ),
        "n": SamplingParams(
            n=3, temperature=0.9, seed=7, max_tokens=5, ignore_eos=True, logprobs=2,
            prompt_logprobs=0,
        ),
        "penalties": SamplingParams(
            temperature=0.8, seed=3, max_tokens=8, ignore_eos=True, logprobs=1,
            presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.3,
            logit_bias={ids[0]: 5.0, 17: -100.0},
        ),
    }  # fmt: skip
    for name, params in cases.items():
        (ref,) = tiny_reference.llm.generate(ids, params)
        assert_matches(run(stack, f"{name}-{length}", ids, params), ref)
    after = stack.metrics()
    decision = "local_prefill" if length == SHORT else "disaggregated"
    assert metric_value(after, DECISIONS, decision=decision) - metric_value(
        before, DECISIONS, decision=decision
    ) == len(cases)
    stack.wait_idle()


@pytest.mark.parametrize("length", [SHORT, LONG], ids=["local_prefill", "disaggregated"])
@pytest.mark.parametrize(
    ("params", "words"),
    [
        (SamplingParams(max_tokens=2, logit_bias={600: 1.0}), "logit_bias keys [600]"),
        (SamplingParams(max_tokens=2, stop_token_ids=[512]), "stop_token_ids [512]"),
    ],
    ids=["logit_bias", "stop_token_ids"],
)
def test_workers_refuse_token_ids_outside_the_vocabulary(
    stack: Stack, length: int, params: SamplingParams, words: str
) -> None:
    """The API checks them too; a worker never trusts that (the tiny model has 512 ids)."""
    ids = random_prompts([length], seed=3)[0]
    with pytest.raises(RouterError) as info:
        run(stack, f"bad-{length}-{words[:4]}", ids, params)
    assert info.value.status == 400 and words in info.value.message
    stack.wait_idle()
