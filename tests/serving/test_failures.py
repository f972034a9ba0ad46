"""Failures follow the deployment's policy and never give a wrong answer, leak a block or
hang: a prefill worker killed under load (recompute, fail), KV transfers that keep failing
their checksums (recompute, fail, retry on another prefill worker), a single corrupted frame,
a prefill slower than the decode worker waits, a client leaving during a shared-memory
write, shutdown with requests in flight."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec
import openai
import pytest

from hetero_pd import SamplingParams
from hetero_pd.deploy.testing import Stack, deployment, random_prompts, running_stack, wait_gone

DECISIONS = "hetero_pd_policy_decisions_total"
#: Every data frame of the prefill worker's KV stream has a byte flipped: each chunk fails
#: its checksum on every attempt, so the transfer fails with CHECKSUM_MISMATCH.
ALWAYS_CORRUPT = [{"kind": "corrupt", "msg_type": "data", "nth": 1, "count": 10**9}]
#: Only the first data frame is corrupted: the transfer engine resends it by itself.
CORRUPT_ONCE = [{"kind": "corrupt", "msg_type": "data", "nth": 1, "count": 1}]
#: Every KV push of the prefill worker starts 0.3 s late, so pushes are in flight for a while.
#: A killed worker is not restarted: these tests check what the router does without it (the
#: supervisor's restart, 0.5 s later, could bring it back mid-test on a slow machine).
STAYS_DOWN = {"restart": False}
LATE_BEGIN = [{"kind": "delay", "msg_type": "begin", "nth": 1, "count": 10**9, "delay_s": 0.3}]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def complete_all(
    stack: Stack, prompts: list[list[int]], max_tokens: int, timeout_s: float = 60.0
) -> list[str | BaseException]:
    """Sends every prompt at once (greedy); each result is the text or the exception."""

    async def run() -> list[str | BaseException]:
        client = openai.AsyncOpenAI(base_url=stack.base_url, api_key="unused", max_retries=0)
        async with client:

            async def one(prompt: list[int]) -> str:
                r = await client.completions.create(
                    model=stack.dep.model, prompt=prompt, max_tokens=max_tokens,
                    temperature=0, extra_body={"ignore_eos": True},
                )  # fmt: skip
                return r.choices[0].text

            tasks = [asyncio.wait_for(one(p), timeout_s) for p in prompts]
            return list(await asyncio.gather(*tasks, return_exceptions=True))

    return asyncio.run(run())


def transfer_metrics(stack: Stack, worker: str) -> dict[str, Any]:
    """The worker's transfer-engine counters by transport, from its latest heartbeat."""
    assert stack.router is not None
    load = stack.router.workers[worker].load
    return {name: msgspec.structs.asdict(c) for name, c in load.transfer.items()}


def tcp(metrics: dict[str, Any], name: str) -> float:
    return float(metrics.get("tcp", {}).get(name, 0))


# -- kill -9 a prefill worker under load -------------------------------------------------------
def test_killed_prefill_worker_recompute_on_decode(
    tiny_llama_dir: Path, tiny_reference: Any
) -> None:
    """SIGKILL the prefill worker while it holds requests (its KV pushes are held back by a
    fault rule so that they are in flight): every request still completes with the right
    text, recomputed on the decode worker; later prompts are prefilled there directly."""
    dep = deployment(
        tiny_llama_dir,
        router={"failure_policy": "recompute"},
        transfer={"faults": {"prefill-0": LATE_BEGIN}},
        supervisor=STAYS_DOWN,
    )
    prompts = random_prompts([40, 64, 90, 120, 150, 200, 260, 333, 48, 77, 99, 400], seed=31)
    expected = tiny_reference.texts(prompts, greedy(16))
    with running_stack(dep) as stack:
        assert stack.router is not None
        prefill = stack.router.workers["prefill-0"]
        before = stack.metrics()
        assert load_and_kill(stack, "prefill-0", prompts, 16) == expected
        assert delta(stack, before, DECISIONS, decision="recompute") >= 4
        assert stack.metric("hetero_pd_worker_up", worker="prefill-0", role="prefill") == 0
        # It stays out: a dead worker must not flap back into rotation (the router's
        # watchdog looks every 1.25 s here).
        watch_until = time.monotonic() + 1.6
        while time.monotonic() < watch_until:
            assert not prefill.alive
            time.sleep(0.02)

        # The prefill worker is out of rotation: prompts are prefilled on the decode worker.
        before = stack.metrics()
        more = random_prompts([70, 130], seed=32)
        assert complete_all(stack, more, 16) == tiny_reference.texts(more, greedy(16))
        assert delta(stack, before, DECISIONS, decision="local_prefill") == 2
        assert set(stack.wait_idle()) == {"decode-0"}


