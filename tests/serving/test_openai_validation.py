"""OpenAI request validation: each invalid field answered 400 naming it in `param`, and
features we cannot honour refused unless their value leaves the output unchanged."""

from __future__ import annotations

import json
from typing import Any

import pytest

from hetero_pd.serving.api.bodies import BodyKind, decode_body
from hetero_pd.serving.api.errors import APIError
from hetero_pd.serving.api.protocol import parse_chat_request, parse_completion_request

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


COMPLETION_CASES = [
    ({"model": None}, "model", "'model' is required"),
    ({"model": 3}, "model", "'model' is required"),
    ({"prompt": None}, "prompt", "'prompt' is required"),
    ({"prompt": ""}, "prompt", "'prompt' must not be empty"),
    ({"prompt": []}, "prompt", "'prompt' must not be empty"),
    ({"prompt": [1, -2]}, "prompt", "token ids must be integers >= 0, got -2"),
    ({"prompt": [1, True]}, "prompt", "token ids must be integers >= 0, got true"),
    ({"prompt": {"text": "x"}}, "prompt", "must be a string or a list of token ids"),
    ({"max_tokens": 0}, "max_tokens", "'max_tokens' must be >= 1, got 0"),
    ({"max_tokens": "16"}, "max_tokens", "'max_tokens' must be an integer, got \"16\""),
    ({"max_tokens": 2.5}, "max_tokens", "'max_tokens' must be an integer, got 2.5"),
    ({"temperature": "hot"}, "temperature", "'temperature' must be a finite number"),
    ({"temperature": True}, "temperature", "'temperature' must be a finite number"),
    ({"temperature": float("nan")}, "temperature", "'temperature' must be a finite number"),
    ({"temperature": -0.5}, "temperature", "temperature must be >= 0"),
    ({"top_p": 0}, "top_p", "top_p must be in (0, 1]"),
    ({"top_p": 1.5}, "top_p", "top_p must be in (0, 1]"),
    ({"top_k": -3}, "top_k", "top_k must be an integer >= 1"),
    ({"min_p": 2}, "min_p", "min_p must be in [0, 1]"),
    ({"seed": 2**64}, "seed", "seed must be an integer in"),
    ({"seed": "1"}, "seed", "'seed' must be an integer"),
    ({"stop": 5}, "stop", "'stop' must be a string or a list of strings"),
    ({"stop": ["ok", ""]}, "stop", "stop must contain only non-empty strings"),
    ({"stop_token_ids": 2}, "stop_token_ids", "'stop_token_ids' must be a list"),
    ({"stop_token_ids": [2, -1]}, "stop_token_ids", "integers >= 0, got -1"),
    ({"ignore_eos": "yes"}, "ignore_eos", "'ignore_eos' must be true or false"),
    ({"min_tokens": 20}, "min_tokens", "min_tokens must be <= max_tokens (16), got 20"),
    ({"stream": 1}, "stream", "'stream' must be true or false, got 1"),
    ({"stream_options": "yes"}, "stream_options", "'stream_options' must be an object"),
    (
        {"stream": True, "stream_options": {"include_usage": "y"}},
        "stream_options.include_usage",
        "'stream_options.include_usage' must be true or false",
    ),
    ({"priority": "high"}, "priority", "'priority' must be an integer"),
    ({"user": 7}, "user", "'user' must be a string"),
]


@pytest.mark.parametrize(("fields", "param", "words"), COMPLETION_CASES)
def test_invalid_completion_fields(fields: dict[str, Any], param: str, words: str) -> None:
    err = rejected(parse_completion_request, completion(**fields))
    assert err.param == param
    assert words in err.message


CHAT_CASES = [
    ({"messages": None}, "messages", "'messages' is required"),
    ({"messages": []}, "messages", "non-empty list"),
    ({"messages": ["hi"]}, "messages[0]", "must be an object with 'role' and 'content'"),
    ({"messages": [{"role": "bot", "content": "x"}]}, "messages[0].role", "must be one of"),
    ({"messages": [{"role": "user"}]}, "messages[0].content", "string or a list of text"),
    (
        {"messages": [*USER, {"role": "user", "content": [{"type": "image_url"}]}]},
        "messages[1].content[0].type",
        'only text content parts are supported, got "image_url"',
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]},
        "messages[0].content[0].text",
        "must be a string",
    ),
    (
        {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]},
        "messages[0].tool_calls[0]",
        '"arguments": a JSON string',
    ),
    (
        {"messages": [{"role": "user", "content": "x", "tool_calls": [{"id": "1"}]}]},
        "messages[0].tool_calls",
        "an assistant message's list of calls",
    ),
    ({"max_completion_tokens": 0}, "max_completion_tokens", "must be >= 1"),
    ({"max_tokens": -1}, "max_tokens", "must be >= 1"),
    ({"messages": USER * 2049}, "messages", "at most 2048"),
    (
        {"messages": [{"role": "user", "content": [{"type": "text", "text": ""}] * 257}]},
        "messages[0].content",
        "at most 256",
    ),
]


