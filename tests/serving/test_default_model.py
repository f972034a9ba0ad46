"""End to end with the default model (SmolLM2-135M): a streamed chat completion equals the
single-process engine's answer; overload is answered 429 with Retry-After; a client that
disconnects mid-stream frees its blocks on both workers long before the answer would end."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from hetero_pd import LLM, SamplingParams
from hetero_pd.deploy.testing import Stack, deployment, running_stack

pytestmark = pytest.mark.slow
MESSAGES = [{"role": "user", "content": "Name three colors."}]
#: Long enough (> 32 tokens) that the prefill worker computes it and hands the KV over.
LONG_PROMPT = "Summarize: " + "the quick brown fox jumps over the lazy dog. " * 8


@pytest.fixture(scope="module")
def stack(default_model_dir: Path) -> Iterator[Stack]:
    engine = {"max_model_len": 4096, "num_kv_blocks": 320}
    dep = deployment(default_model_dir, router={"max_inflight": 1}, engine=engine)
    with running_stack(dep) as s:
        yield s


@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=120)


def test_streamed_chat_equals_engine(
    stack: Stack, client: openai.OpenAI, default_model_dir: Path
) -> None:
    llm = LLM(
        str(default_model_dir),
        dtype="float32",
        num_kv_blocks=64,
        max_model_len=1024,
        num_threads=1,
    )
    ref = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=24))[0]
    del llm
    stream = client.chat.completions.create(
        model=stack.dep.model, messages=MESSAGES, max_tokens=24, temperature=0, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.outputs[0].text and text.strip()
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finish == [ref.outputs[0].finish_reason]
    usage = chunks[-1].usage
    assert usage is not None and chunks[-1].choices == []
    assert usage.prompt_tokens == len(ref.prompt_token_ids)
    assert usage.completion_tokens == len(ref.outputs[0].token_ids)


def test_overload_429_then_disconnect_frees_blocks(stack: Stack, client: openai.OpenAI) -> None:
    """max_inflight=1: while one long answer streams, others get 429 with Retry-After.
    Cutting that stream aborts it on both workers: they are idle and empty within seconds,
    where the answer itself (thousands of tokens) would take minutes."""
    before = stack.metric("hetero_pd_requests_total", outcome="rejected")
    stream = client.completions.create(
        model=stack.dep.model, prompt=LONG_PROMPT, max_tokens=3000, temperature=0,
        stream=True, extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = iter(stream)
    assert next(chunks).choices[0].text is not None
    next(chunks)
    for streamed in (False, True):
        with pytest.raises(openai.RateLimitError) as info:
            client.completions.create(
                model=stack.dep.model, prompt="Hi", max_tokens=4, stream=streamed
            )
        assert info.value.status_code == 429
        assert int(info.value.response.headers["Retry-After"]) >= 1
        err = info.value.response.json()["error"]
        assert err["type"] == "rate_limit_error" and err["code"] == "rate_limit_exceeded"
    assert stack.metric("hetero_pd_requests_total", outcome="rejected") == before + 2
    assert stack.metric("hetero_pd_policy_decisions_total", decision="disaggregated") >= 1

    stream.close()  # the client goes away mid-answer
    stack.wait_idle(timeout_s=15)
    r = client.completions.create(model=stack.dep.model, prompt="Hi", max_tokens=2)
    assert r.choices[0].finish_reason in ("stop", "length")
