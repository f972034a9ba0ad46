"""A request body costs the router what a valid value of each field needs, on every route
(issue 27: a request's cost bounded before Python walks it): 16 MiB of integers is refused
without a Python object made per element, counted in memory, not seconds (the router's
process traced while the app answers it); and a large body is decoded outside the router's
process, whose GIL the decoder would hold for tens of milliseconds per body (`bench
hostile` measures what /health waits meanwhile)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import tracemalloc
from typing import Any

import msgspec
import pytest
from aiohttp.test_utils import TestClient, TestServer

from hetero_pd import secrets
from hetero_pd.serving.api.app import create_app
from hetero_pd.serving.api.body_process import BodyDecoder
from hetero_pd.serving.api.errors import APIError
from hetero_pd.serving.api.state import ApiState
from hetero_pd.serving.control.auth import RouterKeys
from hetero_pd.serving.router.router import Router, RouterConfig

#: A body of 16 MiB (the API's limit) less what the rest of a request needs.
INTS = b"[" + b"1," * (8 * 2**20 - 256) + b"1]"
#: What the app may hold at once for one such body: the body as read, a copy or two (aiohttp
#: reads into a bytearray, then makes bytes). A list of its 8 million elements alone is 64 MiB.
PEAK_BYTES = 4 * len(INTS)


class Tokenizer:
    """Only what the refusals below read: the vocabulary's size."""

    def __len__(self) -> int:
        return 100


async def _answer(path: str, raw: bytes) -> tuple[int, dict[str, Any], int]:
    router = Router(RouterConfig(), RouterKeys.from_secret(secrets.generate().encode()))
    try:
        state = ApiState(router, Tokenizer(), ["m"], 64, 100)
        async with TestClient(TestServer(create_app(state))) as client:
            tracemalloc.start()
            try:
                resp = await client.post(path, data=raw)
                answer = await resp.json()
                _, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
            return resp.status, answer, peak
    finally:
        await router.close()


ROUTES = [
    ("/v1/completions", b'{"model": "m", "prompt": %s}', "prompt"),
    ("/tokenize", b'{"prompt": %s}', "prompt"),
    ("/detokenize", b'{"tokens": %s}', "tokens"),
    ("/v1/embeddings", b'{"model": "m", "input": %s}', "input[0]"),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("path", "body", "param"), ROUTES)
def test_16_mib_of_integers_is_refused_without_an_object_per_element(
    path: str, body: bytes, param: str
) -> None:
    raw = body % INTS
    status, answer, peak = asyncio.run(asyncio.wait_for(_answer(path, raw), 100))
    assert (status, answer["error"]["param"]) == (400, param), answer
    assert peak < PEAK_BYTES, f"{peak / 2**20:.0f} MiB held for a {len(raw) / 2**20:.0f} MiB body"


def decoded_sizes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The byte length of every JSON body msgspec decodes in this process from now on."""
    seen: list[int] = []
    decode = msgspec.json.decode

    def spy(buf: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(len(buf))
        return decode(buf, *args, **kwargs)

    monkeypatch.setattr(msgspec.json, "decode", spy)
    return seen


@pytest.mark.timeout(120)
def test_a_large_body_is_decoded_outside_the_routers_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each route's answer is the same 400 naming the field, and no JSON decode in this
    process (the router's) ever reads a megabyte: the spy sees only small decodes."""
    seen = decoded_sizes(monkeypatch)
    for path, body, param in ROUTES:
        status, answer, _ = asyncio.run(asyncio.wait_for(_answer(path, body % INTS), 100))
        assert (status, answer["error"]["param"]) == (400, param), answer
    assert max(seen, default=0) < 2**20, sorted(seen)[-5:]


@pytest.mark.timeout(120)
def test_a_killed_decoder_process_is_replaced() -> None:
    """The decoder process killed (an operator, the OOM killer) between two large bodies:
    the second is decoded by a new one, with the same answer."""

    async def scenario() -> list[tuple[int, Any]]:
        router = Router(RouterConfig(), RouterKeys.from_secret(secrets.generate().encode()))
        raw = b'{"tokens": %s}' % INTS
        seen = []
        try:
            state = ApiState(router, Tokenizer(), ["m"], 64, 100)
            async with TestClient(TestServer(create_app(state))) as client:
                for _ in range(2):
                    resp = await client.post("/detokenize", data=raw)
                    seen.append((resp.status, (await resp.json())["error"]["param"]))
                    pid = state.bodies.pid
                    assert pid is not None
                    os.kill(pid, signal.SIGKILL)  # the next body finds its pipe closed
        finally:
            await router.close()
        return seen

    assert asyncio.run(asyncio.wait_for(scenario(), 100)) == [(400, "tokens")] * 2


