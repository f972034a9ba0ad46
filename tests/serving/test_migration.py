"""Live migration of decoding requests between decode workers (issue 31), on real worker
processes of the tiny text model (migration moves blocks, sampler states and streams
whatever the weights; tests/serving/test_rebalance.py moves a request of the default model):
a request moved mid-stream gives exactly the tokens of an unmigrated run (greedy, and seeded
sampling), streamed through the official openai client with no gap and no repeat; a
destination killed mid-copy leaves the request on its source; a drain moves every request
off a worker.

Every test here needs its requests still decoding when it moves them. The default model's
slow steps used to give them that time, and the tiny model's ~2 ms steps do not: the decode
workers' steps are paced instead (`PACED`, a fault rule: each step takes STEP_S at least,
the worker serving control messages and transfers meanwhile at no CPU cost), so a request of
N tokens decodes for (N - 1) * STEP_S seconds at least whatever the machine's load, many
times what a move takes. A request that ends first still fails the test by name (`wait_decoding`,
`result.ok`, the drain's `moved` count), never passes it unmoved."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest

from hetero_pd.deploy.testing import (
    Stack,
    deployment,
    http_json,
    random_prompts,
    running_stack,
    wait_gone,
)
from hetero_pd.serving.router.migration import Migration

ONE_P_TWO_D = [{"role": "prefill"}, {"role": "decode"}, {"role": "decode"}]
MIGRATIONS = "hetero_pd_migrations_total"
DECISIONS = "hetero_pd_policy_decisions_total"
#: Every KV push of a decode worker (only migrations push from there) starts 0.5 s late.
LATE_BEGIN = [{"kind": "delay", "msg_type": "begin", "nth": 1, "count": 10**9, "delay_s": 0.5}]
#: How long each decode step takes at least (a slower device): 48 tokens decode for 2.35 s.
STEP_S = 0.05


def paced(step_s: float, rules: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """A decode worker's fault rules: `rules`, and every engine step taking `step_s` at least."""
    return [
        *(rules or []),
        {"kind": "delay", "msg_type": "step", "count": 10**9, "delay_s": step_s},
    ]


#: The module's decode workers, paced.
PACED = {"faults": {"decode-0": paced(STEP_S), "decode-1": paced(STEP_S)}}
#: Room on one decode worker for all 32 chats of the rolling restart (9 blocks of 16 tokens
#: each, 288): while the other decode worker drains, every one of them may still be decoding.
ROOM_FOR_ALL = {"num_kv_blocks": 320}
#: The rolling restart's decode workers, paced at 250 ms a step: its 40-token chats decode
#: for 9.75 s at least, past the prefill worker's restart (measured: 4.8 s was not, with two
#: CPU hogs beside the test), so that the decode workers' drains find them decoding.
SLOW = {"faults": {"decode-0": paced(0.25), "decode-1": paced(0.25)}}
CHAT_TOKENS = 40


@pytest.fixture(scope="module")
def stack(chat_model: Path) -> Iterator[Stack]:
    dep = deployment(chat_model, workers=ONE_P_TWO_D, transfer=PACED)
    with running_stack(dep) as s:
        yield s


def stream_text(
    stack: Stack,
    prompt: list[int],
    max_tokens: int,
    reached: threading.Event | None = None,
    after: int = 8,
    **sampling: Any,
) -> tuple[str, int, int]:
    """Streams a completion with the official client: (its text, chunks with text, the
    completion tokens its usage counts); sets `reached` after `after` chunks."""
    texts, chunks, usage = stream_choices(stack, prompt, max_tokens, reached, after, **sampling)
    return texts[0], chunks[0], usage


def stream_choices(
    stack: Stack,
    prompt: list[int],
    max_tokens: int,
    reached: threading.Event | None = None,
    after: int = 8,
    n: int = 1,
    **sampling: Any,
) -> tuple[list[str], list[int], int]:
    """`stream_text` of each of `n` completions: (texts, chunks with text, completion
    tokens of all); `after` counts the chunks of all of them."""
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0)
    texts, chunks, usage = [""] * n, [0] * n, 0
    with client:
        stream = client.completions.create(
            model=stack.dep.model, prompt=prompt, max_tokens=max_tokens, stream=True, n=n,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
            **sampling,
        )  # fmt: skip
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
            for choice in chunk.choices:
                if choice.text:
                    texts[choice.index] += choice.text
                    chunks[choice.index] += 1
                    if reached is not None and sum(chunks) == after:
                        reached.set()
    return texts, chunks, usage


def the_request(stack: Stack, timeout_s: float = 30.0) -> str:
    """The id of the one request the router streams now."""
    assert stack.router is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        streams = [r for r, s in stack.router.streams.items() if s.decoding]
        if streams:
            assert len(streams) == 1
            return streams[0]
        time.sleep(0.01)
    raise AssertionError("no request is decoding")