def load_and_kill(
    stack: Stack, worker: str, prompts: list[list[int]], max_tokens: int
) -> list[str | BaseException]:
    """Sends every prompt at once and SIGKILLs `worker` once it holds at least 4 of them;
    returns what each request got (bounded: 90 s in all)."""
    assert stack.router is not None
    client = stack.router.workers[worker]
    pid = stack.pids[worker]

    async def run() -> list[str | BaseException]:
        results = asyncio.create_task(asyncio.to_thread(complete_all, stack, prompts, max_tokens))
        deadline = time.monotonic() + 20
        while len(client.inflight) < 4:  # written on the stack's loop; only read here
            assert time.monotonic() < deadline, f"requests never reached {worker}"
            await asyncio.sleep(0.005)
        os.kill(pid, signal.SIGKILL)
        return await results

    results = asyncio.run(asyncio.wait_for(run(), 90))
    assert wait_gone([pid], 5.0) == []
    return results


def delta(stack: Stack, before: str, name: str, **labels: str) -> float:
    from hetero_pd.deploy.testing import metric_value

    return stack.metric(name, **labels) - metric_value(before, name, **labels)


# -- a prefill slower than the decode worker is willing to wait ------------------------------
def test_decode_stops_waiting_for_a_slow_prefill(tiny_llama_dir: Path, tiny_reference: Any) -> None:
    """The decode worker waits 1 s for a prompt's KV; the prefill worker's push is held back
    2 s. The decode worker computes the prompt itself, and its whole answer reaches the
    client (nothing streamed while the router still waited for the prefill is lost)."""
    late = [{"kind": "delay", "msg_type": "begin", "nth": 1, "count": 10**9, "delay_s": 2.0}]
    dep = deployment(
        tiny_llama_dir,
        transfer={"remote_kv_timeout_s": 1.0, "faults": {"prefill-0": late}},
    )
    prompts = random_prompts([90, 150], seed=95)
    with running_stack(dep) as stack:
        assert complete_all(stack, prompts, 40) == tiny_reference.texts(prompts, greedy(40))
        assert stack.metric(DECISIONS, decision="recompute") == 2
        stack.wait_idle()


# -- an abort while a shared-memory write may still be landing ------------------------------
def test_abort_during_shared_memory_write(tiny_llama_dir: Path, tiny_reference: Any) -> None:
    """The client of A gives up while the prefill worker's direct write into the decode
    worker's blocks is still granted (its END frame is held back). Those blocks must not be
    reused until the grant is over: the next request gets other blocks and the right answer,
    the decode worker stays up, and A's blocks are freed once the grant has expired."""
    late_end = [{"kind": "delay", "msg_type": "end", "nth": 1, "count": 10**9, "delay_s": 0.8}]
    dep = deployment(
        tiny_llama_dir,
        transfer={"transports": ["shm"], "grant_s": 2.0, "faults": {"prefill-0": late_end}},
    )
    a, b = random_prompts([200, 180], seed=91)
    with running_stack(dep) as stack:
        client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0)
        with pytest.raises(openai.APITimeoutError):
            client.completions.create(
                model=stack.dep.model, prompt=a, max_tokens=8, timeout=0.4
            )  # gives up before the held-back END reaches the decode worker
        assert stack.router is not None
        decode = stack.router.workers["decode-0"]
        deadline = time.monotonic() + 10
        while decode.inflight:  # the router has sent its abort
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert complete_all(stack, [b], 8) == tiny_reference.texts([b], greedy(8))
        assert decode.alive and not decode.gone
        stack.wait_idle(timeout_s=15)


# -- transfers that keep failing --------------------------------------------------------------
def corrupt_deployment(model: Path, policy: str, *more_faults: dict[str, Any]) -> Any:
    faults = {"prefill-0": [*ALWAYS_CORRUPT, *more_faults]}
    return deployment(
        model,
        router={"failure_policy": policy},
        transfer={"transports": ["tcp"], "faults": faults},
        supervisor=STAYS_DOWN,
    )


def test_corrupted_transfer_recompute(tiny_llama_dir: Path, tiny_reference: Any) -> None:
    prompts = random_prompts([50, 120, 300, 75, 20, 10], seed=41)
    expected = tiny_reference.texts(prompts, greedy(12))
    with running_stack(corrupt_deployment(tiny_llama_dir, "recompute")) as stack:
        before = stack.metrics()
        assert complete_all(stack, prompts, 12) == expected
        code = {"code": "CHECKSUM_MISMATCH"}
        assert delta(stack, before, "hetero_pd_kv_transfer_failures_total", **code) == 4
        assert delta(stack, before, DECISIONS, decision="recompute") == 4
        assert delta(stack, before, DECISIONS, decision="local_prefill") == 2
        stack.wait_idle()
        wait_for(lambda: transfer_metrics(stack, "decode-0"), "checksum_failures_total", 4)


