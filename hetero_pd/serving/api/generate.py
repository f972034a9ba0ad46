"""POST /v1/completions and /v1/chat/completions: parse, tokenize off the event loop, admit,
run through the router, and answer as one body or as Server-Sent Events."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from hetero_pd.serving.api import errors, responses
from hetero_pd.serving.api import protocol as oai
from hetero_pd.serving.api.bodies import Body, BodyKind, fields_of
from hetero_pd.serving.api.choices import Answer, Batch
from hetero_pd.serving.api.edge_protocol import PATH as EDGE_PATH
from hetero_pd.serving.api.request import GenerateRequest
from hetero_pd.serving.api.state import ApiState, api_error, state_of
from hetero_pd.serving.router.router import RouterError

log = logging.getLogger("hetero_pd.api")


@dataclass(slots=True)
class _Timing:
    start: float = field(default_factory=time.perf_counter)
    first: float | None = None
    last: float | None = None
    gaps: list[float] = field(default_factory=list)

    def token(self) -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        elif self.last is not None:
            self.gaps.append(now - self.last)
        self.last = now


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "completion", oai.parse_completion_request)


async def chat(request: web.Request) -> web.StreamResponse:
    tools = state_of(request).tools
    return await _generate(request, "chat", functools.partial(oai.parse_chat_request, tools=tools))


def _prompt_ids(state: ApiState, req: GenerateRequest) -> list[int]:
    ids = _tokenize(state, req)
    # Also for text: a tokenizer may know more tokens than the model has embeddings.
    bad = [t for t in ids if not 0 <= t < state.vocab_size]
    if bad:
        where = "the prompt's token ids" if req.prompt_token_ids is not None else "the tokenizer"
        raise errors.bad_request(
            f"token ids {bad[:5]} from {where} are outside the model's vocabulary "
            f"[0, {state.vocab_size})",
            "messages" if req.kind == "chat" else "prompt",
        )
    return ids


def _tokenize(state: ApiState, req: GenerateRequest) -> list[int]:
    tok = state.tokenizer
    if req.kind == "chat":
        if not getattr(tok, "chat_template", None):
            raise errors.bad_request(
                "this model has no chat template; use /v1/completions", "messages"
            )
        assert req.messages is not None
        _check_chars(state, sum(len(m["content"]) for m in req.messages), "messages")
        messages, kw = req.messages, {}
        if req.tools is not None:  # the template renders tools, or a system prompt lists them
            if "tools" in tok.chat_template:
                kw["tools"] = req.tools.tools
            else:
                messages = req.tools.with_system_prompt(messages)
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kw)
        return list(tok.encode(text, add_special_tokens=False))
    if req.prompt_token_ids is not None:
        return list(req.prompt_token_ids)
    assert req.prompt is not None
    _check_chars(state, len(req.prompt), "prompt")
    return list(tok.encode(req.prompt))


def _check_chars(state: ApiState, chars: int, param: str) -> None:
    """A text longer than this cannot fit, whatever it tokenizes to: refuse it before
    spending seconds of tokenizer time on it."""
    if state.max_prompt_chars and chars > state.max_prompt_chars:
        raise errors.bad_request(
            f"This model's maximum context length is {state.max_model_len} tokens; the "
            f"{param} has {chars} characters, more than any {state.max_model_len} tokens "
            f"can hold ({state.max_prompt_chars})",
            param,
            "context_length_exceeded",
        )


def _parse(
    state: ApiState,
    body: Body,
    kind: BodyKind,
    parse: Callable[[Any], GenerateRequest],
    key: str,
) -> GenerateRequest:
    """Decodes (bounded, unless the decoder process did) and validates a request, on the
    tokenizer thread."""
    req = parse(fields_of(body, kind, state.max_model_len))
    if req.model not in state.model_names:
        raise errors.model_not_found(req.model)
    oai.check_sampling_limits(req.params, state.vocab_size)
    if req.priority:
        if key not in state.priority_keys:
            raise errors.bad_request(
                "'priority' may be set only with an API key the deployment allows to "
                "(router.priority_api_keys); leave it out or 0 with this key",
                "priority",
            )
        req.priority = max(-oai.PRIORITY_LIMIT, min(oai.PRIORITY_LIMIT, req.priority))
    choices = _choices(req)
    largest = state.router.admission.largest
    if choices > largest:
        raise errors.bad_request(
            f"this request asks for {choices} completions ({len(req.batch) or 1} prompts x "
            f"n={req.params.n}); at most {largest} may be in flight for one API key",
            "n",
        )
    return req


def _choices(req: GenerateRequest) -> int:
    """The completions a request asks for: what it holds of the in-flight limits."""
    return (len(req.batch) or 1) * req.params.n


def _tokenize_prompts(
    state: ApiState, req: GenerateRequest
) -> list[tuple[GenerateRequest, list[int]]]:
    """Each of a request's prompts (one, or a completions batch) with its token ids, on the
    tokenizer thread."""
    prompts = []
    for one in req.each_prompt():
        prompt_ids = _prompt_ids(state, one)
        max_tokens = oai.check_context_length(one, len(prompt_ids), state.max_model_len)
        if one.params.max_tokens is None:  # chat: one prompt
            one.params.max_tokens = max_tokens
        if one.echo:
            one.echo_text = one.prompt or state.tokenizer.decode(prompt_ids)
        prompts.append((one, prompt_ids))
    return prompts


async def _generate(
    request: web.Request, kind: BodyKind, parse: Callable[[Any], GenerateRequest]
) -> web.StreamResponse:
    state = state_of(request)
    key = errors.check_api_key(request.headers, state.api_keys)
    raw = await state.reads.read(request)
    split = state.router.split_info()
    if split is not None:
        raise errors.bad_request(
            f"this deployment's workers run layers [{split[0]}, L) of the model for edge "
            f"devices: connect with the edge client SDK (edge.EdgeClient) at {EDGE_PATH}",
            code="edge_only",
        )
    body = await state.bodies.prepare(raw, kind, state.max_model_len)
    loop = asyncio.get_running_loop()
    req = await loop.run_in_executor(state.tokenize_pool, _parse, state, body, kind, parse, key)
    # Admitted before the tokenizer spends time on it; the slots come back however it ends.
    try:
        slots = state.router.admission.admit(key, _choices(req))
    except RouterError as e:
        _observe(state, _Timing(), 0, 0, _outcome(e))
        raise
    try:
        prompts = await loop.run_in_executor(state.tokenize_pool, _tokenize_prompts, state, req)
        return await _answer(request, state, req, prompts)
    finally:
        slots.release()


async def _answer(
    request: web.Request,
    state: ApiState,
    req: GenerateRequest,
    prompts: list[tuple[GenerateRequest, list[int]]],
) -> web.StreamResponse:
    decode = _decoder(state.tokenizer)
    n = req.params.n
    answers = [
        Answer(one, ids, decode, one.echo_text, i * n) for i, (one, ids) in enumerate(prompts)
    ]
    # aclosing: however the handler ends (a client disconnect cancels it wherever it is
    # awaiting), the router's generators are closed now, so their aborts reach the workers.
    async with contextlib.AsyncExitStack() as closing:
        streams = []
        for i, (one, ids) in enumerate(prompts):
            rid = req.request_id if len(prompts) == 1 else f"{req.request_id}-{i}"
            gen = state.router.generate(rid, ids, one.params, one.priority, admitted=True)
            streams.append(await closing.enter_async_context(contextlib.aclosing(gen)))
        batch = Batch(answers)
        merged = await closing.enter_async_context(contextlib.aclosing(batch.merge(streams)))
        if req.stream:
            return await _stream(request, state, req, merged, batch)
        return await _collect(state, merged, batch)


def _decoder(tokenizer: Any) -> Callable[[int], str]:
    """One token's text, as logprobs show it (remembered: alternatives repeat)."""
    return functools.cache(lambda token: tokenizer.decode([token]))


