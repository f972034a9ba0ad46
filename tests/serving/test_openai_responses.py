"""Response and SSE shapes: the official openai client's models accept them, and the client
itself round-trips through the real app (`create_app`) over a real router and worker."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import pytest
from aiohttp import web
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from hetero_pd import SamplingParams, secrets
from hetero_pd.config import EngineConfig
from hetero_pd.models.tokenizer import load_tokenizer
from hetero_pd.serving.api.app import create_app
from hetero_pd.serving.api.errors import APIError
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
from hetero_pd.serving.api.state import ApiState
from hetero_pd.serving.control.auth import RouterKeys
from hetero_pd.serving.router.router import Router, RouterConfig
from hetero_pd.serving.worker.config import WorkerConfig
from hetero_pd.serving.worker.main import Worker


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
    # UTF-8, not \uXXXX escapes; U+2028 is no SSE line break (only CR and LF are).
    assert sse({"t": "é🎉\u2028"}) == 'data: {"t":"é🎉\u2028"}\n\n'.encode()
    want = b'data: {"lp":-9999.0,"n":null,"ok":true}\n\n'
    assert sse({"lp": -9999.0, "n": None, "ok": True}) == want
    assert usage(2, 3) == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}


# --- the official client against the real app: a real router and an in-process worker ---

KEY = "sk-test"
MODEL = "m"


@dataclass(slots=True)
class Served:
    """What a test's app handed the router: (prompt ids, sampling params, priority) each."""

    client: openai.AsyncOpenAI
    seen: list[tuple[list[int], SamplingParams, int]] = field(default_factory=list)


@pytest.fixture(scope="module")
def worker(chat_model: Path) -> Iterator[tuple[Worker, bytes]]:
    """One colocated worker (the tiny chat model, float32) on a thread of this process: a
    real engine behind a real control endpoint, without a process to start."""
    secret = secrets.generate().encode()
    engine = EngineConfig(model=str(chat_model), dtype="float32", num_threads=1, num_kv_blocks=64)
    credential = secrets.WorkerCredential.for_worker(secret, "both-0")
    w = Worker(WorkerConfig("both-0", "both", engine), credential)
    thread = threading.Thread(target=w.serve_forever, name="test-worker", daemon=True)
    thread.start()
    try:
        yield w, secret
    finally:
        w.stopped = True
        thread.join(10)
        w.close()


async def _with_client(
    worker: tuple[Worker, bytes], model_dir: Path, body: Callable[[Served], Awaitable[None]]
) -> Served:
    """`create_app` as `serve` builds it, over a router linked to `worker`, on a free port;
    `body` drives it with the official async client."""
    w, secret = worker
    router = Router(RouterConfig(), RouterKeys.from_secret(secret))
    runner: web.AppRunner | None = None
    client: openai.AsyncOpenAI | None = None
    try:
        await router.add_worker(w.worker_id, w.address, 30)
        info = router.workers[w.worker_id].info
        state = ApiState(
            router,
            load_tokenizer(model_dir),
            [MODEL],
            info.max_model_len,
            info.vocab_size,
            (KEY,),
            priority_keys=(KEY,),
        )
        runner = web.AppRunner(create_app(state))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        client = openai.AsyncOpenAI(
            api_key=KEY, base_url=f"http://127.0.0.1:{port}/v1", max_retries=0, timeout=30
        )
        served = Served(client)
        generate = router.generate

        def spy(
            rid: str, ids: list[int], params: SamplingParams, priority: int = 0, **kw: Any
        ) -> Any:
            served.seen.append((list(ids), params, priority))
            return generate(rid, ids, params, priority, **kw)

        router.generate = spy  # type: ignore[method-assign]
        await body(served)
        return served
    finally:
        if client is not None:
            await client.close()
        if runner is not None:
            await runner.cleanup()
        await router.close()


