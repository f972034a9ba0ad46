"""OpenAI request parsing: bodies as the openai client and `vllm bench serve` send them,
every invalid field answered 400 naming it, unsupported features refused, API keys."""

from __future__ import annotations

import time
from typing import Any

import pytest

from hetero_pd.serving.api.bodies import decode_body
from hetero_pd.serving.api.errors import (
    APIError,
    check_api_key,
    model_not_found,
    server_error,
    too_many_requests,
)
from hetero_pd.serving.api.protocol import (
    check_context_length,
    parse_chat_request,
    parse_completion_request,
)

USER = [{"role": "user", "content": "Hi"}]


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": "Hello", **fields}


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": USER, **fields}


def rejected(parse: Any, body: Any) -> APIError:
    with pytest.raises(APIError) as info:
        parse(body)
    assert info.value.status == 400 and info.value.type == "invalid_request_error"
    return info.value


def test_completion_defaults_follow_openai() -> None:
    req = parse_completion_request(completion())
    p = req.params
    assert (req.kind, req.model, req.prompt, req.prompt_token_ids) == (
        "completion",
        "m",
        "Hello",
        None,
    )
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed) == (16, 1.0, 1.0, 0, None)
    assert (req.stream, req.include_usage, req.priority, req.user) == (False, False, 0, None)
    assert req.request_id.startswith("cmpl-") and len(req.request_id) > 20
    assert abs(req.created - time.time()) < 5


def test_completion_as_the_openai_client_sends_it() -> None:
    req = parse_completion_request(
        completion(
            max_tokens=32,
            temperature=0.0,
            top_p=0.9,
            seed=7,
            stop=["\n\n", "###"],
            stream=True,
            stream_options={"include_usage": True},
            user="alice",
        )
    )
    p = req.params
    assert (p.max_tokens, p.temperature, p.top_p, p.seed) == (32, 0.0, 0.9, 7)
    assert p.greedy and p.stop == ["\n\n", "###"]
    assert (req.stream, req.include_usage, req.user) == (True, True, "alice")


def test_vllm_bench_serve_completion_payload() -> None:
    body = {
        "model": "smollm2-135m-instruct",
        "prompt": "some random words " * 20,
        "repetition_penalty": 1.0,
        "max_tokens": 64,
        "logprobs": None,
        "best_of": 1,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    req = parse_completion_request(body)
    assert req.params.max_tokens == 64 and req.params.ignore_eos and req.params.greedy
    assert req.stream and req.include_usage


def test_vllm_bench_serve_chat_payload() -> None:
    body = {
        "model": "smollm2-135m-instruct",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Tell me a story"}]}],
        "temperature": 0.0,
        "max_completion_tokens": 64,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    req = parse_chat_request(body)
    assert req.messages == [{"role": "user", "content": "Tell me a story"}]
    assert req.params.max_tokens == 64 and req.params.ignore_eos and req.include_usage
    assert req.request_id.startswith("chatcmpl-") and req.prompt is None


@pytest.mark.parametrize(
    ("prompt", "text", "ids"),
    [
        ("Hi", "Hi", None),
        (["Hi"], "Hi", None),
        ([1, 2, 3], None, [1, 2, 3]),
        ([[4, 5]], None, [4, 5]),
    ],
)
def test_prompt_forms(prompt: Any, text: str | None, ids: list[int] | None) -> None:
    req = parse_completion_request(completion(prompt=prompt))
    assert (req.prompt, req.prompt_token_ids) == (text, ids)


@pytest.mark.parametrize(
    ("prompt", "batch"),
    [(["a", "b"], [("a", None), ("b", None)]), ([[1], [2]], [(None, [1]), (None, [2])])],
)
def test_batched_prompts(prompt: Any, batch: Any) -> None:
    req = parse_completion_request(completion(prompt=prompt))
    assert req.batch == batch
    assert [(r.prompt, r.prompt_token_ids) for r in req.each_prompt()] == batch
    err = rejected(parse_completion_request, completion(prompt=["a", 5]))
    assert (err.param, err.message) == ("prompt", "'prompt[1]' must be a string or a list "
                                        "of token ids, got 5")  # fmt: skip
    err = rejected(parse_completion_request, completion(prompt=["a"] * 257))
    assert err.param == "prompt" and "at most 256" in err.message


def test_chat_max_tokens_and_roles() -> None:
    assert parse_chat_request(chat()).params.max_tokens is None  # until EOS or model length
    assert parse_chat_request(chat(max_tokens=5)).params.max_tokens == 5
    both = chat(max_tokens=5, max_completion_tokens=9)
    assert parse_chat_request(both).params.max_tokens == 9
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None},
        {"role": "tool", "content": "42", "tool_call_id": "x"},
    ]
    assert parse_chat_request(chat(messages=messages)).messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": ""},
        {"role": "tool", "content": "42"},
    ]


