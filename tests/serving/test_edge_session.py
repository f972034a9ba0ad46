"""Edge sessions end to end: an EdgeClient runs layers [0, k) of a tiny model here and talks
to a real stack (router + split prefill and decode worker processes running [k, L)) over a
WebSocket. Greedy tokens equal the unsplit engine's, through the KV hand-off and through
prefill on the decode worker; what the device sends holds no trace of the prompt; a device
holding another split is refused at session start; whole-model requests get a clear error.
"""

from __future__ import annotations

import asyncio
import json
import re
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from edge import EdgeClient, EdgeError, EdgeMismatchError, EdgeRuntime, decode, encode
from edge import cli as edge_cli
from edge.wire_audit import assert_no_prompt_leak
from hetero_pd import LLM, SamplingParams
from hetero_pd.bench.link_shaping import LINKS, via
from hetero_pd.deploy.testing import Stack, deployment, running_stack
from hetero_pd.models.tokenizer import load_tokenizer
from hetero_pd.serving.api.edge_protocol import PATH, Token, pack, unpack

from .conftest import proxy

SPLIT = 2
KEY = "edge-key"
DECISIONS = "hetero_pd_policy_decisions_total"
PROMPTS = [
    "Tell me a story about a lighthouse keeper and a storm at sea, please.",  # disaggregated
    "Hi there",  # prefilled on the decode worker (short)
    "The account number 4411-2093 belongs to Ada; summarize her last three letters in detail.",
]


@pytest.fixture(scope="module")
def stack(text_llama_dir: Path) -> Iterator[Stack]:
    dep = deployment(
        text_llama_dir,
        router={"api_keys": [KEY], "local_prefill_max_tokens": 8},
        edge={"split_layer": SPLIT, "codec": "float16"},
    )
    with running_stack(dep) as s:
        yield s


@pytest.fixture(scope="module")
def reference(text_llama_dir: Path) -> LLM:
    return LLM(
        str(text_llama_dir), dtype="float32", num_kv_blocks=256, max_model_len=1024, num_threads=1
    )


def client(stack: Stack, model_dir: Path, split: int = SPLIT, **kw: Any) -> EdgeClient:
    """A device of `stack`: over TLS to its edge listener, or in clear to the API's port
    where it has none (whole-model deployments)."""
    tls = {"ca_file": stack.edge_ca} if stack.edge_url else {"plaintext": True}
    kw = {"api_key": KEY, "timeout_s": 30, **tls, **kw}
    return EdgeClient(stack.edge_url or stack.url, model_dir, split, model=stack.dep.model, **kw)


def test_greedy_tokens_equal_the_unsplit_engine(
    stack: Stack, text_llama_dir: Path, reference: LLM
) -> None:
    async def run() -> list[list[int]]:
        # Sessions at once: the decode worker batches them, each waiting on its own device.
        clients = [client(stack, text_llama_dir) for _ in PROMPTS]
        done = await asyncio.gather(
            *(
                c.complete(p, max_tokens=12, ignore_eos=True)
                for c, p in zip(clients, PROMPTS, strict=True)
            )
        )
        assert all(d.finish_reason == "length" for d in done)
        return [d.token_ids for d in done]

    got = asyncio.run(run())
    runtime = EdgeRuntime(text_llama_dir, SPLIT)
    ids = [runtime.tokenize(p) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in reference.generate(ids, params)]
    assert got == want
    assert stack.metric(DECISIONS, decision="disaggregated") >= 2
    assert stack.metric(DECISIONS, decision="local_prefill") >= 1
    # The KV of layers [k, L) arrived whole: no decode worker fell back to computing it.
    assert stack.metric(DECISIONS, decision="recompute") == 0
    assert stack.router.workers["decode-0"].load.kv_fallbacks == 0
    for name, report in stack.wait_idle().items():
        assert report["ok"] and report["used_blocks"] == 0, (name, report)