@pytest.mark.parametrize(("fields", "param", "words"), CHAT_CASES)
def test_invalid_chat_fields(fields: dict[str, Any], param: str, words: str) -> None:
    err = rejected(parse_chat_request, chat(**fields))
    assert err.param == param
    assert words in err.message


UNSUPPORTED = [
    ("suffix", "end"),
    ("functions", [{"name": "f"}]),
    ("use_beam_search", True),
]


@pytest.mark.parametrize(("name", "value"), UNSUPPORTED)
def test_unsupported_features_are_refused(name: str, value: Any) -> None:
    for parse, body in ((parse_completion_request, completion()), (parse_chat_request, chat())):
        err = rejected(parse, {**body, name: value})
        assert (err.param, err.code) == (name, "unsupported_parameter")
        assert err.message.startswith(f"'{name}' is not supported by this server")


NEUTRAL = [
    ("n", 1),
    ("best_of", 1),
    ("logprobs", False),
    ("top_logprobs", 0),
    ("echo", False),
    ("logit_bias", {}),
    ("tools", []),
    ("tool_choice", "none"),
    ("response_format", {"type": "text"}),
    ("presence_penalty", 0.0),
    ("frequency_penalty", 0),
    ("repetition_penalty", 1.0),
]


@pytest.mark.parametrize(("name", "value"), NEUTRAL)
def test_neutral_values_pass(name: str, value: Any) -> None:
    """A field given its neutral value is accepted and changes nothing."""
    for parse, body in ((parse_completion_request, completion), (parse_chat_request, chat)):
        assert parse(body(**{name: value})).params == parse(body()).params


@pytest.mark.parametrize("body", [None, [], "text", 3])
def test_body_must_be_an_object(body: Any) -> None:
    err = rejected(parse_completion_request, body)
    assert err.param is None and "must be a JSON object" in err.message


def test_sampling_fields_become_sampling_params() -> None:
    req = parse_completion_request(
        completion(n=2, best_of=2, logprobs=3, echo=True, logit_bias={"7": -100, "9": 2.5},
                   presence_penalty=0.5, frequency_penalty=-1, repetition_penalty=1.2)
    )  # fmt: skip
    p = req.params
    assert (p.n, p.logprobs, p.prompt_logprobs, p.logit_bias) == (2, 3, 3, {7: -100.0, 9: 2.5})
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -1.0, 1.2)
    assert req.echo
    assert parse_completion_request(completion(logprobs=0)).params.prompt_logprobs is None
    chat_req = parse_chat_request(chat(logprobs=True, top_logprobs=4))
    assert chat_req.params.logprobs == 4 and chat_req.params.prompt_logprobs is None
    assert parse_chat_request(chat(logprobs=True)).params.logprobs == 0
    assert parse_chat_request(chat(logprobs=False)).params.logprobs is None


@pytest.mark.parametrize(
    ("kind", "body", "param", "words"),
    [("completion", completion(**f), p, w) for f, p, w in COMPLETION_CASES]
    + [("chat", chat(**f), p, w) for f, p, w in CHAT_CASES]
    + [("chat", chat(**{name: value}), name, "not supported") for name, value in UNSUPPORTED],
)
def test_bodies_decoded_from_json_are_checked_alike(
    kind: BodyKind, body: dict[str, Any], param: str, words: str
) -> None:
    """The API decodes a body (`decode_body`, bounded) before these parsers see it: every
    field they read must come through, and be refused alike."""
    try:
        raw = json.dumps(body, allow_nan=False).encode()
    except ValueError:
        pytest.skip("not expressible in JSON")
    parse = parse_completion_request if kind == "completion" else parse_chat_request
    err = rejected(lambda raw: parse(decode_body(raw, kind, 1024)), raw)
    assert err.param == param and words in err.message


@pytest.mark.parametrize(("name", "value"), NEUTRAL)
def test_decoded_neutral_values_come_through(name: str, value: Any) -> None:
    for kind, body in (("completion", completion()), ("chat", chat())):
        raw = json.dumps({**body, name: value}).encode()
        assert decode_body(raw, kind, 1024)[name] == value  # type: ignore[arg-type]


def test_decoded_messages_are_capped_before_they_are_built() -> None:
    raw = json.dumps(chat(messages=[{}] * 100_000)).encode()
    with pytest.raises(APIError) as info:
        decode_body(raw, "chat", 1024)
    assert info.value.param == "messages" and "more than 2048 messages" in info.value.message