def test_fail_policy_corrupted_transfer_and_killed_worker(
    tiny_llama_dir: Path, tiny_reference: Any
) -> None:
    """`fail`: a request whose KV cannot be handed over gets a clear 503, streamed or not,
    and so do those held by a prefill worker that is killed; nothing hangs, and the service
    goes on (short prompts, then every prompt, are prefilled on the decode worker)."""
    long, short = random_prompts([100, 12], seed=51)
    # Each attempt's END frame is held back a little, so that failing transfers stay in
    # flight long enough for the kill to catch some.
    late_end = {"kind": "delay", "msg_type": "end", "nth": 1, "count": 10**9, "delay_s": 0.1}
    dep = corrupt_deployment(tiny_llama_dir, "fail", late_end)
    with running_stack(dep) as stack:
        client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0)
        for streamed in (False, True):
            with pytest.raises(openai.InternalServerError) as info:
                client.completions.create(
                    model=stack.dep.model, prompt=long, max_tokens=8, stream=streamed
                )  # a stream fails before its first chunk: the HTTP status says it
            assert info.value.status_code == 503
            err = info.value.response.json()["error"]
            assert err["type"] == "server_error" and err["code"] == "prefill_failed"
            assert "CHECKSUM_MISMATCH" in err["message"]
        assert stack.metric(DECISIONS, decision="fail") == 2
        # Prompts short enough to be prefilled on the decode worker are not affected.
        assert complete_all(stack, [short], 8) == tiny_reference.texts([short], greedy(8))
        stack.wait_idle()

        prompts = random_prompts([60, 80, 100, 120, 140, 160, 180, 200], seed=52)
        expected = tiny_reference.texts(prompts, greedy(8))
        died = 0
        for got, want in zip(load_and_kill(stack, "prefill-0", prompts, 8), expected, strict=True):
            if isinstance(got, str):  # reached the router after the kill: prefilled locally
                assert got == want
                continue
            assert isinstance(got, openai.InternalServerError) and got.status_code == 503, got
            err = got.response.json()["error"]
            assert err["code"] == "prefill_failed", err
            died += "WORKER_DIED" in err["message"]
        assert died >= 4, died  # at least those it held when it was killed
        assert set(stack.wait_idle()) == {"decode-0"}


def test_retry_on_other_prefill_worker(tiny_llama_dir: Path, tiny_reference: Any) -> None:
    """prefill-0 corrupts every KV frame, prefill-1 only its first one. Round robin sends
    half the prompts to prefill-0 first: those are retried on prefill-1. The frame that
    prefill-1 corrupted once is resent by its transfer engine, invisibly to the router."""
    dep = deployment(
        tiny_llama_dir,
        workers=[{"role": "prefill", "count": 2}, {"role": "decode"}],
        router={"failure_policy": "retry", "policy": "round_robin"},
        transfer={
            "transports": ["tcp"],
            "faults": {"prefill-0": ALWAYS_CORRUPT, "prefill-1": CORRUPT_ONCE},
        },
        # Stopping takes up to two graces (requests, then workers): short ones keep the
        # shutdown drill's 30 s bound generous on a loaded machine (it took 31 s with 10 s).
        # Its streams ask for ~1000 tokens each, so they are still running at any grace.
        supervisor={"stop_grace_s": 1.0},
    )
    prompts = random_prompts([60, 140, 90, 200], seed=61)
    expected = tiny_reference.texts(prompts, greedy(10))
    with running_stack(dep) as stack:
        for prompt, text in zip(prompts, expected, strict=True):  # one at a time
            assert complete_all(stack, [prompt], 10) == [text]
        assert stack.metric(DECISIONS, decision="retry") == 2
        assert stack.metric(DECISIONS, decision="recompute") == 0
        p1 = wait_for(lambda: transfer_metrics(stack, "prefill-1"), "transfers_done_total", 4)
        assert stack.router.workers["prefill-1"].load.transfer_faults_injected == 1
        assert tcp(p1, "transfers_failed_total") == 0 and tcp(p1, "retries_total") >= 1
        stack.wait_idle()
        shutdown_with_requests_in_flight(stack)


def wait_for(read: Any, name: str, value: float, timeout_s: float = 10.0) -> dict[str, Any]:
    """Polls heartbeat metrics until the tcp counter `name` reaches `value`."""
    deadline = time.monotonic() + timeout_s
    while True:
        metrics: dict[str, Any] = read()
        if tcp(metrics, name) >= value:
            return metrics
        assert time.monotonic() < deadline, f"{name} never reached {value}: {metrics}"
        time.sleep(0.05)


def shutdown_with_requests_in_flight(stack: Stack) -> None:
    """Stopping the stack while answers stream: it stops within bounds, no worker process
    is left, and every client sees its answer end (finished or cut), none hangs."""
    prompts = random_prompts([80, 16, 300], seed=71)
    started = [threading.Event() for _ in prompts]
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=30)

    def stream(i: int) -> str:
        try:
            chunks = client.completions.create(
                model=stack.dep.model, prompt=prompts[i], max_tokens=1000 - len(prompts[i]),
                stream=True, extra_body={"ignore_eos": True},
            )  # fmt: skip
            for n, _ in enumerate(chunks):
                if n == 1:
                    started[i].set()
            return "finished"
        except (openai.APIError, ConnectionError) as e:
            return f"cut: {type(e).__name__}"
        finally:
            started[i].set()

    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(stream, i) for i in range(len(prompts))]
        for event in started:
            assert event.wait(20)
        t0 = time.monotonic()
        stack.close()  # also checks that no worker process is left
        assert time.monotonic() - t0 < 30
        outcomes = [f.result(timeout=30) for f in futures]
    assert all(o == "finished" or o.startswith("cut") for o in outcomes), outcomes