def run_with_client(
    worker: tuple[Worker, bytes], model_dir: Path, body: Callable[[Served], Awaitable[None]]
) -> Served:
    return asyncio.run(asyncio.wait_for(_with_client(worker, model_dir, body), timeout=60))


@pytest.mark.timeout(90)
def test_official_client_round_trip(
    worker: tuple[Worker, bytes], chat_model: Path, hf_greedy: Callable[..., list[int]]
) -> None:
    """Completions and chat, whole and streamed, through the real app: greedy text is
    transformers' for the same prompt, and the app hands the router what the client sent."""
    tok = load_tokenizer(chat_model)
    prompt = tok.encode("Hi")
    text = tok.decode(hf_greedy(chat_model, prompt, 8))
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    chat_prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    chat_ids = tok.encode(chat_prompt, add_special_tokens=False)
    chat_text = tok.decode(hf_greedy(chat_model, chat_ids, 6))
    greedy: dict[str, Any] = {"temperature": 0, "extra_body": {"ignore_eos": True}}

    async def body(served: Served) -> None:
        client = served.client
        c = await client.completions.create(
            model=MODEL, prompt="Hi", max_tokens=8, seed=1, **greedy
        )
        assert c.choices[0].text == text and c.choices[0].finish_reason == "length"
        assert c.usage is not None
        assert (c.usage.prompt_tokens, c.usage.completion_tokens) == (len(prompt), 8)
        stream = await client.completions.create(
            model=MODEL,
            prompt="Hi",
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
            **greedy,
        )
        texts, usages = [], []
        async for chunk in stream:
            texts += [choice.text for choice in chunk.choices]
            usages += [chunk.usage] if chunk.usage else []
        assert "".join(texts) == text and len(texts) > 1
        assert [u.completion_tokens for u in usages] == [8]
        chat = await client.chat.completions.create(
            model=MODEL,
            messages=messages,  # type: ignore[arg-type]
            max_completion_tokens=4,
            temperature=0.5,
            top_p=0.5,
            stop=["\n"],
            extra_body={"top_k": 5, "priority": 2},
        )
        assert isinstance(chat.choices[0].message.content, str)
        assert chat.choices[0].message.role == "assistant"
        assert chat.usage is not None and 1 <= chat.usage.completion_tokens <= 4
        chunks = await client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=6,
            stream=True,
            **greedy,  # type: ignore[arg-type]
        )
        deltas = [ch.choices[0].delta async for ch in chunks if ch.choices]
        assert deltas[0].role == "assistant"
        assert "".join(d.content or "" for d in deltas) == chat_text
        assert [m.id async for m in client.models.list()] == [MODEL]

    seen = run_with_client(worker, chat_model, body).seen
    assert [ids for ids, _, _ in seen] == [prompt, prompt, chat_ids, chat_ids]
    assert seen[0][1].max_tokens == 8 and seen[0][1].seed == 1
    p, priority = seen[2][1], seen[2][2]
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.stop) == (4, 0.5, 0.5, 5, ["\n"])
    assert priority == 2


@pytest.mark.timeout(90)
def test_official_client_raises_on_our_errors(
    worker: tuple[Worker, bytes], chat_model: Path
) -> None:
    async def body(served: Served) -> None:
        client = served.client
        with pytest.raises(openai.BadRequestError) as info:
            await client.completions.create(model=MODEL, prompt="Hi", suffix="!")
        assert info.value.status_code == 400 and info.value.param == "suffix"
        assert info.value.code == "unsupported_parameter"
        with pytest.raises(openai.BadRequestError, match="top_p"):
            await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "u"}], top_p=5
            )
        wrong = client.with_options(api_key="sk-wrong")
        with pytest.raises(openai.AuthenticationError):
            await wrong.completions.create(model=MODEL, prompt="Hi")

    assert run_with_client(worker, chat_model, body).seen == []


def test_error_json_is_what_clients_read() -> None:
    err = APIError(400, "bad", param="x")
    assert json.loads(json.dumps(err.to_json()))["error"]["param"] == "x"