def _outcome(e: RouterError) -> str:
    return "rejected" if e.status == 429 else "error"


def _observe(state: ApiState, timing: _Timing, prompt: int, gen: int, outcome: str) -> None:
    end = time.perf_counter()
    ttft = timing.first - timing.start if timing.first is not None else None
    tpot = None
    if timing.first is not None and gen > 1:
        tpot = (end - timing.first) / (gen - 1)
    e2e = end - timing.start if outcome in ("stop", "length") else None
    state.router.metrics.observe_request(ttft, tpot, timing.gaps, e2e, prompt, gen, outcome)


async def _collect(state: ApiState, stream: Any, batch: Batch) -> web.Response:
    timing = _Timing()
    outcome = "abort"
    try:
        async for answer, msg in stream:
            timing.token()
            answer.add(msg)
        finish = batch.finish
        outcome = finish if finish in ("stop", "length") else "abort"
    except RouterError as e:
        outcome = _outcome(e)
        raise
    finally:
        _observe(state, timing, batch.prompt_tokens, batch.completion_tokens, outcome)
    return web.json_response(batch.body())


async def _stream(
    request: web.Request,
    state: ApiState,
    req: GenerateRequest,
    stream: Any,
    batch: Batch,
) -> web.StreamResponse:
    timing = _Timing()
    outcome = "abort"
    resp: _Stream | None = None
    try:
        async for answer, msg in stream:
            if resp is None:
                # Headers go out with the first token, so an early failure can still be a
                # proper HTTP error status.
                resp = await _Stream.open(request, state)
                for event in batch.first_events():
                    await resp.write(responses.sse(event))
            timing.token()
            for event in answer.events(msg):
                await resp.write(responses.sse(event))
        finish = batch.finish
        outcome = finish if finish in ("stop", "length") else "abort"
        if resp is None:
            resp = await _Stream.open(request, state)
        if req.include_usage:
            usage = responses.usage_chunk(req, batch.prompt_tokens, batch.completion_tokens)
            await resp.write(responses.sse(usage))
        await resp.write(responses.sse_done())
        await resp.response.write_eof()
        return resp.response
    except RouterError as e:
        outcome = _outcome(e)
        if resp is None:
            raise
        await resp.write(responses.sse(api_error(e).to_json()))
        await resp.write(responses.sse_done())
        return resp.response
    except (ConnectionResetError, _SlowReader) as e:
        # The client went away, or stopped reading: an abort, not a server error (aiohttp
        # would log a traceback for a raised one); the router's generator is closed by the
        # caller, which aborts the request on the workers.
        if isinstance(e, _SlowReader):
            log.warning("request %s: %s", req.request_id, e)
            if request.transport is not None:
                request.transport.abort()
        outcome = "abort"
        return resp.response if resp is not None else web.StreamResponse()
    except asyncio.CancelledError:
        outcome = "abort"
        raise
    finally:
        _observe(state, timing, batch.prompt_tokens, batch.completion_tokens, outcome)


class _SlowReader(Exception):
    """A streaming client did not take a chunk within the write timeout."""


@dataclass(slots=True)
class _Stream:
    """An SSE response whose writes give up on a client that stops reading."""

    response: web.StreamResponse
    timeout_s: float

    @classmethod
    async def open(cls, request: web.Request, state: ApiState) -> _Stream:
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        transport = request.transport
        sock = transport.get_extra_info("socket") if transport is not None else None
        if sock is not None and state.stream_sndbuf_bytes:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, state.stream_sndbuf_bytes)
        return cls(resp, state.write_timeout_s)

    async def write(self, data: bytes) -> None:
        try:
            async with asyncio.timeout(self.timeout_s):
                await self.response.write(data)
        except TimeoutError:
            raise _SlowReader(
                f"the client took no data for {self.timeout_s}s; the request is aborted"
            ) from None
