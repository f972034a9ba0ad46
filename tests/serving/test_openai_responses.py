"""Response and SSE shapes: the official openai client's models accept them, and the client
itself round-trips through a tiny aiohttp server built from our parse and build functions."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import openai
import pytest
from aiohttp import web
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from hetero_pd.serving.api.errors import APIError, check_api_key, parse_json_body
from hetero_pd.serving.api.protocol import parse_chat_request, parse_completion_request
from hetero_pd.serving.api.request import GenerateRequest
from hetero_pd.serving.api.responses import (
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    models_response,
    sse,
    sse_done,
    usage,
    usage_chunk,
)

DELTAS = ["Hel", "lo", " world"]


def completion_req(**fields: Any) -> GenerateRequest:
    return parse_completion_request({"model": "m", "prompt": "p", **fields})


def chat_req(**fields: Any) -> GenerateRequest:
    return parse_chat_request(
        {"model": "m", "messages": [{"role": "user", "content": "q"}], **fields}
    )


def test_completion_response_parses_as_openai_completion() -> None:
    req = completion_req()
    c = Completion.model_validate(completion_response(req, "Hello", "length", 3, 16))
    assert (c.id, c.object, c.model, c.created) == (
        req.request_id,
        "text_completion",
        "m",
        req.created,
    )
    assert (c.choices[0].text, c.choices[0].finish_reason, c.choices[0].index) == (
        "Hello",
        "length",
        0,
    )
    assert c.usage is not None and (c.usage.prompt_tokens, c.usage.total_tokens) == (3, 19)


def test_chat_response_parses_as_openai_chat_completion() -> None:
    req = chat_req()
    c = ChatCompletion.model_validate(chat_response(req, "Hi!", "stop", 5, 2))
    assert (c.id, c.object) == (req.request_id, "chat.completion")
    assert (c.choices[0].message.role, c.choices[0].message.content) == ("assistant", "Hi!")
    assert c.choices[0].finish_reason == "stop"
    assert c.usage is not None and c.usage.completion_tokens == 2


def test_chat_chunks_as_openai_streams_them() -> None:
    req = chat_req(stream=True, stream_options={"include_usage": True})
    first = chat_chunk(req, "", role="assistant")
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert first["usage"] is None  # every chunk but the last carries "usage": null
    middle = ChatCompletionChunk.model_validate(chat_chunk(req, "lo"))
    assert middle.choices[0].delta.content == "lo" and middle.choices[0].delta.role is None
    last = chat_chunk(req, None, finish_reason="stop")
    assert last["choices"][0]["delta"] == {} and last["choices"][0]["finish_reason"] == "stop"
    tail = ChatCompletionChunk.model_validate(usage_chunk(req, 4, 3))
    assert tail.choices == [] and tail.usage is not None and tail.usage.total_tokens == 7
    for chunk in (first, last):
        assert ChatCompletionChunk.model_validate(chunk).object == "chat.completion.chunk"
    assert "usage" not in chat_chunk(chat_req(stream=True), "x")  # without include_usage


def test_completion_chunks_parse_as_openai_completions() -> None:
    req = completion_req(stream=True, stream_options={"include_usage": True})
    done = completion_chunk(req, "", "stop")
    assert Completion.model_validate(done).choices[0].finish_reason == "stop"
    # The client reads stream events without validation: OpenAI's own mid-stream chunks have
    # "finish_reason": null, which the non-streaming model's Literal does not allow.
    chunk = completion_chunk(req, "Hel")
    assert chunk["choices"][0] == {
        "index": 0,
        "text": "Hel",
        "logprobs": None,
        "finish_reason": None,
    }
    assert chunk.keys() == done.keys() and chunk["id"] == req.request_id
    tail = Completion.model_validate(usage_chunk(req, 4, 3))
    assert tail.choices == [] and tail.usage is not None and tail.usage.prompt_tokens == 4


def test_models_response() -> None:
    body = models_response(["a", "b"], 1700000000)
    assert body["object"] == "list"
    models = [Model.model_validate(m) for m in body["data"]]
    assert [(m.id, m.owned_by, m.created) for m in models] == [
        ("a", "hetero-pd", 1700000000),
        ("b", "hetero-pd", 1700000000),
    ]


def test_sse_framing() -> None:
    assert sse({"a": 1, "b": "x y"}) == b'data: {"a":1,"b":"x y"}\n\n'
    assert sse("[DONE]") == sse_done() == b"data: [DONE]\n\n"
    assert sse("one\ntwo") == b"data: one\ndata: two\n\n"
    assert sse({"text": "line\nbreak"}) == b'data: {"text":"line\\nbreak"}\n\n'
    assert usage(2, 3) == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}


# --- the official client against a tiny server made of our functions --------------------

KEY = "sk-test"
SEEN = web.AppKey("seen", list)


async def _generate(request: web.Request, parse: Callable[[Any], GenerateRequest]) -> Any:
    try:
        check_api_key(request.headers, [KEY])
        req = parse(parse_json_body(await request.read()))
    except APIError as e:
        return web.json_response(e.to_json(), status=e.status)
    request.app[SEEN].append(req)
    chat = req.kind == "chat"
    n = len(DELTAS)
    if not req.stream:
        build = chat_response if chat else completion_response
        return web.json_response(build(req, "".join(DELTAS), "stop", 2, n))
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    if chat:
        await resp.write(sse(chat_chunk(req, "", role="assistant")))
    for delta in DELTAS:
        await resp.write(sse(chat_chunk(req, delta) if chat else completion_chunk(req, delta)))
    end = chat_chunk(req, None, finish_reason="stop") if chat else completion_chunk(req, "", "stop")
    await resp.write(sse(end))
    if req.include_usage:
        await resp.write(sse(usage_chunk(req, 2, n)))
    await resp.write(sse_done())
    return resp


async def _completions(request: web.Request) -> Any:
    return await _generate(request, parse_completion_request)


async def _chat(request: web.Request) -> Any:
    return await _generate(request, parse_chat_request)


async def _models(request: web.Request) -> web.Response:
    return web.json_response(models_response(["m"], 1700000000))


async def _with_client(body: Callable[[openai.AsyncOpenAI], Awaitable[None]]) -> list[Any]:
    app = web.Application()
    app[SEEN] = []
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_get("/v1/models", _models)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    client = openai.AsyncOpenAI(
        api_key=KEY, base_url=f"http://127.0.0.1:{port}/v1", max_retries=0, timeout=10
    )
    try:
        await body(client)
    finally:
        await client.close()
        await runner.cleanup()
    return app[SEEN]


def run_with_client(body: Callable[[openai.AsyncOpenAI], Awaitable[None]]) -> list[Any]:
    return asyncio.run(asyncio.wait_for(_with_client(body), timeout=30))


@pytest.mark.timeout(60)
def test_official_client_round_trip() -> None:
    async def body(client: openai.AsyncOpenAI) -> None:
        c = await client.completions.create(model="m", prompt="Hi", max_tokens=8, seed=1)
        assert c.choices[0].text == "Hello world" and c.usage is not None
        stream = await client.completions.create(
            model="m", prompt="Hi", stream=True, stream_options={"include_usage": True}
        )
        texts, usages = [], []
        async for chunk in stream:
            texts += [choice.text for choice in chunk.choices]
            usages += [chunk.usage] if chunk.usage else []
        assert "".join(texts) == "Hello world" and usages[0].completion_tokens == 3
        chat = await client.chat.completions.create(
            model="m",
            messages=[{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
            max_completion_tokens=4,
            temperature=0.5,
            top_p=0.5,
            stop=["\n"],
            extra_body={"top_k": 5, "priority": 2},
        )
        assert chat.choices[0].message.content == "Hello world"
        chunks = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "u"}], stream=True
        )
        parts = [ch.choices[0].delta.content async for ch in chunks if ch.choices]
        assert "".join(p for p in parts if p) == "Hello world"
        assert [m.id async for m in client.models.list()] == ["m"]

    seen = run_with_client(body)
    assert [r.kind for r in seen] == ["completion", "completion", "chat", "chat"]
    assert seen[0].params.max_tokens == 8 and seen[0].params.seed == 1
    assert seen[1].stream and seen[1].include_usage
    p = seen[2].params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.stop) == (4, 0.5, 0.5, 5, ["\n"])
    assert seen[2].priority == 2 and seen[2].messages is not None and len(seen[2].messages) == 2


@pytest.mark.timeout(60)
def test_official_client_raises_on_our_errors() -> None:
    async def body(client: openai.AsyncOpenAI) -> None:
        with pytest.raises(openai.BadRequestError) as info:
            await client.completions.create(model="m", prompt="Hi", suffix="!")
        assert info.value.status_code == 400 and info.value.param == "suffix"
        assert info.value.code == "unsupported_parameter"
        with pytest.raises(openai.BadRequestError, match="top_p"):
            await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "u"}], top_p=5
            )
        client = client.with_options(api_key="sk-wrong")
        with pytest.raises(openai.AuthenticationError):
            await client.completions.create(model="m", prompt="Hi")

    assert run_with_client(body) == []


def test_error_json_is_what_clients_read() -> None:
    err = APIError(400, "bad", param="x")
    assert json.loads(json.dumps(err.to_json()))["error"]["param"] == "x"