def test_vllm_extensions_and_priority() -> None:
    req = parse_completion_request(
        completion(
            top_k=20,
            min_p=0.05,
            stop_token_ids=[2, 3],
            min_tokens=4,
            skip_special_tokens=False,
            include_stop_str_in_output=True,
            priority=5,
        )
    )
    p = req.params
    assert (p.top_k, p.min_p, p.stop_token_ids, p.min_tokens) == (20, 0.05, [2, 3], 4)
    assert not p.skip_special_tokens and p.include_stop_str_in_output and req.priority == 5
    assert parse_completion_request(completion(top_k=-1)).params.top_k == 0


def test_null_means_not_given_and_unknown_fields_are_ignored() -> None:
    names = ["max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream"]
    names += ["stream_options", "user", "priority", "logprobs", "n", "tools", "logit_bias"]
    req = parse_completion_request(completion(**dict.fromkeys(names), frobnicate={"x": 1}))
    assert req.params.max_tokens == 16 and req.params.temperature == 1.0 and not req.stream
    # stream_options without stream is ignored, not an error.
    assert not parse_chat_request(chat(stream_options={"include_usage": True})).include_usage
    # integral floats are integers, as pydantic-based servers accept them
    assert parse_completion_request(completion(max_tokens=8.0)).params.max_tokens == 8


def test_decode_body() -> None:
    assert decode_body(b'{"model": "m", "other": [1]}', "completion", 8) == {"model": "m"}
    for raw in (b"{", b"\xff\xfe", b""):
        with pytest.raises(APIError) as info:
            decode_body(raw, "completion", 8)
        assert info.value.status == 400 and "not valid JSON" in info.value.message


def test_error_shapes() -> None:
    err = rejected(parse_completion_request, completion(top_p=2))
    assert err.to_json() == {
        "error": {
            "message": err.message,
            "type": "invalid_request_error",
            "param": "top_p",
            "code": None,
        }
    }
    assert model_not_found("x").to_json()["error"] == {
        "message": "The model `x` does not exist.",
        "type": "not_found_error",
        "param": "model",
        "code": "model_not_found",
    }
    assert (too_many_requests("busy").status, too_many_requests("busy").type) == (
        429,
        "rate_limit_error",
    )
    assert (server_error("x", 503).status, server_error("x").type) == (503, "server_error")


def test_api_key() -> None:
    keys = ["sk-one", "sk-two"]
    check_api_key({}, [])  # no keys configured: open
    check_api_key({"Authorization": "Bearer sk-two"}, keys)
    check_api_key({"authorization": "bearer  sk-one "}, keys)
    for headers in ({}, {"Authorization": "Bearer sk-three"}, {"Authorization": "sk-one"}):
        with pytest.raises(APIError) as info:
            check_api_key(headers, keys)
        err = info.value
        assert (err.status, err.type, err.code) == (401, "authentication_error", "invalid_api_key")
        assert "sk-three" not in err.message


def test_context_length() -> None:
    req = parse_completion_request(completion(max_tokens=10))
    assert check_context_length(req, 90, 100) == 10
    with pytest.raises(APIError) as info:
        check_context_length(req, 91, 100)
    err = info.value
    assert (err.status, err.param, err.code) == (400, "prompt", "context_length_exceeded")
    assert "maximum context length is 100 tokens" in err.message
    assert "requested 101 tokens (91 in the prompt, 10 in the completion)" in err.message
    chat_req = parse_chat_request(chat())  # no max_tokens: whatever room is left
    assert check_context_length(chat_req, 60, 100) == 40
    with pytest.raises(APIError, match="100 in the messages"):
        check_context_length(chat_req, 100, 100)


def test_hostile_bytes_are_client_errors_not_crashes() -> None:
    """A JSON integer of more digits than Python converts, and an Authorization header that
    is not UTF-8 (aiohttp hands it over with surrogate escapes), are 400 and 401."""
    with pytest.raises(APIError) as info:
        decode_body(b'{"max_tokens": ' + b"9" * 5000 + b"}", "completion", 8)
    assert (info.value.status, info.value.param) == (400, "max_tokens")
    assert "out of range" in info.value.message
    with pytest.raises(APIError) as info:
        check_api_key({"Authorization": "Bearer \udcff\udcfe"}, ("key",))
    assert info.value.status == 401
