"""Scheduler decisions with no model: every step samples a fake token for each chunk that
reaches the end of its request's known tokens."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from hetero_pd.engine.block_pool import NoFreeBlocksError
from hetero_pd.engine.kv_cache_manager import KVCacheManager
from hetero_pd.engine.request import Request, RequestStatus
from hetero_pd.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from hetero_pd.sampling_params import SamplingParams

EOS = 99
FILLER = 7


def make_scheduler(
    num_blocks: int = 64, block_size: int = 4, caching: bool = True, **config: Any
) -> Scheduler:
    return Scheduler(SchedulerConfig(**config), KVCacheManager(num_blocks, block_size, caching))


def make_request(
    rid: str, prompt_len: int, priority: int = 0, first_token: int = 1000, **params: Any
) -> Request:
    """A prompt of distinct tokens (no accidental prefix hits between requests)."""
    params.setdefault("max_tokens", 16)
    prompt = list(range(first_token, first_token + prompt_len))
    return Request(rid, prompt, SamplingParams(**params), frozenset([EOS]), priority=priority)


def step(
    s: Scheduler, tokens: dict[str, int] | None = None
) -> tuple[SchedulerOutput, list[Request]]:
    """One step; requests that sample get tokens[rid], else FILLER."""
    out = s.schedule()
    sampled = {
        c.request.request_id: [(tokens or {}).get(c.request.request_id, FILLER)]
        for c in out.chunks
        if c.samples
    }
    done = s.update(out, sampled)
    s.kv.check_integrity()
    return out, done


def layout(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(c.request.request_id, c.num_tokens) for c in out.chunks]


def run_to_end(s: Scheduler, max_steps: int = 200) -> Iterator[SchedulerOutput]:
    for _ in range(max_steps):
        if not s.has_unfinished():
            return
        yield step(s)[0]
    raise AssertionError(f"still unfinished after {max_steps} steps: the scheduler is stuck")


def assert_idle(s: Scheduler) -> None:
    assert not s.has_unfinished() and not s.held and not s.requests
    assert s.kv.num_used_blocks == 0, "blocks still in use"
    s.kv.check_integrity()


# -- batching ------------------------------------------------------------------------------


def test_decode_is_scheduled_before_prefill_chunks() -> None:
    s = make_scheduler(max_num_batched_tokens=4)
    a = make_request("a", 1, priority=1)
    s.add_request(a)
    assert layout(step(s)[0]) == [("a", 1)]
    # b has the better priority, yet the decoding request is served first
    s.add_request(make_request("b", 8, priority=0, first_token=2000))
    assert layout(step(s)[0]) == [("a", 1), ("b", 3)]
    assert layout(step(s)[0]) == [("a", 1), ("b", 3)]
    # single-token chunks come first in the output, even one admitted after a prefill chunk
    s.add_request(make_request("c", 1, priority=-1, first_token=3000))
    out, _ = step(s)
    assert layout(out) == [("a", 1), ("c", 1), ("b", 2)]


def test_long_prompt_is_chunked_under_the_token_budget() -> None:
    s = make_scheduler(block_size=4, max_num_batched_tokens=8)
    req = make_request("long", 21, max_tokens=3)
    s.add_request(req)
    sizes, computed, blocks = [], [], []
    for out in run_to_end(s):
        assert out.num_tokens <= 8
        sizes += [c.num_tokens for c in out.chunks]
        computed.append(req.num_computed_tokens)
        blocks.append(len(req.block_ids))
        if req.status.finished:
            break
    assert sizes == [8, 8, 5, 1, 1]
    assert computed[:3] == [8, 16, 21]
    assert blocks[:3] == [2, 4, 6]
    assert req.output_token_ids == [FILLER] * 3
    assert req.status is RequestStatus.FINISHED_LENGTH
    assert_idle(s)


def test_only_the_last_prefill_chunk_samples() -> None:
    s = make_scheduler(max_num_batched_tokens=5)
    s.add_request(make_request("a", 12))
    samples = []
    for _ in range(3):
        out = s.schedule()
        samples.append([(c.num_tokens, c.samples) for c in out.chunks])
        s.update(out, {c.request.request_id: [FILLER] for c in out.chunks if c.samples})
    assert samples == [[(5, False)], [(5, False)], [(2, True)]]


def test_max_num_seqs_is_respected() -> None:
    s = make_scheduler(max_num_seqs=2)
    for i in range(5):
        s.add_request(make_request(f"r{i}", 3, first_token=1000 * (i + 1), max_tokens=2))
    seen = []
    for out in run_to_end(s):
        assert len(s.running) <= 2
        assert len(out.chunks) <= 2
        seen += [c.request.request_id for c in out.chunks if c.num_tokens > 1]
    assert seen == [f"r{i}" for i in range(5)]
    assert_idle(s)


def test_waiting_requests_are_admitted_by_priority_then_arrival() -> None:
    s = make_scheduler()
    for rid, priority in [("p2", 2), ("p0a", 0), ("p1", 1), ("p0b", 0), ("neg", -3)]:
        s.add_request(make_request(rid, 3, priority=priority, first_token=100 * len(s.requests)))
    out, _ = step(s)
    assert [c.request.request_id for c in out.chunks] == ["neg", "p0a", "p0b", "p1", "p2"]


# -- preemption ----------------------------------------------------------------------------


def fill_until_preempted(s: Scheduler, max_steps: int = 20) -> SchedulerOutput:
    for _ in range(max_steps):
        out, _ = step(s)
        if out.preempted:
            return out
    raise AssertionError("no preemption happened")


def test_preemption_frees_the_latest_request_and_recomputes_it_later() -> None:
    # 6 blocks of 4 tokens: two requests of 8-token prompts fit until each needs 4 blocks
    s = make_scheduler(num_blocks=6, caching=False)
    a = make_request("a", 8, max_tokens=6)
    b = make_request("b", 8, first_token=2000, max_tokens=6)
    s.add_request(a)
    s.add_request(b)
    out = fill_until_preempted(s)
    assert out.preempted == ["b"]
    assert layout(out) == [("a", 1)]
    assert b.status is RequestStatus.PREEMPTED and b.block_ids == []
    assert b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert b in s.waiting and b not in s.running
    generated = b.output_token_ids
    assert b.num_tokens == 8 + len(generated) == 13, "preempted when it needed a 4th block"
    assert s.kv.num_used_blocks == len(a.block_ids)

    recompute = None
    for out in run_to_end(s):
        for c in out.chunks:
            if c.request is b and recompute is None:
                recompute = c.num_tokens
    # the recompute covers the prompt and the tokens generated before the preemption
    assert recompute == 8 + len(generated)
    assert b.output_token_ids[: len(generated)] == generated
    assert len(a.output_token_ids) == len(b.output_token_ids) == 6
    assert a.num_preemptions == 0
    assert_idle(s)


def test_preemption_victim_is_the_lowest_priority() -> None:
    s = make_scheduler(num_blocks=6, caching=False)
    low = make_request("low", 8, priority=1, max_tokens=6)
    high = make_request("high", 8, priority=0, first_token=2000, max_tokens=6)
    s.add_request(low)  # arrives first but has the worse priority
    s.add_request(high)
    out = fill_until_preempted(s)
    assert out.preempted == ["low"]
    assert low.status is RequestStatus.PREEMPTED
    list(run_to_end(s))
    assert low.status is high.status is RequestStatus.FINISHED_LENGTH
    assert_idle(s)


def test_a_request_that_cannot_grow_preempts_itself_when_it_is_last() -> None:
    s = make_scheduler(num_blocks=5, caching=False)
    a = make_request("a", 8, max_tokens=8)
    b = make_request("b", 4, first_token=2000, max_tokens=8)
    s.add_request(a)
    s.add_request(b)
    # a (2 blocks) and b (1 block) grow; b, scheduled last, finds nothing left to take
    out = fill_until_preempted(s)
    assert out.preempted == ["b"]
    list(run_to_end(s))
    assert len(a.output_token_ids) == len(b.output_token_ids) == 8
    assert_idle(s)


def test_a_request_longer_than_the_cache_finishes_instead_of_waiting_forever() -> None:
    s = make_scheduler(num_blocks=2, block_size=4)
    req = make_request("a", 6, max_tokens=20)
    s.add_request(req)
    list(run_to_end(s, max_steps=20))
    assert req.status is RequestStatus.FINISHED_LENGTH
    assert req.num_tokens == 2 * 4 + 1, "stops once the KV of every token no longer fits"
    assert_idle(s)


# -- finishing -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "tokens", "n_out", "reason", "stop_reason"),
    [
        ({}, [5, EOS, 5], 2, "stop", None),
        ({"stop_token_ids": [42]}, [5, 6, 42, 5], 3, "stop", 42),
        ({"stop_token_ids": [42]}, [EOS], 1, "stop", None),
        ({"max_tokens": 3}, [5, 6, 7, 8], 3, "length", None),
        ({"ignore_eos": True, "max_tokens": 4}, [EOS, EOS, EOS, EOS], 4, "length", None),
        ({"min_tokens": 3}, [EOS, EOS, EOS, 5], 3, "stop", None),
        ({"min_tokens": 2, "stop_token_ids": [42]}, [42, 5, 42], 3, "stop", 42),
    ],
)
def test_finish_reasons(
    params: dict[str, Any], tokens: list[int], n_out: int, reason: str, stop_reason: int | None
) -> None:
    s = make_scheduler()
    req = make_request("r", 5, **params)
    s.add_request(req)
    finished_at = None
    for i, token in enumerate(tokens):
        _, done = step(s, {"r": token})
        if done:
            assert done == [req]
            finished_at = i + 1
            break
    assert finished_at == n_out
    assert req.output_token_ids == tokens[:n_out]
    assert req.status.finish_reason == reason
    assert req.stop_reason == stop_reason
    assert_idle(s)


def test_max_model_len_finishes_with_length() -> None:
    s = make_scheduler(max_model_len=12)
    req = make_request("r", 10, max_tokens=None)
    s.add_request(req)
    list(run_to_end(s))
    assert req.num_tokens == 12
    assert req.status.finish_reason == "length"
    assert_idle(s)


# -- abort ---------------------------------------------------------------------------------


def test_abort_frees_blocks_from_waiting_running_and_preempted() -> None:
    s = make_scheduler(num_blocks=6, caching=False, max_num_batched_tokens=16)
    a = make_request("a", 8, max_tokens=10)
    b = make_request("b", 8, first_token=2000, max_tokens=10)
    waiting = make_request("w", 12, first_token=3000)
    for req in (a, b, waiting):
        s.add_request(req)
    step(s)
    assert a.status is RequestStatus.RUNNING and a.block_ids
    assert waiting.status is RequestStatus.WAITING
    fill_until_preempted(s)
    assert b.status is RequestStatus.PREEMPTED
    for req in (waiting, b, a):
        assert s.abort(req.request_id) is req
        assert req.status is RequestStatus.FINISHED_ABORTED
        assert req.status.finish_reason == "abort"
        assert req.block_ids == []
        s.kv.check_integrity()
    assert s.abort("a") is None
    assert s.abort("never-added") is None
    assert_idle(s)


def test_abort_in_the_middle_of_a_chunked_prefill() -> None:
    s = make_scheduler(max_num_batched_tokens=4)
    req = make_request("r", 20)
    s.add_request(req)
    step(s)
    assert req.block_ids and req.num_computed_tokens == 4
    s.abort("r")
    assert not s.schedule()
    assert_idle(s)


# -- roles ---------------------------------------------------------------------------------


def test_prefill_role_holds_blocks_until_released() -> None:
    s = make_scheduler(role="prefill", max_num_batched_tokens=8)
    req = make_request("r", 13)
    s.add_request(req)
    _, done = step(s)
    assert done == [] and req.status is RequestStatus.RUNNING
    _, done = step(s, {"r": 321})
    assert done == [req]
    assert req.status is RequestStatus.KV_READY
    assert req.output_token_ids == [321]
    assert s.held == {"r": req} and req not in s.running
    assert not s.has_unfinished() and not s.schedule(), "a KV_READY request must not decode"
    assert s.kv.num_used_blocks == len(req.block_ids) == 4
    s.release_held("r")
    assert req.status is RequestStatus.FINISHED_STOPPED and req.block_ids == []
    assert_idle(s)


def test_prefill_role_abort_of_a_held_request() -> None:
    s = make_scheduler(role="prefill")
    req = make_request("r", 5)
    s.add_request(req)
    step(s)
    assert req.status is RequestStatus.KV_READY
    assert s.abort("r") is req
    assert req.status is RequestStatus.FINISHED_ABORTED
    assert_idle(s)


def test_prefill_role_rejects_remote_kv() -> None:
    s = make_scheduler(role="prefill")
    with pytest.raises(ValueError, match="prefill-role engine does not accept remote KV"):
        s.add_remote(make_request("r", 5))


def test_decode_role_reserves_blocks_and_joins_the_batch() -> None:
    s = make_scheduler(role="decode")
    running = make_request("local", 3, first_token=5000)
    s.add_request(running)
    step(s)
    req = make_request("remote", 9)
    blocks = s.add_remote(req)
    assert len(blocks) == 3 and blocks == req.block_ids
    assert req.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    assert s.kv.num_used_blocks == 4
    out, _ = step(s)
    assert all(c.request is not req for c in out.chunks), "scheduled before its KV arrived"
    s.remote_kv_ready("remote", 555)
    assert req.status is RequestStatus.RUNNING
    assert req.num_computed_tokens == 9 and req.output_token_ids == [555]
    out, _ = step(s)
    assert ("remote", 1) in layout(out), "joins the decode batch with a single token"
    assert req.block_ids[:3] == blocks
    list(run_to_end(s))
    assert len(req.output_token_ids) == 16
    assert_idle(s)


def test_decode_role_first_token_can_finish_the_request() -> None:
    s = make_scheduler(role="decode")
    req = make_request("r", 5, max_tokens=1)
    s.add_remote(req)
    s.remote_kv_ready("r", 1)
    assert req.status is RequestStatus.FINISHED_LENGTH
    assert_idle(s)


def test_decode_role_back_pressure_when_full() -> None:
    s = make_scheduler(num_blocks=4, role="decode")
    s.add_remote(make_request("a", 12))
    with pytest.raises(NoFreeBlocksError, match=r"request b: no room for 8 tokens.*1 blocks free"):
        s.add_remote(make_request("b", 8, first_token=2000))
    assert "b" not in s.requests
    assert s.kv.num_used_blocks == 3
    s.abort("a")
    s.add_remote(make_request("b", 8, first_token=2000))  # the same id is usable again
    s.abort("b")
    assert_idle(s)


def test_decode_role_failed_transfer_recomputes_the_prompt() -> None:
    s = make_scheduler(role="decode", max_num_batched_tokens=64)
    req = make_request("r", 9, max_tokens=2)
    s.add_remote(req)
    s.remote_kv_failed("r")
    assert req.status is RequestStatus.WAITING and req.block_ids == []
    assert s.kv.num_used_blocks == 0
    out, _ = step(s)
    assert layout(out) == [("r", 9)]
    list(run_to_end(s))
    assert req.status is RequestStatus.FINISHED_LENGTH
    assert_idle(s)


def test_abort_of_a_request_waiting_for_remote_kv() -> None:
    s = make_scheduler(role="decode")
    req = make_request("r", 9)
    s.add_remote(req)
    assert s.abort("r") is req
    assert req.status is RequestStatus.FINISHED_ABORTED
    assert "r" not in s.remote
    assert_idle(s)


# -- bad requests --------------------------------------------------------------------------


def test_bad_requests_are_rejected_with_clear_messages() -> None:
    s = make_scheduler(num_blocks=8, block_size=4, max_model_len=64)
    with pytest.raises(ValueError, match="request empty: the prompt is empty"):
        s.add_request(Request("empty", [], SamplingParams()))
    with pytest.raises(ValueError, match=r"prompt has 64 tokens, the limit is .* = 63"):
        s.add_request(make_request("long", 64))
    with pytest.raises(ValueError, match=r"32 prompt tokens need more KV blocks .* \(8\)"):
        s.add_request(make_request("huge", 32))
    with pytest.raises(ValueError, match=r"32 prompt tokens need more KV blocks .* \(8\)"):
        Scheduler(SchedulerConfig(role="decode"), KVCacheManager(8, 4)).add_remote(
            make_request("huge", 32)
        )
    s.add_request(make_request("dup", 3))
    with pytest.raises(ValueError, match="request id 'dup' is already in use"):
        s.add_request(make_request("dup", 3))
    assert list(s.requests) == ["dup"] and len(s.waiting) == 1
    s.abort("dup")
    assert_idle(s)


def test_bad_scheduler_config() -> None:
    with pytest.raises(ValueError, match=r"role must be one of .* got 'both-ish'"):
        SchedulerConfig(role="both-ish")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_num_seqs must be > 0, got 0"):
        SchedulerConfig(max_num_seqs=0)


def test_decode_role_reuses_its_cached_prefix_for_remote_kv() -> None:
    """A remote prompt extending one computed here holds the cached full blocks (shared,
    ref-counted) and reserves fresh blocks for the rest only; the last prompt token's block
    is never served from the cache, even when every full block is cached."""
    s = make_scheduler(role="decode", max_num_batched_tokens=64)
    turn1 = make_request("t1", 10, max_tokens=1)
    s.add_request(turn1)
    list(run_to_end(s))  # blocks [1000..1003], [1004..1007] are now cached
    longer = make_request("t2", 14, max_tokens=2)
    blocks = s.add_remote(longer, reuse_prefix=True)
    assert longer.num_cached_tokens == 8 and longer.num_computed_tokens == 8
    assert len(blocks) == 4 and s.kv.num_used_blocks == 4
    # The same 8 tokens as the whole prompt: only 1 full block may come from the cache.
    exact = make_request("t3", 8, max_tokens=2)
    s.add_remote(exact, reuse_prefix=True)
    assert exact.num_cached_tokens == 4 and exact.block_ids[0] == blocks[0]
    assert s.kv.pool.blocks[blocks[0]].ref_cnt == 2
    s.remote_kv_ready("t2", 555)
    s.remote_kv_failed("t3")  # falls back: recomputes with its cached block found again
    list(run_to_end(s))
    assert longer.output_token_ids[0] == 555 and len(exact.output_token_ids) == 2
    assert_idle(s)


def test_decode_role_reuse_off_reserves_the_whole_prompt() -> None:
    s = make_scheduler(role="decode", max_num_batched_tokens=64)
    s.add_request(make_request("t1", 10, max_tokens=1))
    list(run_to_end(s))
    again = make_request("t2", 14, max_tokens=1)
    assert len(s.add_remote(again)) == 4 and again.num_cached_tokens == 0
    s.abort("t2")
    assert_idle(s)
