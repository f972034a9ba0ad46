"""A hostile or careless client can fail its own request, never a worker or the router:
token ids outside the vocabulary, integers past every range, lone surrogates, deeply nested
JSON, floods of stop strings, prompts of megabytes, and streaming clients that stop
reading."""

from __future__ import annotations

import gzip
import http.client
import json
import select
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from hetero_pd.bench.hostile import start_posts
from hetero_pd.deploy.testing import Probe, Stack, deployment, running_stack, wait_gone


@pytest.fixture(scope="module")
def stack(tiny_llama_dir: Path) -> Iterator[Stack]:
    dep = deployment(tiny_llama_dir, router={"write_timeout_s": 1.0})
    with running_stack(dep) as s:
        yield s


def post(stack: Stack, path: str, body: bytes | dict[str, Any]) -> tuple[int, dict[str, Any]]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(
        f"{stack.url}{path}", data=data, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def completion(stack: Stack, **fields: Any) -> dict[str, Any]:
    return {"model": stack.dep.model, "prompt": [1, 2, 3], "max_tokens": 4, **fields}


def assert_400(stack: Stack, body: bytes | dict[str, Any], param: str | None) -> str:
    status, answer = post(stack, "/v1/completions", body)
    assert status == 400, answer
    assert answer["error"]["param"] == param, answer
    return str(answer["error"]["message"])


def test_stop_ids_outside_the_vocabulary_never_reach_a_worker(stack: Stack) -> None:
    """Each of these once killed the decode worker (the sampler indexed the logits out of
    range); more of them than the supervisor's restart budget left it down for good."""
    pids = dict(stack.launcher.pids()) if stack.launcher else {}
    budget = stack.dep.supervisor.max_restarts
    for _ in range(budget + 3):
        message = assert_400(
            stack, completion(stack, stop_token_ids=[1_000_000], min_tokens=1), "stop_token_ids"
        )
        assert "vocabulary" in message
    assert_400(stack, completion(stack, stop_token_ids=[2**64]), "stop_token_ids")
    assert_400(stack, completion(stack, top_k=2**70), "top_k")
    assert_400(stack, completion(stack, seed=2**64), "seed")
    assert stack.launcher is not None and stack.launcher.pids() == pids
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0)
    # ignore_eos: a sampled EOS would end the answer early (the default temperature is 1).
    r = client.completions.create(
        model=stack.dep.model, prompt=[1, 2, 3], max_tokens=4, extra_body={"ignore_eos": True}
    )
    assert r.usage is not None and r.usage.completion_tokens == 4


def test_lone_surrogates_are_400s(stack: Stack) -> None:
    prompt = b'{"model": "%s", "prompt": "caf\\ud800", "max_tokens": 2}' % stack.dep.model.encode()
    assert "Unicode" in assert_400(stack, prompt, "prompt")
    stop = json.dumps(completion(stack)).replace(
        '"max_tokens"', '"stop": ["\\udfff"], "max_tokens"'
    )
    assert_400(stack, stop.encode(), "stop")
    chat = (
        b'{"model": "%s", "messages": [{"role": "user", "content": "\\udc00hi"}]}'
        % stack.dep.model.encode()
    )
    status, answer = post(stack, "/v1/chat/completions", chat)
    assert status == 400 and answer["error"]["param"] == "messages", answer


def test_deeply_nested_json_is_a_400(stack: Stack) -> None:
    depth = 200_000
    body = b'{"model": "m", "prompt": ' + b"[" * depth + b"]" * depth + b"}"
    assert "nests deeper" in assert_400(stack, body, None)


def test_an_integer_too_long_to_convert_is_a_400(stack: Stack) -> None:
    """Python refuses to turn more than 4,300 digits into an int: that was a 500 with a
    traceback, for any route that reads a body. Decoded by msgspec, such a number is out of
    the 64-bit range, and the 400 names its field."""
    digits = b"1" * 5000
    body = b'{"model": "%s", "prompt": [1], "max_tokens": %s}' % (stack.dep.model.encode(), digits)
    assert "out of range" in assert_400(stack, body, "max_tokens")
    status, answer = post(stack, "/tokenize", b'{"prompt": [%s]}' % digits)
    assert status == 400 and "out of range" in answer["error"]["message"], answer


