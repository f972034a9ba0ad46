"""One client cannot starve the rest: `priority` only from API keys the deployment allows
(clamped to a small range), and the in-flight limits count completions (prompts x n), per
API key as well as in all; a client over its share gets 429 with Retry-After."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from hetero_pd.deploy.testing import Stack, deployment, http_json, running_stack
from hetero_pd.serving.api.protocol import PRIORITY_LIMIT
from hetero_pd.serving.router.admission import Admission
from hetero_pd.serving.router.errors import RouterError

A, B, VIP, OPS = "key-a", "key-b", "key-vip", "key-ops"


@pytest.fixture(scope="module")
def stack(tiny_llama_dir: Path) -> Iterator[Stack]:
    router = {
        "api_keys": [A, B, VIP],
        "priority_api_keys": [VIP],
        "admin_keys": [OPS],
        "max_inflight": 8,
        "max_inflight_per_key": 4,
    }
    with running_stack(deployment(tiny_llama_dir, router=router)) as s:
        yield s


def complete(stack: Stack, key: str, **fields: Any) -> tuple[int, Any]:
    body = {"model": stack.dep.model, "prompt": [1, 2, 3], "max_tokens": 2, **fields}
    return http_json(f"{stack.base_url}/completions", body, key)


def test_priority_only_from_allowed_keys_and_clamped(stack: Stack) -> None:
    """Any client once set priority anywhere in +-2**31 and the scheduler honoured it."""
    status, r = complete(stack, A, priority=-5)
    assert (status, r["error"]["param"]) == (400, "priority"), r
    assert "router.priority_api_keys" in r["error"]["message"]
    assert complete(stack, A, priority=0)[0] == 200  # the default is anyone's
    router = stack.router
    assert router is not None
    seen: list[int] = []
    generate = router.generate

    def spy(rid: str, ids: list[int], params: Any, priority: int = 0, **kw: Any) -> Any:
        seen.append(priority)
        return generate(rid, ids, params, priority, **kw)

    router.generate = spy  # type: ignore[method-assign]
    try:
        for asked in (-(2**40), 3, 2**31):
            assert complete(stack, VIP, priority=asked)[0] == 200
    finally:
        router.generate = generate  # type: ignore[method-assign]
    assert seen == [-PRIORITY_LIMIT, 3, PRIORITY_LIMIT]


def test_inflight_limits_count_choices_per_key(stack: Stack) -> None:
    """One request with n = 4 holds four of key A's four slots (it once held one, whatever
    its prompts and n): A's next request is a 429 with Retry-After while B is served; with
    B holding its four too, the server is full (8) for everyone; a request that asks for
    more completions than a key may ever hold is a 400 naming `n`."""
    clients = {k: openai.OpenAI(base_url=stack.base_url, api_key=k, max_retries=0) for k in (A, B)}
    long = {"model": stack.dep.model, "prompt": [1, 2, 3], "max_tokens": 1000, "n": 4,
            "stream": True, "extra_body": {"ignore_eos": True}}  # fmt: skip
    first = clients[A].completions.create(**long)
    try:
        next(iter(first))  # admitted and streaming
        with pytest.raises(openai.RateLimitError) as info:
            clients[A].completions.create(model=stack.dep.model, prompt=[1], max_tokens=2)
        assert int(info.value.response.headers["Retry-After"]) >= 1
        assert "may have at most 4" in info.value.response.json()["error"]["message"]
        assert complete(stack, B)[0] == 200
        second = clients[B].completions.create(**long)
        try:
            next(iter(second))
            status, r = complete(stack, VIP)
            assert (status, r["error"]["type"]) == (429, "rate_limit_error"), r
        finally:
            second.close()
    finally:
        first.close()
    status, r = complete(stack, B, prompt=[[1], [2]], n=3)  # 2 prompts x 3 = 6 > 4
    assert (status, r["error"]["param"]) == (400, "n"), r
    assert "6 completions" in r["error"]["message"]
    stack.wait_idle()
    assert complete(stack, A, n=4)[0] == 200  # the slots came back


def test_embeddings_count_against_admission(stack: Stack) -> None:
    """/v1/embeddings once skipped admission: a key at its share, or a full server, still
    had every embeddings request sent to a worker. Now each input holds a slot (a request
    at most its key's whole share) while it runs, and a client over its share gets the
    completions' 429 with Retry-After."""
    clients = {k: openai.OpenAI(base_url=stack.base_url, api_key=k, max_retries=0) for k in (A, B)}
    router = stack.router
    assert router is not None
    held: list[dict[str, int]] = []
    embed = router.embed

    async def spy(rid: str, inputs: list[list[int]]) -> tuple[int, bytes]:
        held.append(dict(router.admission.by_key))
        return await embed(rid, inputs)

    router.embed = spy  # type: ignore[method-assign]
    long = {"model": stack.dep.model, "prompt": [1, 2, 3], "max_tokens": 1000, "n": 4,
            "stream": True, "extra_body": {"ignore_eos": True}}  # fmt: skip
    try:
        clients[B].embeddings.create(model=stack.dep.model, input=[[1, 2], [3], [4, 5]])
        many = [[t] for t in range(1, 11)]  # ten inputs: the key's whole share, no more
        clients[B].embeddings.create(model=stack.dep.model, input=many)
        assert held == [{B: 3}, {B: 4}]
        first = clients[A].completions.create(**long)
        try:
            next(iter(first))  # A's four slots are taken
            with pytest.raises(openai.RateLimitError) as info:
                clients[A].embeddings.create(model=stack.dep.model, input=[[1, 2]])
            assert int(info.value.response.headers["Retry-After"]) >= 1
            assert "may have at most 4" in info.value.response.json()["error"]["message"]
            assert len(held) == 2  # refused before any worker saw it
        finally:
            first.close()
    finally:
        router.embed = embed  # type: ignore[method-assign]
    stack.wait_idle()
    assert router.admission.by_key == {}


def test_only_admin_keys_operate_the_deployment(stack: Stack) -> None:
    """A client's API key once drained, migrated and restarted workers (/admin/*): any
    client could empty the decode pool. Those routes take only router.admin_keys."""
    for key in (A, VIP):
        status, r = http_json(f"{stack.url}/admin/drain", {"worker": "decode-0"}, key)
        assert (status, r["error"]["code"]) == (403, "admin_key_required"), r
        assert "router.admin_keys" in r["error"]["message"]
    assert http_json(f"{stack.url}/admin/restart", {"rolling": True}, B)[0] == 403
    assert http_json(f"{stack.url}/admin/drain", {"worker": "decode-0"})[0] == 401
    # The admin key gets past the check: the body's error is the next thing it hears.
    status, r = http_json(f"{stack.url}/admin/drain", {"worker": "decode-9"}, OPS)
    assert (status, r["error"]["param"]) == (400, "worker"), r
    # An admin key is not a client's key.
    assert complete(stack, OPS)[0] == 401


def test_admin_routes_when_keys_are_partly_set() -> None:
    """No keys at all: a local deployment, open like its API. Client keys but no admin
    keys: nobody operates it over HTTP (the launcher and signals still do)."""
    from hetero_pd.serving.api.admin import admin_refusal

    assert admin_refusal("", (), ()) is None
    assert admin_refusal("", ("k",), ()) is not None
    assert admin_refusal("k", ("k",), ()) is not None
    assert admin_refusal("ops", ("k",), ("ops",)) is None
    assert admin_refusal("ops", (), ("ops",)) is None
    assert admin_refusal("k", ("k",), ("ops",)) is not None


def test_admission_counts_and_gives_back() -> None:
    admission = Admission(max_inflight=5, max_per_key=3)
    a = admission.admit("a", 3)
    with pytest.raises(RouterError) as info:
        admission.admit("a", 1)
    assert (info.value.status, info.value.code, info.value.retry_after) == (
        429,
        "key_over_share",
        1.0,
    )
    b = admission.admit("b", 2)
    with pytest.raises(RouterError, match="at capacity"):
        admission.admit("c", 1)
    a.release()
    a.release()  # once only
    assert (admission.total, admission.by_key) == (2, {"b": 2})
    b.release()
    assert (admission.total, admission.by_key, admission.largest) == (0, {}, 3)