def migrated_run(
    stack: Stack, prompt: list[int], max_tokens: int, **sampling: Any
) -> tuple[Any, Migration]:
    """Streams `prompt` (`stream_choices` with `n` in `sampling`, else `stream_text`) and
    moves it to the other decode worker after 8 chunks."""
    assert stack.router is not None
    reached = threading.Event()
    streamer = stream_choices if "n" in sampling else stream_text
    with ThreadPoolExecutor(1) as pool:
        run: Future[Any] = pool.submit(streamer, stack, prompt, max_tokens, reached, **sampling)
        assert reached.wait(60)
        rid = the_request(stack)
        result = stack.call(stack.router.migrator.migrate(rid), 60)
        return run.result(120), result


@pytest.mark.parametrize(
    "sampling", [{"temperature": 0}, {"temperature": 0.9, "seed": 1234}], ids=["greedy", "seeded"]
)
def test_migrated_stream_equals_unmigrated(stack: Stack, sampling: dict[str, Any]) -> None:
    prompt = random_prompts([70], seed=3)[0]  # four full blocks and a partial one
    before = stack.metric(MIGRATIONS, stage="completed")
    reference = stream_text(stack, prompt, 48, **sampling)
    got, result = migrated_run(stack, prompt, 48, **sampling)
    assert result.ok, result.reason
    assert result.source != result.dest and result.bytes > 0
    assert got == reference  # same text, one chunk per token, none lost or repeated
    assert reference[2] == 48
    assert stack.metric(MIGRATIONS, stage="completed") == before + 1
    stack.wait_idle()


def test_n2_request_migrates_whole(stack: Stack) -> None:
    """A seeded n=2 request moved mid-stream: both completions move together, each one's
    text equals the unmigrated run's, chunk for chunk (no gap, no repeat)."""
    prompt = random_prompts([70], seed=4)[0]
    sampling: dict[str, Any] = {"temperature": 0.9, "seed": 77, "n": 2}
    reference = stream_choices(stack, prompt, 40, **sampling)
    got, result = migrated_run(stack, prompt, 40, **sampling)
    assert result.ok, result.reason
    assert result.source != result.dest and result.bytes > 0
    assert got == reference
    assert reference[0][0] != reference[0][1] and reference[2] == 80
    stack.wait_idle()


def test_destination_killed_mid_copy_leaves_request_on_source(chat_model: Path) -> None:
    """SIGKILL the destination while the source's KV push is in flight (held back 0.5 s by
    a fault rule): the migration aborts and the request, still decoding, finishes on its
    source with the tokens of an unmigrated run."""
    late = paced(STEP_S, LATE_BEGIN)
    dep = deployment(
        chat_model, workers=ONE_P_TWO_D, transfer={"faults": {"decode-0": late, "decode-1": late}},
        supervisor={"restart": False},
    )  # fmt: skip
    prompt = random_prompts([40], seed=5)[0]
    with running_stack(dep) as stack:
        assert stack.router is not None
        reference = stream_text(stack, prompt, 40, temperature=0)
        reached = threading.Event()
        with ThreadPoolExecutor(1) as pool:
            run = pool.submit(stream_text, stack, prompt, 40, reached, 4, temperature=0)
            assert reached.wait(60)
            rid = the_request(stack)
            stream = stack.router.streams[rid]
            migration = stack.submit(stack.router.migrator.migrate(rid))
            deadline = time.monotonic() + 30
            while stream.stage != "copying":
                assert time.monotonic() < deadline, "the copy never started"
                time.sleep(0.005)
            assert stream.dest is not None
            victim = stack.pids[stream.dest.worker_id]
            os.kill(victim, signal.SIGKILL)
            assert not wait_gone([victim], 10)
            assert not run.done(), "the request ended before its destination died"
            result = migration.result(60)
            got = run.result(120)
        assert not result.ok and result.source == stream.decode.worker_id
        assert got == reference
        assert stack.metric(MIGRATIONS, stage="aborted") == 1
        assert stack.integrity()[result.source]["ok"]


def streams_on(stack: Stack, worker: str) -> int:
    assert stack.router is not None
    return sum(s.decoding and s.decode.worker_id == worker for s in stack.router.streams.values())


def wait_decoding(stack: Stack, worker: str, runs: list[Future[Any]]) -> None:
    """Polls until every one of `runs` decodes on `worker`; none may end first."""
    deadline = time.monotonic() + 120
    while streams_on(stack, worker) < len(runs):
        assert time.monotonic() < deadline, f"the {len(runs)} requests never all decoded"
        assert not any(r.done() for r in runs), "a request ended too soon"
        time.sleep(0.02)


def test_drain_moves_all_sixteen_requests(stack: Stack) -> None:
    """16 requests decode on decode-0 (decode-1 drained while they start); draining
    decode-0 through the admin API moves all 16 to decode-1, and each one's text equals
    the unmigrated run's."""
    prompt = random_prompts([40], seed=7)[0]
    reference = stream_text(stack, prompt, 128, temperature=0)  # 6.4 s of decoding at least
    status, _ = http_json(f"{stack.url}/admin/drain", {"worker": "decode-1"})
    assert status == 200
    with ThreadPoolExecutor(16) as pool:
        runs = [pool.submit(stream_text, stack, prompt, 128, temperature=0) for _ in range(16)]
        wait_decoding(stack, "decode-0", runs)
        assert http_json(f"{stack.url}/admin/undrain", {"worker": "decode-1"})[0] == 200
        status, answer = http_json(f"{stack.url}/admin/drain", {"worker": "decode-0"})
        assert status == 200, answer
        assert (answer["moved"], answer["failed"], answer["left"]) == (16, 0, 0)
        assert streams_on(stack, "decode-0") == 0
        texts = [r.result(180) for r in runs]
    assert http_json(f"{stack.url}/admin/undrain", {"worker": "decode-0"})[0] == 200
    assert texts == [reference] * 16
    stack.wait_idle()