def test_a_compressed_body_is_refused_not_inflated(stack: Stack) -> None:
    """gzip turns 16 KiB on the wire into a 16 MiB body, which aiohttp inflated on the
    router's event loop before any handler saw it: one cheap request, ~80 ms of a frozen
    router. No OpenAI client compresses its requests: a compressed body is a 415 naming
    the header, and it is never inflated."""
    raw = json.dumps(completion(stack)).encode() + b" " * (15 * 2**20)
    req = urllib.request.Request(
        f"{stack.url}/v1/completions",
        data=gzip.compress(raw),
        headers={"Content-Type": "application/json", "Content-Encoding": "gzip"},
    )
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=60)
    answer = json.loads(info.value.read())
    assert info.value.code == 415, answer
    assert "Content-Encoding: gzip" in answer["error"]["message"], answer


def test_stop_string_floods_are_refused(stack: Stack) -> None:
    flood = completion(stack, stop=["x" * 16384] * 1000)
    assert "at most" in assert_400(stack, flood, "stop")
    assert "characters" in assert_400(stack, completion(stack, stop=["y" * 5000]), "stop")


def test_the_router_loop_answers_while_megabyte_prompts_arrive(stack: Stack) -> None:
    """Tokenizing 1.8 MB on the event loop once stalled every stream and heartbeat for a
    second; now it happens on a tokenizer thread, and a prompt that cannot fit is refused
    from its length in characters before any tokenizer time is spent. Counted in events,
    not seconds: while four megabyte prompts are in flight (all but their last byte sent),
    the loop answers every health check; then each is refused by its length alone."""
    body = json.dumps(completion(stack, prompt="hello world " * 150_000)).encode()
    host, port = stack.url.removeprefix("http://").rsplit(":", 1)
    posts = [http.client.HTTPConnection(host, int(port), timeout=60) for _ in range(4)]
    try:
        for conn in posts:
            conn.putrequest("POST", "/v1/completions")
            conn.putheader("Content-Type", "application/json")
            conn.putheader("Content-Length", str(len(body)))
            conn.endheaders()
            conn.send(body[:-1])
        assert [_get(f"{stack.url}/health?live=1") for _ in range(10)] == [200] * 10
        socks = [conn.sock for conn in posts]
        assert select.select(socks, [], [], 0)[0] == [], "a prompt was answered before it all came"
        for conn in posts:
            conn.send(body[-1:])
        answers = [conn.getresponse() for conn in posts]
        errors = [(a.status, json.loads(a.read())["error"]) for a in answers]
    finally:
        for conn in posts:
            conn.close()
    for status, error in errors:
        assert (status, error["code"], error["param"]) == (400, "context_length_exceeded", "prompt")
        assert "1800000 characters" in error["message"], error
    assert _get(f"{stack.url}/health?live=1") == 200


#: Generous on purpose: the issue's bound for /health is 100 ms, measured with the router in
#: a process of its own by `hetero-pd bench hostile` (here the probes, the clients and the
#: router share one process and its GIL, and the tests share two cores with another test
#: process); under the router's 3 s heartbeat timeout, which a loop held longer would break.
#: Before the bounded decoding, a 16 MiB body of integers held the router's loop (or its
#: tokenizer thread) for 6-11 s; large bodies are now decoded in a process of their own.
RESPONSIVE_S = 2.0
#: A body of 16 MiB (the API's limit) less what the rest of a request needs.
SIXTEEN_MIB_OF_INTS = b"[" + b"1," * (8 * 2**20 - 256) + b"1]"


