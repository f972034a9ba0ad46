"""Sampling fields through the OpenAI API of a real stack, with the official openai client:
logprobs (completions, echo, chat) equal the single-process engine's for the same request,
`n` returns n choices, penalties and logit_bias change the output exactly as the engine's
do, streaming answers equal the whole ones, and bad values are 400s naming the field. Both
paths: prefill + decode workers (short prompts computed on the decode worker, long ones
handed off) and one colocated worker (with a vocabulary that covers real chat text)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest
from transformers import AutoTokenizer

from hetero_pd import LLM, SamplingParams
from hetero_pd.deploy.testing import (
    Stack,
    http_json,
    random_prompts,
)
from hetero_pd.outputs import Logprob

KEY = "k"  # the shared stacks' (tests/serving/conftest.py)
TOL = 1e-4
SHORT, LONG = 20, 120


@pytest.fixture(scope="module")
def pd(tiny_pd_stack: Stack) -> Stack:
    return tiny_pd_stack


@pytest.fixture(scope="module")
def colocated(chat_colocated_stack: Stack) -> Stack:
    return chat_colocated_stack


def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key=KEY, max_retries=0, timeout=120)


def tokenizer(model: Path) -> Any:
    return AutoTokenizer.from_pretrained(model)


def text(tok: Any, token: int) -> str:
    return str(tok.decode([token]))


def assert_completion_logprobs(
    tok: Any, got: Any, want: list[dict[int, Logprob] | None], ids: list[int]
) -> None:
    """`got` (the API's completions logprobs) shows `want` (the engine's positions of the
    tokens `ids`): the chosen token, its logprob, and every listed alternative."""
    assert got.tokens == [text(tok, t) for t in ids]
    assert len(got.token_logprobs) == len(want) == len(got.top_logprobs)
    for lp, top, w, token in zip(got.token_logprobs, got.top_logprobs, want, ids, strict=True):
        if w is None:
            assert lp is None and top is None
            continue
        assert abs(lp - w[token].logprob) < TOL
        # Keyed by text, as OpenAI's shape is: tokens that read alike share one key.
        expected = {text(tok, t): x.logprob for t, x in w.items()}
        assert set(top) == set(expected)
        assert all(abs(top[k] - v) < TOL for k, v in expected.items())
    offsets = [sum(len(t) for t in got.tokens[:i]) for i in range(len(got.tokens))]
    assert got.text_offset == offsets


# -- completions through prefill + decode workers ----------------------------------------------
@pytest.mark.parametrize("length", [SHORT, LONG], ids=["local_prefill", "disaggregated"])
def test_completion_logprobs_equal_the_engines(
    pd: Stack, tiny_reference: Any, tiny_llama_dir: Path, length: int
) -> None:
    tok = tokenizer(tiny_llama_dir)
    ids = random_prompts([length], seed=length + 5)[0]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    (ref,) = tiny_reference.llm.generate(ids, params)
    r = client(pd).completions.create(
        model=pd.dep.model, prompt=ids, max_tokens=6, temperature=0, logprobs=3,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    (choice,) = r.choices
    c = ref.outputs[0]
    assert choice.text == c.text and c.logprobs is not None
    assert_completion_logprobs(tok, choice.logprobs, list(c.logprobs), c.token_ids)


@pytest.mark.parametrize("length", [SHORT, LONG], ids=["local_prefill", "disaggregated"])
def test_echo_with_logprobs_as_lm_eval_asks(
    pd: Stack, tiny_reference: Any, tiny_llama_dir: Path, length: int
) -> None:
    """lm-evaluation-harness's `local-completions` log-likelihood request: token ids in a
    batch of one, echo, logprobs=1, max_tokens=1, temperature 0; it reads
    `token_logprobs[ctxlen:-1]` and checks each token against `top_logprobs`."""
    tok = tokenizer(tiny_llama_dir)
    ids = random_prompts([length], seed=length + 6)[0]
    body = {"model": pd.dep.model, "prompt": [ids], "max_tokens": 1, "temperature": 0,
            "logprobs": 1, "seed": 1234, "echo": True}  # fmt: skip
    status, r = post(pd, "/v1/completions", body)
    assert status == 200, r
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=1, prompt_logprobs=1, seed=1234)
    (ref,) = tiny_reference.llm.generate(ids, params)
    (choice,) = r["choices"]
    c = ref.outputs[0]
    assert choice["text"] == tok.decode(ids) + c.text
    assert ref.prompt_logprobs is not None and c.logprobs is not None
    # As the openai client reads it (without validation: the first prompt token's null).
    got = openai.types.completion_choice.Logprobs.model_construct(**choice["logprobs"])
    want = [*ref.prompt_logprobs, *c.logprobs]
    assert_completion_logprobs(tok, got, want, [*ids, *c.token_ids])
    assert r["usage"]["prompt_tokens"] == length


def test_n_choices_equal_the_engines_and_stream_alike(pd: Stack, tiny_reference: Any) -> None:
    ids = random_prompts([LONG], seed=9)[0]
    kw: dict[str, Any] = dict(model=pd.dep.model, prompt=ids, n=3, max_tokens=5,
                              temperature=0.9, seed=7, extra_body={"ignore_eos": True})  # fmt: skip
    params = SamplingParams(n=3, temperature=0.9, seed=7, max_tokens=5, ignore_eos=True)
    (ref,) = tiny_reference.llm.generate(ids, params)
    want = [c.text for c in ref.outputs]
    r = client(pd).completions.create(**kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == want and len(set(want)) > 1
    assert r.usage is not None and r.usage.completion_tokens == 15
    streamed = ["", "", ""]
    finished = set()
    for chunk in client(pd).completions.create(**kw, stream=True):
        for ch in chunk.choices:
            streamed[ch.index] += ch.text
            if ch.finish_reason is not None:
                finished.add(ch.index)
    assert streamed == want and finished == {0, 1, 2}


def repeats(tokens: list[int]) -> int:
    return len(tokens) - len(set(tokens))


def test_penalties_and_logit_bias_change_the_output_as_the_engines_do(
    pd: Stack, tiny_reference: Any
) -> None:
    ids = random_prompts([SHORT], seed=11)[0]
    base: dict[str, Any] = dict(temperature=0, max_tokens=10, ignore_eos=True)
    extra = dict(presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.3)
    (plain,) = tiny_reference.llm.generate(ids, SamplingParams(**base))
    (penalized,) = tiny_reference.llm.generate(ids, SamplingParams(**base, **extra))
    (forced,) = tiny_reference.llm.generate(ids, SamplingParams(**base, logit_bias={42: 100.0}))
    # Greedy on a random model repeats itself; the penalties stop that, as OpenAI documents.
    assert repeats(plain.outputs[0].token_ids) > repeats(penalized.outputs[0].token_ids)
    c = client(pd)
    common: dict[str, Any] = dict(model=pd.dep.model, prompt=ids, max_tokens=10, temperature=0)
    r = c.completions.create(
        **common, presence_penalty=1.5, frequency_penalty=0.5,
        extra_body={"ignore_eos": True, "repetition_penalty": 1.3},
    )  # fmt: skip
    assert r.choices[0].text == penalized.outputs[0].text
    r = c.completions.create(**common, logit_bias={"42": 100}, extra_body={"ignore_eos": True})
    assert forced.outputs[0].token_ids == [42] * 10  # +100 outweighs any logit here
    assert r.choices[0].text == forced.outputs[0].text


# -- chat through one colocated worker ---------------------------------------------------------
def test_chat_logprobs_equal_the_engines_and_stream_alike(
    colocated: Stack, chat_model: Path
) -> None:
    tok = tokenizer(chat_model)
    messages = [{"role": "user", "content": "Name three colours."}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tok.encode(prompt, add_special_tokens=False)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=2)
    llm = LLM(str(chat_model), dtype="float32", num_kv_blocks=64, max_model_len=1024, num_threads=1)
    (ref,) = llm.generate(ids, params)
    c = ref.outputs[0]
    assert c.logprobs is not None
    kw: dict[str, Any] = dict(model=colocated.dep.model, messages=messages, max_tokens=5,
                              temperature=0, logprobs=True, top_logprobs=2,
                              extra_body={"ignore_eos": True})  # fmt: skip
    r = client(colocated).chat.completions.create(**kw)
    (choice,) = r.choices
    assert choice.message.content == c.text and choice.logprobs is not None
    content = choice.logprobs.content
    assert content is not None and len(content) == len(c.token_ids)
    for got, token, want in zip(content, c.token_ids, c.logprobs, strict=True):
        assert got.token == text(tok, token) and got.bytes == list(got.token.encode())
        assert abs(got.logprob - want[token].logprob) < TOL
        top = sorted(want.items(), key=lambda item: item[1].rank)[:2]
        assert [t.token for t in got.top_logprobs] == [text(tok, t) for t, _ in top]
        for g, (_, w) in zip(got.top_logprobs, top, strict=True):
            assert abs(g.logprob - w.logprob) < TOL
    streamed = []
    for chunk in client(colocated).chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            if ch.logprobs is not None and ch.logprobs.content:
                streamed += ch.logprobs.content
    assert [x.model_dump() for x in streamed] == [x.model_dump() for x in content]


def test_completion_logprobs_stream_alike_on_a_colocated_worker(colocated: Stack) -> None:
    ids = random_prompts([SHORT], seed=13)[0]
    kw: dict[str, Any] = dict(model=colocated.dep.model, prompt=ids, max_tokens=6,
                              temperature=0, logprobs=2, echo=True,
                              extra_body={"ignore_eos": True})  # fmt: skip
    whole = client(colocated).completions.create(**kw).choices[0]
    tokens: list[str] = []
    offsets: list[int] = []
    streamed = ""
    for chunk in client(colocated).completions.create(**kw, stream=True):
        for ch in chunk.choices:
            streamed += ch.text
            if ch.logprobs is not None:
                tokens += ch.logprobs.tokens or []
                offsets += ch.logprobs.text_offset or []
    assert whole.logprobs is not None
    assert streamed == whole.text and tokens == whole.logprobs.tokens
    assert offsets == whole.logprobs.text_offset


# -- validation --------------------------------------------------------------------------------
def post(stack: Stack, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    return http_json(stack.url + path, body, KEY)


BAD_COMPLETION = [
    ("logprobs", {"logprobs": 21}),
    ("logprobs", {"logprobs": True}),
    ("n", {"n": 0}),
    ("n", {"n": 129}),
    ("best_of", {"best_of": 2}),
    ("presence_penalty", {"presence_penalty": 2.5}),
    ("frequency_penalty", {"frequency_penalty": "high"}),
    ("repetition_penalty", {"repetition_penalty": 0}),
    ("logit_bias", {"logit_bias": {"-1": 1}}),
    ("logit_bias", {"logit_bias": {"x": 1}}),
    ("logit_bias", {"logit_bias": {"5": 101}}),
    ("logit_bias", {"logit_bias": {"512": 1}}),  # the tiny model's vocabulary is 512
    ("logit_bias", {"logit_bias": [1, 2]}),
    ("echo", {"echo": "yes"}),
]
BAD_CHAT = [
    ("top_logprobs", {"top_logprobs": 2}),
    ("top_logprobs", {"logprobs": True, "top_logprobs": 21}),
    ("logprobs", {"logprobs": 3}),
    ("echo", {"echo": True}),
]


@pytest.mark.parametrize(("field", "extra"), BAD_COMPLETION)
def test_bad_values_are_400s_naming_the_field(pd: Stack, field: str, extra: dict[str, Any]) -> None:
    body = {"model": pd.dep.model, "prompt": [1, 2, 3], "max_tokens": 2, **extra}
    status, r = post(pd, "/v1/completions", body)
    assert status == 400 and r["error"]["param"] == field, r


@pytest.mark.parametrize(("field", "extra"), BAD_CHAT)
def test_bad_chat_values_are_400s_naming_the_field(
    colocated: Stack, field: str, extra: dict[str, Any]
) -> None:
    body = {"model": colocated.dep.model, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2, **extra}  # fmt: skip
    status, r = post(colocated, "/v1/chat/completions", body)
    assert status == 400 and r["error"]["param"] == field, r


# -- prompt batches ----------------------------------------------------------------------------
def test_prompt_batches_number_choices_as_vllm(pd: Stack, tiny_reference: Any) -> None:
    """Choice `i * n + j` is completion j of prompt i; one short and one long prompt (one
    computed on the decode worker, one handed off), whole and streamed."""
    prompts = random_prompts([SHORT, LONG], seed=21)
    params = SamplingParams(n=2, temperature=0.9, seed=5, max_tokens=4, ignore_eos=True)
    want = [c.text for out in tiny_reference.llm.generate(prompts, params) for c in out.outputs]
    kw: dict[str, Any] = dict(model=pd.dep.model, prompt=prompts, n=2, max_tokens=4,
                              temperature=0.9, seed=5, extra_body={"ignore_eos": True})  # fmt: skip
    r = client(pd).completions.create(**kw)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == want
    assert r.usage is not None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (SHORT + LONG, 16)
    streamed = [""] * 4
    for chunk in client(pd).completions.create(**kw, stream=True):
        for ch in chunk.choices:
            streamed[ch.index] += ch.text
    assert streamed == want
    pd.wait_idle()


def test_lm_eval_loglikelihood_batch(pd: Stack, tiny_reference: Any) -> None:
    """lm-eval's `local-completions` with batch_size > 1: several token-id prompts in one
    request; it sorts the choices by index and sums `token_logprobs[ctxlen:-1]`."""
    prompts = random_prompts([12, 40, 90], seed=22)
    body = {"model": pd.dep.model, "prompt": prompts, "max_tokens": 1, "temperature": 0,
            "logprobs": 1, "seed": 1234, "echo": True}  # fmt: skip
    status, r = post(pd, "/v1/completions", body)
    assert status == 200, r
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=1, prompt_logprobs=1)
    refs = tiny_reference.llm.generate(prompts, params)
    ctxlen = 5
    for choice, ids, ref in zip(sorted(r["choices"], key=lambda c: c["index"]), prompts, refs,
                                strict=True):  # fmt: skip
        lps = choice["logprobs"]["token_logprobs"]
        assert len(lps) == len(ids) + 1
        want = [
            e[t].logprob for e, t in zip(ref.prompt_logprobs[ctxlen:], ids[ctxlen:], strict=True)
        ]
        assert abs(sum(lps[ctxlen:-1]) - sum(want)) < TOL * len(want)
        for lp, top in zip(lps[ctxlen:-1], choice["logprobs"]["top_logprobs"][ctxlen:-1],
                           strict=True):  # fmt: skip
            assert isinstance(top, dict) and lp is not None and max(top.values()) >= lp
    pd.wait_idle()