@pytest.mark.timeout(120)
def test_an_admin_body_is_refused_by_its_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """/admin/* bodies name a worker and a timeout: 16 MiB of one key repeated (~170 ms of
    msgspec, on the event loop for these routes) is refused by its length, never decoded. A
    deployment without keys lets anyone reach these routes."""
    seen = decoded_sizes(monkeypatch)
    raw = b'{"worker": "decode-0"' + b', "timeout_s": 1' * (len(INTS) // 16) + b"}"
    status, answer, _ = asyncio.run(asyncio.wait_for(_answer("/admin/drain", raw), 100))
    assert status == 413 and "at most" in answer["error"]["message"], answer
    assert max(seen, default=0) < 2**20, sorted(seen)[-5:]


#: An integer past 64 bits: JSON has no bound on one, msgpack (the decoder's replies) has.
WIDE = b"1" + b"0" * 30


@pytest.mark.timeout(120)
def test_a_wide_integer_gets_the_same_answer_from_the_decoder_process() -> None:
    """A body with an integer past 64 bits is answered alike small (decoded on the tokenizer
    thread) and large (by the decoder process): that process's replies are msgpack, which
    has no such integer, and it must neither die on one (twice: it is replaced and the body
    sent again) nor answer 503 for the client's 400."""
    body = b'{"model": "m", "prompt": "hi", "max_tokens": %s, "pad": "%s"}'
    small = asyncio.run(asyncio.wait_for(_answer("/v1/completions", body % (WIDE, b"")), 100))
    pad = b"a" * (2**20)  # an unknown field: skipped unread, but the body is large now
    large = asyncio.run(asyncio.wait_for(_answer("/v1/completions", body % (WIDE, pad)), 100))
    assert small[0] == 400 and small[1]["error"]["param"] == "max_tokens", small[1]
    assert large[:2] == small[:2]


@pytest.mark.timeout(120)
def test_a_deeply_nested_field_is_a_400_small_or_large() -> None:
    """A field nested as deep as JSON decoding allows (2 KB of brackets) is a 400 in
    OpenAI's shape, small or large: on the tokenizer thread the field's parser recursed
    (the repr of `stop` in its error: RecursionError, aiohttp's plain-text 500), and the
    decoder process's reply nests two levels deeper than the field, past what msgpack
    encodes, so that process died on it (twice: replaced, the body sent again) and the
    client got 503."""
    deep = b"[" * 990 + b"]" * 990
    body = b'{"model": "m", "prompt": "hi", "stop": %s, "pad": "%s"}'
    pad = b"a" * (2**20)  # an unknown field: skipped unread, but the body is large now
    for raw in (body % (deep, b""), body % (deep, pad)):
        status, answer, _ = asyncio.run(asyncio.wait_for(_answer("/v1/completions", raw), 100))
        assert status == 400 and "deeper" in answer["error"]["message"], (len(raw), answer)


@pytest.mark.timeout(120)
def test_a_stalled_decoder_process_is_replaced_past_its_deadline() -> None:
    """The decoder process stops answering (stopped, swapping, a body it is slow on): the
    body it holds is answered 503 once its deadline passes, not left waiting for ever with
    every large body queued behind it, and the next body gets a new process."""

    async def scenario() -> list[tuple[int, Any]]:
        router = Router(RouterConfig(), RouterKeys.from_secret(secrets.generate().encode()))
        raw = b'{"tokens": %s}' % (b"[" + b"1," * 2**17 + b"1]")  # 256 KiB: the child's
        seen, stopped = [], None
        try:
            state = ApiState(router, Tokenizer(), ["m"], 64, 100)
            async with TestClient(TestServer(create_app(state))) as client:
                for stall in (False, True, False):
                    if stall:
                        stopped = state.bodies.pid
                        assert stopped is not None
                        os.kill(stopped, signal.SIGSTOP)
                    state.bodies.deadline_s = 0.5 if stall else 60.0
                    resp = await asyncio.wait_for(client.post("/detokenize", data=raw), 30)
                    seen.append((resp.status, (await resp.json())["error"]["type"]))
                assert state.bodies.pid not in (None, stopped)
        finally:
            if stopped is not None:
                with contextlib.suppress(ProcessLookupError):  # the app's close reaped it
                    os.kill(stopped, signal.SIGKILL)
            await router.close()
        return seen

    answers = asyncio.run(asyncio.wait_for(scenario(), 100))
    bad = (400, "invalid_request_error")
    assert answers == [bad, (503, "server_error"), bad]


@pytest.mark.timeout(120)
def test_large_bodies_waiting_for_the_decoder_are_capped() -> None:
    """Large bodies wait for the decoder process one behind another: with it stalled, a
    client could queue body after body in the router's memory. Past the bytes allowed to
    wait, a body is answered at once, 503 with Retry-After naming the reason; those taken
    are answered as before (the stalled one 503 past its deadline, the next by a new
    process)."""

    async def scenario() -> list[tuple[int, str | None, str]]:
        router = Router(RouterConfig(), RouterKeys.from_secret(secrets.generate().encode()))
        raw = b'{"tokens": %s}' % (b"[" + b"1," * 2**17 + b"1]")  # 256 KiB: the child's
        stopped = None
        try:
            state = ApiState(router, Tokenizer(), ["m"], 64, 100)
            async with TestClient(TestServer(create_app(state))) as client:
                resp = await client.post("/detokenize", data=raw)  # starts the process
                assert resp.status == 400
                stopped = state.bodies.pid
                assert stopped is not None
                os.kill(stopped, signal.SIGSTOP)
                state.bodies.deadline_s = 2.0
                state.bodies.max_waiting_bytes = 2 * len(raw)  # one decoding, one waiting
                posts = [client.post("/detokenize", data=raw) for _ in range(3)]
                answers = await asyncio.gather(*posts)
                return [
                    (a.status, a.headers.get("Retry-After"), (await a.json())["error"]["message"])
                    for a in answers
                ]
        finally:
            if stopped is not None:
                with contextlib.suppress(ProcessLookupError):  # the deadline's kill reaped it
                    os.kill(stopped, signal.SIGKILL)
            await router.close()

    answers = asyncio.run(asyncio.wait_for(scenario(), 100))
    refused = [a for a in answers if a[1] is not None]
    assert len(refused) == 1, answers
    assert refused[0][0] == 503 and "waiting to be decoded" in refused[0][2], refused
    assert sorted(a[0] for a in answers if a[1] is None) == [400, 503], answers


@pytest.mark.timeout(120)
def test_a_body_whose_client_left_counts_until_it_leaves_the_queue() -> None:
    """The router cancels a request's handler when its client goes (handler_cancellation):
    its body still waits in the decoder's queue, so it still counts against the cap, or a
    client could send and leave, body after body, with none counted."""

    async def scenario() -> APIError:
        raw = b'{"tokens": %s}' % (b"[" + b"1," * 2**17 + b"1]")  # 256 KiB: the child's
        decoder = BodyDecoder(deadline_s=2.0)
        try:
            with contextlib.suppress(APIError):  # starts the process (the body: a 400)
                await decoder.prepare(raw, "detokenize", 64)
            assert decoder.pid is not None
            os.kill(decoder.pid, signal.SIGSTOP)
            decoder.max_waiting_bytes = 2 * len(raw)
            left = [asyncio.ensure_future(decoder.prepare(raw, "detokenize", 64)) for _ in "ab"]
            await asyncio.sleep(0)  # both taken: one on the pipe, one waiting
            for task in left:
                task.cancel()
            await asyncio.gather(*left, return_exceptions=True)
            with pytest.raises(APIError) as refused:
                await decoder.prepare(raw, "detokenize", 64)
            return refused.value
        finally:
            decoder.close()

    refused = asyncio.run(asyncio.wait_for(scenario(), 100))
    assert (refused.status, refused.code, refused.retry_after) == (503, "body_queue_full", 1.0)
