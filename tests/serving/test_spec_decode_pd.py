"""Speculative decoding on the decode worker of a prefill + decode stack, through the
OpenAI API (official openai client): greedy text and logprobs equal the single-process
plain engine's, for prompts computed on the decode worker and prompts handed off by the
prefill worker; vLLM's spec_decode counters on /metrics count what was accepted."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from hetero_pd import SamplingParams
from hetero_pd.deploy.testing import Stack, deployment, random_prompts, running_stack

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
TOL = 1e-4
SHORT, LONG = 20, 120  # computed on the decode worker; handed off by the prefill worker


@pytest.fixture(scope="module")
def pd(tiny_llama_dir: Path) -> Iterator[Stack]:
    workers = [{"role": "prefill"}, {"role": "decode", "speculative_config": SPEC}]
    with running_stack(deployment(tiny_llama_dir, workers=workers)) as s:
        yield s


def _accepted(stack: Stack) -> float:
    return stack.metric("vllm:spec_decode_num_accepted_tokens_total", worker="decode-0")


@pytest.mark.parametrize("length", [SHORT, LONG], ids=["local_prefill", "disaggregated"])
def test_served_greedy_output_and_logprobs_are_the_plain_engines(
    pd: Stack, tiny_reference: Any, length: int
) -> None:
    client = openai.OpenAI(base_url=pd.base_url, api_key="x", max_retries=0, timeout=120)
    # one prompt that repeats itself (long accepted runs), one that does not
    prompts = [([7, 8, 9, 10, 11] * length)[:length], random_prompts([length], seed=length)[0]]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=2)
    for ids in prompts:
        (ref,) = tiny_reference.llm.generate(ids, params)
        want = ref.outputs[0]
        r = client.completions.create(
            model=pd.dep.model, prompt=ids, max_tokens=32, temperature=0, logprobs=2,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        (choice,) = r.choices
        assert choice.text == want.text
        assert want.logprobs is not None and choice.logprobs is not None
        got_lps = choice.logprobs.token_logprobs
        pairs = zip(want.logprobs, want.token_ids, strict=True)
        want_lps = [entry[t].logprob for entry, t in pairs]
        assert len(got_lps) == len(want_lps)
        assert all(abs(g - w) < TOL for g, w in zip(got_lps, want_lps, strict=True))
    pd.wait_idle()  # rejected proposals' blocks all given back
    deadline = time.monotonic() + 20
    while _accepted(pd) == 0 and time.monotonic() < deadline:
        time.sleep(0.2)  # the decode worker's next heartbeat carries its counts
    assert _accepted(pd) > 0
    # Counters that only grow, read in this order: a heartbeat landing between the two reads
    # can only raise `drafts` (read after), never `first` (read before).
    first = pd.metric(
        "vllm:spec_decode_num_accepted_tokens_per_pos_total", worker="decode-0", position="0"
    )
    drafts = pd.metric("vllm:spec_decode_num_drafts_total", worker="decode-0")
    assert drafts >= first > 0
    assert pd.metric("vllm:spec_decode_num_drafts_total", worker="prefill-0") == 0
