"""Rebalancing (issue 31, opt-in, as Llumnix does) and live migration with speculative
decoding, on 1P2D stacks whose decode workers have a small KV cache and ngram speculation
on: requests pinned onto one decode worker move to the other once it is back, with the
unmigrated greedy text, and only while rebalancing is on (the tiny text model); a request
that decodes speculatively migrates mid-stream with the unmigrated text (the default model:
the suite's live migration of real weights, whose continuations of a repeated prompt are
accepted as a real model's are).

The pinned tests need their requests decoding while the router's rounds and moves happen:
the decode workers' steps are paced (test_migration.py's `paced`: each takes STEP_S at
least, the wait costing no CPU), so that 128 tokens, 65 steps with the ngram proposals the
tiny model accepts, decode for 6.4 s at least whatever the load, where the rounds and moves
they wait for take about a second."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from hetero_pd.deploy.testing import (
    Stack,
    deployment,
    http_json,
    random_prompts,
    running_stack,
    wait_gone,
)

from .test_migration import migrated_run, paced, stream_text, streams_on, wait_decoding

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
DECODE = {"role": "decode", "speculative_config": SPEC}
#: 64 blocks of 16 tokens per worker: four 100-token prompts fill 44% of one.
ENGINE = {"num_kv_blocks": 64}
REBALANCE = {
    "enabled": True, "high": 0.3, "low": 0.15, "interval_s": 0.2, "max_moves": 2,
    "cooldown_s": 2.0,
}  # fmt: skip
#: How long each decode step of the tiny model's stack takes at least.
STEP_S = 0.1
BY_REASON = "hetero_pd_migrations_by_reason_total"
DECISIONS = "hetero_pd_policy_decisions_total"
Reply = tuple[str, int, int]  # stream_text's: text, chunks with text, completion tokens


@pytest.fixture(scope="module")
def stack(text_llama_dir: Path) -> Iterator[Stack]:
    faults = {"decode-0": paced(STEP_S), "decode-1": paced(STEP_S)}
    dep = deployment(
        text_llama_dir, workers=[{"role": "prefill"}, DECODE, DECODE], engine=ENGINE,
        router={"rebalance": REBALANCE}, transfer={"faults": faults},
    )  # fmt: skip
    with running_stack(dep) as s:
        yield s


def set_rebalancing(stack: Stack, enabled: bool) -> None:
    assert stack.router is not None
    rebalancer = stack.router.rebalancer
    rebalancer.cfg = dataclasses.replace(rebalancer.cfg, enabled=enabled)


@contextlib.contextmanager
def pinned_on_decode_0(
    stack: Stack, prompts: list[list[int]], max_tokens: int
) -> Iterator[tuple[list[Reply], list[Future[Reply]]]]:
    """(the unmigrated greedy runs of `prompts`, the same prompts streaming again with all
    of them decoding on decode-0): decode-1 is drained while they start and back in
    rotation when this yields; rebalancing is off until it returns."""
    with ThreadPoolExecutor(len(prompts)) as pool:
        greedy = {"temperature": 0}
        reference = list(pool.map(lambda p: stream_text(stack, p, max_tokens, **greedy), prompts))
        assert http_json(f"{stack.url}/admin/drain", {"worker": "decode-1"})[0] == 200
        set_rebalancing(stack, False)
        try:
            runs = [pool.submit(stream_text, stack, p, max_tokens, **greedy) for p in prompts]
            wait_decoding(stack, "decode-0", runs)
            assert http_json(f"{stack.url}/admin/undrain", {"worker": "decode-1"})[0] == 200
            yield reference, runs
        finally:
            set_rebalancing(stack, True)
            http_json(f"{stack.url}/admin/undrain", {"worker": "decode-1"})


def test_rebalancing_moves_requests_off_a_full_decode_worker(stack: Stack) -> None:
    """Four requests decode on decode-0, whose KV usage is then above `high` while
    decode-1's is below `low`. With rebalancing off, the router sees that for three rounds
    and moves nothing; on, it moves some (at most max_moves per round) to decode-1, and
    every text equals its unmigrated run's."""
    assert stack.router is not None
    rebalancer = stack.router.rebalancer
    prompts = random_prompts([100, 100, 100, 100], seed=11)
    with pinned_on_decode_0(stack, prompts, 128) as (reference, runs):
        moved_before, moved = stack.metric(BY_REASON, reason="rebalance"), rebalancer.moved
        skipped = rebalancer.skipped
        while rebalancer.skipped < skipped + 3:  # rounds that saw the imbalance, off
            assert not any(r.done() for r in runs), "the requests ended before 3 rounds"
            time.sleep(0.02)
        assert streams_on(stack, "decode-0") == 4 and rebalancer.moved == moved
        set_rebalancing(stack, True)
        while rebalancer.moved == moved and not all(r.done() for r in runs):
            time.sleep(0.02)
        texts = [r.result(180) for r in runs]
    assert 1 <= rebalancer.moved - moved <= 4
    assert stack.metric(BY_REASON, reason="rebalance") == moved_before + rebalancer.moved - moved
    assert texts == reference
    stack.wait_idle()


def test_speculative_request_migrates_with_the_unmigrated_text(default_model_dir: Path) -> None:
    """A request of the default model whose prompt repeats itself (ngram proposals keep
    being accepted) moves to the other decode worker mid-stream; its greedy text and token
    count equal the unmigrated run's, and speculation went on (tokens accepted) on both
    workers. Its own stack: the module's is the tiny model's."""
    faults = {"decode-0": paced(0.05), "decode-1": paced(0.05)}
    dep = deployment(
        default_model_dir, workers=[{"role": "prefill"}, DECODE, DECODE], engine=ENGINE,
        transfer={"faults": faults},
    )  # fmt: skip
    prompt = ([7, 8, 9, 10, 11] * 20)[:100]
    with running_stack(dep) as stack:
        reference = stream_text(stack, prompt, 96, temperature=0)
        accepted = {w: accepted_tokens(stack, w) for w in ("decode-0", "decode-1")}
        got, result = migrated_run(stack, prompt, 96, temperature=0)
        assert result.ok, result.reason
        assert got[0] == reference[0] and got[2] == reference[2] == 96
        assert accepted_tokens(stack, result.dest) > accepted[result.dest]
        stack.wait_idle()


def accepted_tokens(stack: Stack, worker: str) -> float:
    return stack.metric("vllm:spec_decode_num_accepted_tokens_total", worker=worker)


def test_a_decode_worker_told_to_stop_moves_its_requests_first(stack: Stack) -> None:
    """SIGTERM to a decode worker (how Kubernetes stops a pod) while three requests decode
    on it: its heartbeat says it drains, the router moves all three to the other decode
    worker (no operator key anywhere), each with its unmigrated text and none recomputed,
    and then the worker exits. Last in this module: it stops decode-0."""
    prompts = random_prompts([40, 40, 40], seed=13)
    with pinned_on_decode_0(stack, prompts, 96) as (reference, runs):
        moved = stack.metric(BY_REASON, reason="shutdown")
        recomputed = stack.metric(DECISIONS, decision="recompute")
        pid = stack.pids["decode-0"]
        os.kill(pid, signal.SIGTERM)
        texts = [r.result(180) for r in runs]
    assert texts == reference
    assert stack.metric(BY_REASON, reason="shutdown") == moved + 3
    assert stack.metric(DECISIONS, decision="recompute") == recomputed
    assert not wait_gone([pid], 30)