def test_admin_api_refuses_bad_requests(stack: Stack) -> None:
    assert http_json(f"{stack.url}/admin/drain", {"worker": "decode-9"})[0] == 400
    assert http_json(f"{stack.url}/admin/drain", {"wrker": "decode-0"})[0] == 400
    status, answer = http_json(f"{stack.url}/admin/migrate", {"request_id": "nope"})
    assert status == 400 and "not decoding" in answer["error"]["message"]


def chat_text(stack: Stack, question: str, max_tokens: int) -> str:
    """A streamed greedy chat through the official client; its whole text."""
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0)
    with client:
        stream = client.chat.completions.create(
            model=stack.dep.model, messages=[{"role": "user", "content": question}],
            max_tokens=max_tokens, temperature=0, stream=True, extra_body={"ignore_eos": True},
        )  # fmt: skip
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


def test_rolling_restart_under_load_ends_no_request(chat_model: Path) -> None:
    """`hetero-pd restart --rolling`'s API while 32 streamed chats run: every worker is
    drained, stopped and started afresh in turn; all 32 complete, each with the text of an
    unmigrated run, none recomputed, and the requests on decode workers moved live. Its own
    stack, paced slower (`SLOW`): the first decode worker drains only once the prefill
    worker is back, a process start that takes seconds on a loaded machine."""
    dep = deployment(chat_model, workers=ONE_P_TWO_D, engine=ROOM_FOR_ALL, transfer=SLOW)
    with running_stack(dep) as stack:
        assert stack.router is not None
        questions = ["Name three colors.", "What is a cat?", "Count to five.", "Say hello."]
        with ThreadPoolExecutor(4) as pool:  # side by side: each is an unmigrated run
            texts = pool.map(lambda q: chat_text(stack, q, CHAT_TOKENS), questions)
            reference = dict(zip(questions, texts, strict=True))
        recomputed = stack.metric(DECISIONS, decision="recompute")
        moved = stack.metric(MIGRATIONS, stage="completed")
        pids = dict(stack.pids)
        with ThreadPoolExecutor(33) as pool:
            runs = [pool.submit(chat_text, stack, questions[i % 4], CHAT_TOKENS) for i in range(32)]
            deadline = time.monotonic() + 120
            while sum(s.decoding for s in stack.router.streams.values()) < 8:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            restart = pool.submit(http_json, f"{stack.url}/admin/restart", {"rolling": True})
            status, answer = restart.result(600)
            texts = [r.result(300) for r in runs]  # raises on any error
        assert status == 200, answer
        assert [r["worker"] for r in answer["restarted"]] == ["prefill-0", "decode-0", "decode-1"]
        assert all(r["failed"] == 0 for r in answer["restarted"])
        assert texts == [reference[questions[i % 4]] for i in range(32)]
        assert stack.metric(DECISIONS, decision="recompute") == recomputed
        assert stack.metric(MIGRATIONS, stage="completed") > moved
        assert stack.launcher is not None
        assert all(stack.launcher.pids()[w] != pid for w, pid in pids.items())
        stack.wait_idle()


def test_scale_down_moves_the_requests_of_the_removed_worker(stack: Stack) -> None:
    """Scale-down (`hetero-pd drain --remove`'s API): the decode worker removed moves its
    running requests to the other one first; they finish with the unmigrated text, its
    process is gone and stays gone, and the last decode worker cannot be removed."""
    assert stack.router is not None and stack.launcher is not None
    prompt = random_prompts([40], seed=9)[0]
    reference = stream_text(stack, prompt, 64, temperature=0)
    assert http_json(f"{stack.url}/admin/drain", {"worker": "decode-0"})[0] == 200
    with ThreadPoolExecutor(4) as pool:
        runs = [pool.submit(stream_text, stack, prompt, 64, temperature=0) for _ in range(4)]
        wait_decoding(stack, "decode-1", runs)
        assert http_json(f"{stack.url}/admin/undrain", {"worker": "decode-0"})[0] == 200
        status, answer = http_json(f"{stack.url}/admin/remove", {"worker": "decode-1"})
        assert status == 200, answer
        assert (answer["removed"]["moved"], answer["removed"]["failed"]) == (4, 0)
        texts = [r.result(180) for r in runs]
    assert texts == [reference] * 4
    assert stack.launcher.procs["decode-1"].proc.returncode is not None
    assert stack.launcher.supervisor.states["decode-1"]["state"] == "removed"
    status, answer = http_json(f"{stack.url}/admin/remove", {"worker": "decode-0"})
    assert status == 400 and "last decode-capable" in answer["error"]["message"]
