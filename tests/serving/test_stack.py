"""The real stack (router + 1 prefill + 1 decode worker process) through the official openai
client: outputs equal the single-process engine's, OpenAI's shapes and error codes, health,
metrics, and client disconnects that free every block on both workers."""

from __future__ import annotations

import asyncio
import http.client
import json
import time
import urllib.error
import urllib.request
from typing import Any

import aiohttp
import openai
import pytest

from hetero_pd import SamplingParams
from hetero_pd.config import resolve_dtype
from hetero_pd.deploy.testing import Stack, random_prompts

KEY = "k"  # the shared stack's (tests/serving/conftest.py)
DECISIONS = "hetero_pd_policy_decisions_total"
REQUESTS = "hetero_pd_requests_total"
#: Up to 32 prompt tokens are prefilled on the decode worker itself (conditional
#: disaggregation); longer prompts go through the prefill worker and a KV transfer.
SHORT, LONG = 20, 120


def greedy(max_tokens: int, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def stack(tiny_pd_stack: Stack) -> Stack:
    return tiny_pd_stack


@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key=KEY, max_retries=0, timeout=60)


def model(stack: Stack) -> str:
    return stack.dep.model


def raw_post(
    stack: Stack, path: str, body: bytes, key: str | None = KEY
) -> tuple[int, dict[str, Any]]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(stack.url + path, data=body, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


# -- outputs ---------------------------------------------------------------------------------
@pytest.mark.parametrize("length", [SHORT, LONG], ids=["local_prefill", "disaggregated"])
def test_completion_matches_engine(
    stack: Stack, client: openai.OpenAI, tiny_reference: Any, length: int
) -> None:
    prompt = random_prompts([length], seed=length)[0]
    r = client.completions.create(
        model=model(stack), prompt=prompt, max_tokens=12, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].text == tiny_reference.texts([prompt], greedy(12))[0]
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (length, 12)


@pytest.mark.parametrize("length", [SHORT, LONG], ids=["local_prefill", "disaggregated"])
def test_max_tokens_one_and_stop(
    stack: Stack, client: openai.OpenAI, tiny_reference: Any, length: int
) -> None:
    prompt = random_prompts([length], seed=100 + length)[0]
    one = client.completions.create(
        model=model(stack), prompt=prompt, max_tokens=1, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert one.choices[0].text == tiny_reference.texts([prompt], greedy(1))[0]
    assert one.usage is not None and one.usage.completion_tokens == 1
    # A stop string taken from the middle of the full greedy answer.
    full = tiny_reference.texts([prompt], greedy(24))[0]
    stop = next(full[i : i + 2] for i in range(4, len(full) - 2) if full[i : i + 2].strip())
    r = client.completions.create(
        model=model(stack), prompt=prompt, max_tokens=24, temperature=0, stop=[stop],
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    expected = tiny_reference.texts([prompt], greedy(24, stop=[stop]))[0]
    assert r.choices[0].text == expected == full[: full.index(stop)]
    assert r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("length", [SHORT, LONG], ids=["local_prefill", "disaggregated"])
def test_seeded_sampling_matches_engine(
    stack: Stack, client: openai.OpenAI, tiny_reference: Any, length: int
) -> None:
    prompt = random_prompts([length], seed=200 + length)[0]

    def sample(seed: int) -> str:
        r = client.completions.create(
            model=model(stack), prompt=prompt, max_tokens=16, temperature=1.0, top_p=0.9,
            seed=seed, extra_body={"ignore_eos": True},
        )  # fmt: skip
        return r.choices[0].text

    params = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True)
    expected = tiny_reference.texts([prompt], params)[0]
    assert sample(7) == expected
    assert sample(7) == expected
    assert sample(8) != expected


def test_streamed_completion_with_usage(
    stack: Stack, client: openai.OpenAI, tiny_reference: Any
) -> None:
    prompt = random_prompts([LONG], seed=3)[0]
    stream = client.completions.create(
        model=model(stack), prompt=prompt, max_tokens=20, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == tiny_reference.texts([prompt], greedy(20))[0]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (LONG, 20)
    assert all(c.usage is None for c in chunks[:-1])


def test_concurrent_greedy_equals_engine(stack: Stack, tiny_reference: Any) -> None:
    """16 requests at once, mixed lengths (prefilled locally and disaggregated, chunked
    prefill above 512 tokens): every text equals the single-process engine's."""
    lengths = [3, 9, 17, 25, 31, 32, 33, 47, 64, 90, 128, 200, 257, 400, 513, 700]
    prompts = random_prompts(lengths, seed=11)
    max_tokens = [8 + (i * 5) % 17 for i in range(len(prompts))]
    expected = tiny_reference.texts(prompts, [greedy(n) for n in max_tokens])
    before = stack.metrics()

    async def run() -> list[str]:
        client = openai.AsyncOpenAI(base_url=stack.base_url, api_key=KEY, max_retries=0)
        async with client:
            rs = await asyncio.gather(*(
                client.completions.create(
                    model=model(stack), prompt=p, max_tokens=n, temperature=0,
                    extra_body={"ignore_eos": True},
                )
                for p, n in zip(prompts, max_tokens, strict=True)
            ))  # fmt: skip
        return [r.choices[0].text for r in rs]

    assert asyncio.run(asyncio.wait_for(run(), 60)) == expected
    after = stack.metrics()
    local = sum(n <= 32 for n in lengths)
    assert delta(before, after, DECISIONS, decision="local_prefill") == local
    assert delta(before, after, DECISIONS, decision="disaggregated") == len(lengths) - local
    assert delta(before, after, DECISIONS, decision="recompute") == 0
    assert delta(before, after, "hetero_pd_kv_transfer_bytes_total", transport="kv") > 0
    stack.wait_idle()


def delta(before: str, after: str, name: str, **labels: str) -> float:
    from hetero_pd.deploy.testing import metric_value

    return metric_value(after, name, **labels) - metric_value(before, name, **labels)


# -- errors in OpenAI's shape ----------------------------------------------------------------
def test_bad_parameters_are_400(stack: Stack, client: openai.OpenAI) -> None:
    prompt = random_prompts([8], seed=5)[0]
    cases: list[tuple[dict[str, Any], str | None]] = [
        ({"temperature": -1}, "temperature"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2000}, "prompt"),  # beyond max_model_len (1024)
    ]
    for extra, param in cases:
        kwargs: dict[str, Any] = {"max_tokens": 4, **extra}
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=model(stack), prompt=prompt, **kwargs)
        err = info.value.response.json()["error"]
        assert info.value.status_code == 400, extra
        assert err["type"] == "invalid_request_error" and err["param"] == param, err
        assert err["message"]
    # Ids the model has no embedding for, given directly or produced by the tokenizer.
    for prompt_in in ([1, 2, 600], "a text prompt tokenized beyond the tiny vocabulary"):
        with pytest.raises(openai.BadRequestError, match="outside the model's vocabulary"):
            client.completions.create(model=model(stack), prompt=prompt_in, max_tokens=4)
    status, body = raw_post(stack, "/v1/completions", b"{not json")
    assert status == 400 and body["error"]["type"] == "invalid_request_error"


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="no-such-model", prompt=[1, 2, 3], max_tokens=2)
    err = info.value.response.json()["error"]
    assert err["code"] == "model_not_found" and err["param"] == "model"