def test_a_session_over_a_slow_lossy_link_keeps_the_greedy_tokens(
    stack: Stack, text_llama_dir: Path, reference: LLM
) -> None:
    """10 Mbit/s, 40 ms RTT, 1% of segments lost and retransmitted (the bench's shaping
    proxy, hetero_pd.bench.link_shaping): slower, and the same tokens as unsplit."""
    with via(stack.edge_url, LINKS["10mbit-40ms-1pct"]) as url:
        edge = EdgeClient(
            url, text_llama_dir, SPLIT, model=stack.dep.model, api_key=KEY, ca_file=stack.edge_ca
        )
        done = asyncio.run(edge.complete(PROMPTS[2], max_tokens=8, ignore_eos=True))
    ids = EdgeRuntime(text_llama_dir, SPLIT).tokenize(PROMPTS[2])
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert done.token_ids == reference.generate([ids], params)[0].outputs[0].token_ids


def test_edge_generate_command_streams_transformers_greedy_text(
    stack: Stack,
    text_llama_dir: Path,
    hf_greedy: Callable[..., list[int]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`hetero-pd edge generate` with real arguments: it streams transformers' greedy text
    for the prompt and reports the bytes this device sent (at least the prompt's hidden
    states and one per generated token but the last, in float16)."""
    prompt = "Name three colors."
    args = ["--url", stack.edge_url, "--ca-file", str(stack.edge_ca), "--api-key", KEY]
    args += ["--split", str(SPLIT), "--max-tokens", "8"]
    assert edge_cli.main(["generate", *args, "--model", str(text_llama_dir), prompt]) == 0
    out, err = capsys.readouterr()
    ids = EdgeRuntime(text_llama_dir, SPLIT).tokenize(prompt)
    # the answer's line ends on stdout (1331a37); the byte count goes to stderr
    assert out == load_tokenizer(text_llama_dir).decode(hf_greedy(text_llama_dir, ids, 8)) + "\n"
    sent = re.fullmatch(r"\[(\d+) bytes sent by this device\]\n", err)
    assert sent is not None, err
    assert int(sent.group(1)) >= (len(ids) + 8 - 1) * 64 * 2
    for name, report in stack.wait_idle().items():
        assert report["ok"] and report["used_blocks"] == 0, (name, report)


def test_a_client_whose_first_connections_drop_reconnects_with_backoff(
    stack: Stack, text_llama_dir: Path, hf_greedy: Callable[..., list[int]]
) -> None:
    """The router's address hangs up on the device until it has backed off twice (0.2 s, then
    0.4 s: recorded through the client's `sleep`, not slept); its last try connects, and the
    session's tokens are still transformers' greedy ones."""
    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)

    async def run() -> list[int]:
        async with proxy(stack.edge_url, drop=lambda: len(waits) < 2) as url:
            edge = EdgeClient(
                url,
                text_llama_dir,
                SPLIT,
                model=stack.dep.model,
                api_key=KEY,
                sleep=sleep,
                ca_file=stack.edge_ca,
            )
            done = await edge.complete(PROMPTS[1], max_tokens=8, ignore_eos=True)
        return done.token_ids

    got = asyncio.run(asyncio.wait_for(run(), 60))
    assert waits == [0.2, 0.4]  # retries=2: the third and last try got through
    ids = EdgeRuntime(text_llama_dir, SPLIT).tokenize(PROMPTS[1])
    assert got == hf_greedy(text_llama_dir, ids, 8)
    for name, report in stack.wait_idle().items():
        assert report["ok"] and report["used_blocks"] == 0, (name, report)


def test_nothing_the_device_sends_reveals_the_prompt(stack: Stack, text_llama_dir: Path) -> None:
    sent: list[bytes] = []
    edge = client(stack, text_llama_dir, tap=sent.append)
    prompt = PROMPTS[2]
    done = asyncio.run(edge.complete(prompt, max_tokens=6, ignore_eos=True))
    assert len(done.token_ids) == 6 and len(sent) == 6  # start + one hidden per new token
    kinds = [msgspec.msgpack.decode(m)["t"] for m in sent]
    assert kinds == ["start"] + ["hidden"] * 5
    ids = EdgeRuntime(text_llama_dir, SPLIT).tokenize(prompt)
    assert_no_prompt_leak(b"".join(sent), prompt, ids)
    start = msgspec.msgpack.decode(sent[0])
    assert set(start) == {"v", "t", "model", "split_layer", "fingerprint", "params", "prompt"}
    assert start["prompt"]["shape"] == [len(ids), 64]


def test_the_noise_defence_changes_what_is_sent(stack: Stack, text_llama_dir: Path) -> None:
    """noise_sigma = 0.5: the prompt's rows leave with Gaussian noise of half their RMS (the
    edge-privacy bench prices it); the session still completes."""
    sent: list[bytes] = []
    edge = client(stack, text_llama_dir, tap=sent.append, noise_sigma=0.5)
    done = asyncio.run(edge.complete(PROMPTS[2], max_tokens=3, ignore_eos=True))
    assert len(done.token_ids) == 3
    rows = decode(msgspec.msgpack.decode(sent[0])["prompt"])
    rt = EdgeRuntime(text_llama_dir, SPLIT)
    clean = rt.prefill(rt.tokenize(PROMPTS[2]))
    ratio = (rows - clean).pow(2).mean(-1).sqrt() / clean.pow(2).mean(-1).sqrt()
    assert 0.35 < float(ratio.mean()) < 0.65  # float16 rounding adds ~1e-3 at most


def test_a_device_with_another_split_is_refused(stack: Stack, text_llama_dir: Path) -> None:
    with pytest.raises(EdgeMismatchError, match="continues at layer 2"):
        asyncio.run(client(stack, text_llama_dir, split=1).generate("Hello", max_tokens=2))


def test_bad_sessions_end_with_a_clear_error(stack: Stack, text_llama_dir: Path) -> None:
    with pytest.raises(EdgeError, match="unknown sampling parameter"):
        asyncio.run(client(stack, text_llama_dir).generate("Hello", max_tokens=2, nonsense=1))
    with pytest.raises(EdgeError, match="refused"):
        asyncio.run(client(stack, text_llama_dir, api_key="no").generate("Hello", max_tokens=2))

    async def raw(message: bytes) -> Any:
        import aiohttp

        headers = {"Authorization": f"Bearer {KEY}"}
        async with (
            aiohttp.ClientSession() as s,
            s.ws_connect(stack.edge_url + PATH, headers=headers, ssl=stack.edge_ssl()) as ws,
        ):
            await ws.send_bytes(message)
            reply = await ws.receive(timeout=30)
            return unpack(reply.data)

    assert asyncio.run(raw(b"\xc1 not msgpack")).code == "protocol"
    start = {"model": stack.dep.model, "split_layer": SPLIT, "fingerprint": "x", "params": {}}
    empty_frame = msgspec.msgpack.encode({"v": 1, "t": "start", **start, "prompt": {}})
    assert asyncio.run(raw(empty_frame)).code == "protocol"
    frame = encode(torch.zeros(3, 64), "float16")
    assert asyncio.run(raw(pack("start", **start, prompt=frame))).code == "fingerprint_mismatch"
    for name, report in stack.wait_idle().items():
        assert report["ok"] and report["used_blocks"] == 0, (name, report)


def test_whole_model_requests_are_refused_clearly(stack: Stack) -> None:
    body = json.dumps({"model": stack.dep.model, "prompt": "Hi", "max_tokens": 2}).encode()
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
    req = urllib.request.Request(stack.url + "/v1/completions", data=body, headers=headers)
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 400
    assert json.loads(e.value.read())["error"]["code"] == "edge_only"


@pytest.fixture(scope="module")
def whole_stack(text_llama_dir: Path) -> Iterator[Stack]:
    dep = deployment(text_llama_dir, router={"api_keys": [KEY], "local_prefill_max_tokens": 8})
    with running_stack(dep) as s:
        yield s


def test_prompt_only_sessions_decode_in_the_cloud_like_the_unsplit_engine(
    whole_stack: Stack, text_llama_dir: Path, reference: LLM
) -> None:
    sent: list[bytes] = []

    async def run() -> list[list[int]]:
        clients = [
            client(whole_stack, text_llama_dir, split=k, mode="prompt_only", tap=sent.append)
            for k in (1, 2, 1)
        ]
        done = await asyncio.gather(
            *(
                c.complete(p, max_tokens=12, ignore_eos=True)
                for c, p in zip(clients, PROMPTS, strict=True)
            )
        )
        return [d.token_ids for d in done]

    got = asyncio.run(run())
    runtime = EdgeRuntime(text_llama_dir, SPLIT)
    ids = [runtime.tokenize(p) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    assert got == [o.outputs[0].token_ids for o in reference.generate(ids, params)]
    assert [msgspec.msgpack.decode(m)["t"] for m in sent] == [
        "start"
    ] * 3  # nothing after the prompt
    assert whole_stack.metric(DECISIONS, decision="disaggregated") >= 2
    assert whole_stack.metric(DECISIONS, decision="recompute") == 0
    for name, report in whole_stack.wait_idle().items():
        assert report["ok"] and report["used_blocks"] == 0, (name, report)


def test_each_deployment_refuses_the_other_mode(
    stack: Stack, whole_stack: Stack, text_llama_dir: Path
) -> None:
    with pytest.raises(EdgeError, match="mode_unavailable"):
        asyncio.run(client(whole_stack, text_llama_dir).generate("Hello", max_tokens=2))
    with pytest.raises(EdgeError, match="mode_unavailable"):
        edge = client(stack, text_llama_dir, mode="prompt_only")
        asyncio.run(edge.generate("Hello", max_tokens=2))


def test_a_device_that_goes_away_mid_session_frees_every_block(
    stack: Stack, text_llama_dir: Path
) -> None:
    import aiohttp

    runtime = EdgeRuntime(text_llama_dir, SPLIT)
    ids = runtime.tokenize(PROMPTS[0])
    start = pack(
        "start",
        model=stack.dep.model,
        split_layer=SPLIT,
        fingerprint=runtime.fingerprint(),
        params={"max_tokens": 50, "ignore_eos": True},
        prompt=encode(runtime.prefill(ids), "float16"),
    )

    async def leave_after_first_token() -> Any:
        headers = {"Authorization": f"Bearer {KEY}"}
        async with (
            aiohttp.ClientSession() as s,
            s.ws_connect(stack.edge_url + PATH, headers=headers, ssl=stack.edge_ssl()) as ws,
        ):
            await ws.send_bytes(start)
            first = unpack((await ws.receive(timeout=30)).data)
        return first  # the socket is closed without sending the token's hidden state

    first = asyncio.run(leave_after_first_token())
    assert isinstance(first, Token) and first.finish_reason is None
    for name, report in stack.wait_idle().items():
        assert report["ok"] and report["used_blocks"] == 0, (name, report)


def test_metrics_and_worker_detail_need_the_api_key(stack: Stack) -> None:
    def get(path: str, key: str | None) -> tuple[int, bytes]:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        req = urllib.request.Request(stack.url + path, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    assert get("/metrics", None)[0] == 401
    assert get("/metrics", "wrong")[0] == 401
    status, body = get("/metrics", KEY)
    assert status == 200 and b"hetero_pd_worker_up" in body
    status, body = get("/health", None)
    assert status == 200 and json.loads(body) == {"status": "ok"}
    status, body = get("/health", KEY)
    assert status == 200 and set(json.loads(body)["workers"]) == {"prefill-0", "decode-0"}
    assert get("/health?live=1", None) == (200, b'{"status": "alive"}')