def answers_while_probed(stack: Stack, posts: list[tuple[str, bytes]]) -> list[Any]:
    """POSTs each body (all of them sent but their last byte, then those last bytes at once)
    while one client probes /health and another tokenizes a word; returns (status, answer)
    of each and asserts the probes were answered within RESPONSIVE_S."""
    conns = start_posts(stack.url, posts, timeout_s=120)
    try:
        health = Probe(f"{stack.url}/health?live=1")
        tokenize = Probe(f"{stack.url}/tokenize", {"prompt": "hello"})
        with health, tokenize:
            for conn, (_, body) in zip(conns, posts, strict=True):
                conn.send(body[-1:])
            answers = [conn.getresponse() for conn in conns]
            out = [(a.status, json.loads(a.read())) for a in answers]
    finally:
        for conn in conns:
            conn.close()
    assert health.statuses == {200} and tokenize.statuses == {200}
    assert health.worst_s < RESPONSIVE_S, health.latencies
    assert tokenize.worst_s < RESPONSIVE_S, tokenize.latencies
    return out


def test_16_mib_of_integers_is_refused_while_the_router_stays_responsive(stack: Stack) -> None:
    """The issue's cheap request: 16 MiB of integers took 0.5 s to parse and 6-10 s for a
    Python walk over every element, on the event loop (/tokenize, /detokenize) or on the one
    tokenizer thread (completions). Each route now decodes its body with its counts bounded
    before any Python object is made: every one is refused, naming the field, while /health
    and a small /tokenize keep being answered."""
    model = stack.dep.model.encode()
    answers = answers_while_probed(
        stack,
        [
            ("/v1/completions", b'{"model": "%s", "prompt": %s}' % (model, SIXTEEN_MIB_OF_INTS)),
            ("/tokenize", b'{"prompt": %s}' % SIXTEEN_MIB_OF_INTS),
            ("/tokenize", b'{"prompt": "hi", "unknown": %s}' % SIXTEEN_MIB_OF_INTS),
            ("/detokenize", b'{"tokens": %s}' % SIXTEEN_MIB_OF_INTS),
        ],
    )
    (s1, a1), (s2, a2), (s3, a3), (s4, a4) = answers
    e1, e2, e4 = a1["error"], a2["error"], a4["error"]
    assert (s1, e1["param"], e1["code"]) == (400, "prompt", "context_length_exceeded"), e1
    assert (s2, e2["param"]) == (400, "prompt"), e2
    assert (s3, a3["count"]) == (200, 1), a3  # an unknown field is skipped, however large
    assert (s4, e4["param"]) == (400, "tokens") and "at most" in e4["message"], e4


def test_a_streaming_client_that_stops_reading_loses_its_slot(stack: Stack) -> None:
    """A client that stops reading a stream is cut off once its writes stall: the request
    is aborted (not generated to its end into socket buffers) and its slot freed."""
    router = stack.router
    assert router is not None
    ended = {o: stack.metric("hetero_pd_requests_total", outcome=o) for o in ("abort", "length")}
    body = json.dumps(
        completion(stack, stream=True, max_tokens=1000, ignore_eos=True, temperature=0)
    ).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    host, port = stack.url.removeprefix("http://").rsplit(":", 1)
    sock.connect((host, int(port)))
    try:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + b"Content-Length: %d\r\n\r\n" % len(body)
            + body
        )
        sock.recv(1024)  # the headers and first chunks arrive; then it reads nothing more
        deadline = time.monotonic() + 60
        while stack.call(_inflight(router)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert stack.call(_inflight(router)) == 0, "the stalled stream still holds its slot"
    finally:
        sock.close()
    assert stack.metric("hetero_pd_requests_total", outcome="abort") == ended["abort"] + 1
    assert stack.metric("hetero_pd_requests_total", outcome="length") == ended["length"]
    stack.wait_idle()


async def _inflight(router: Any) -> int:
    return len(router.queues)


def _get(url: str) -> int:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return int(resp.status)


def test_workers_survive_everything_above(stack: Stack) -> None:
    assert stack.launcher is not None
    pids = list(stack.launcher.pids().values())
    assert wait_gone(pids, 0.0) == pids  # all still running
    stack.wait_idle()