def test_unknown_route_is_404_json(stack: Stack) -> None:
    status, body = raw_post(stack, "/v1/no-such-route", b"{}")
    assert status == 404 and body["error"]["type"] == "not_found_error"


def test_api_key_is_required(stack: Stack) -> None:
    bad = openai.OpenAI(base_url=stack.base_url, api_key="wrong-key", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError) as info:
        bad.completions.create(model=model(stack), prompt=[1, 2, 3], max_tokens=2)
    assert info.value.status_code == 401
    assert info.value.response.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    body = json.dumps({"model": model(stack), "prompt": [1, 2], "max_tokens": 2}).encode()
    status, err = raw_post(stack, "/v1/completions", body, key=None)
    assert status == 401 and err["error"]["type"] == "authentication_error"


def test_an_authorization_header_that_is_not_utf8_is_a_401(stack: Stack) -> None:
    """It was an unauthenticated 500 with a traceback (the key check encoded it as UTF-8)."""
    host, port = stack.url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        for path in ("/v1/models", "/metrics"):
            conn.putrequest("GET", path)
            conn.putheader("Authorization", b"Bearer \xff\xfe\x80")
            conn.endheaders()
            resp = conn.getresponse()
            body = json.loads(resp.read())
            assert resp.status == 401, body
            assert body["error"]["type"] == "authentication_error"
    finally:
        conn.close()


# -- models, health, metrics -----------------------------------------------------------------
def test_models_health_metrics(stack: Stack, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [model(stack)]
    with urllib.request.urlopen(f"{stack.url}/health", timeout=10) as resp:
        assert json.loads(resp.read()) == {"status": "ok"}  # no detail without the key
    req = urllib.request.Request(f"{stack.url}/health", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        health = json.loads(resp.read())
    assert health["status"] == "ok"
    assert {w: (v["role"], v["alive"]) for w, v in health["workers"].items()} == {
        "prefill-0": ("prefill", True),
        "decode-0": ("decode", True),
    }
    want = resolve_dtype(stack.dep.dtype, "cpu", "float32")  # what each worker resolved
    for v in health["workers"].values():
        assert v["dtype"] == {"name": want.name, "reason": want.reason}
    client.completions.create(model=model(stack), prompt=[5, 6, 7], max_tokens=2)
    text = stack.metrics()
    for name in (
        "hetero_pd_time_to_first_token_seconds_bucket",
        "hetero_pd_time_per_output_token_seconds_bucket",
        "hetero_pd_e2e_request_latency_seconds_bucket",
        "hetero_pd_worker_queue_depth",
        "hetero_pd_worker_kv_usage_ratio",
        "hetero_pd_kv_transfer_seconds_bucket",
    ):
        assert f"\n{name}" in text, name
    for worker_id, role in (("prefill-0", "prefill"), ("decode-0", "decode")):
        assert stack.metric("hetero_pd_worker_up", worker=worker_id, role=role) == 1.0
    assert stack.metric("hetero_pd_time_to_first_token_seconds_count") >= 1
    assert stack.metric(REQUESTS, outcome="length") >= 1


# -- client disconnects ----------------------------------------------------------------------
def test_client_disconnects_free_blocks_on_both_workers(stack: Stack) -> None:
    """Streams cut after two chunks and non-streamed requests whose client gives up: each
    aborts on the prefill and the decode worker, and both end with no block in use."""
    before = stack.metric(REQUESTS, outcome="abort")
    prompts = random_prompts([LONG, 300, 64, 500, 40, 200], seed=21)

    async def cut_stream(session: aiohttp.ClientSession, prompt: list[int]) -> None:
        body = {
            "model": model(stack), "prompt": prompt, "max_tokens": 1024 - len(prompt),
            "stream": True, "ignore_eos": True,
        }  # fmt: skip
        async with session.post(f"{stack.base_url}/completions", json=body) as resp:
            assert resp.status == 200
            seen = 0
            async for line in resp.content:
                seen += line.startswith(b"data: {")
                if seen == 2:
                    break  # leaving the block closes the connection

    async def read_all(session: aiohttp.ClientSession, prompt: list[int]) -> None:
        body = {
            "model": model(stack), "prompt": prompt, "max_tokens": 1024 - len(prompt),
            "ignore_eos": True,
        }  # fmt: skip
        async with session.post(f"{stack.base_url}/completions", json=body) as resp:
            await resp.read()

    assert stack.router is not None
    decode = stack.router.workers["decode-0"]

    async def run() -> None:
        headers = {"Authorization": f"Bearer {KEY}"}
        async with aiohttp.ClientSession(headers=headers) as session:
            # Non-streamed: the client gives up once the router has them in flight.
            waiting = [asyncio.create_task(read_all(session, p)) for p in prompts[2:]]
            while len(decode.inflight) < len(waiting):
                assert not any(t.done() for t in waiting), "finished before it was cut"
                await asyncio.sleep(0.005)
            for task in waiting:
                task.cancel()
            await asyncio.gather(*waiting, return_exceptions=True)
            # Streamed: cut after two chunks.
            await asyncio.gather(cut_stream(session, prompts[0]), cut_stream(session, prompts[1]))

    asyncio.run(asyncio.wait_for(run(), 30))
    stack.wait_idle(timeout_s=20)
    # Each disconnect ended as an abort, none ran to its end unnoticed.
    deadline = time.monotonic() + 10
    while (aborts := stack.metric(REQUESTS, outcome="abort")) < before + len(prompts):
        outcomes = {o: stack.metric(REQUESTS, outcome=o) for o in ("length", "abort", "error")}
        assert time.monotonic() < deadline, f"aborts: {before} before, now {outcomes}"
        time.sleep(0.05)
    assert aborts == before + len(prompts)
