"""Routing policies (round robin, least loaded, prefix aware, kv aware) and conditional
disaggregation with elastic prefill, on workers described by their load and the prefix
blocks the router knows they hold; then elastic prefill on a real stack."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import openai
import pytest

from hetero_pd.deploy.testing import deployment, random_prompts, running_stack
from hetero_pd.engine.kv_cache_manager import prompt_block_hashes
from hetero_pd.serving.control import protocol as P
from hetero_pd.serving.control import sampling as W
from hetero_pd.serving.control import values as V
from hetero_pd.serving.router.policy import POLICIES, Chooser, RoutingConfig
from hetero_pd.serving.router.prefix_index import HeldBlocks

DECISIONS = "hetero_pd_policy_decisions_total"


def worker(
    worker_id: str, backlog: int = 0, running: int = 0, kv: float = 0.0, holds: list[int] = ()
) -> Any:
    """A worker as the chooser sees it: an id, a load report, the router's counts and the
    prefix blocks it reported (the full blocks of `holds`, block size 4)."""
    load = V.WorkerLoad(running=running, waiting_tokens=backlog, kv_usage=kv)
    held = HeldBlocks()
    held.report(V.CachedBlocks.of(1, prompt_block_hashes(list(holds), 4)))
    return SimpleNamespace(
        worker_id=worker_id,
        load=load,
        info=V.WorkerInfo(block_size=4, num_blocks=100),
        held=held,
        inflight={},
        prompt_tokens_given=0,
        backlog_tokens=backlog,
        load_score=backlog + 16.0 * running,
    )


def test_every_policy_has_a_test() -> None:
    tested = {"round_robin", "least_loaded", "prefix_aware", "kv_aware"}
    assert set(POLICIES) == tested


def test_round_robin_takes_turns_per_candidate_set() -> None:
    chooser = Chooser(RoutingConfig(policy="round_robin"))
    p = [worker("p0"), worker("p1")]
    d = [worker("d0")]
    picks = []
    for _ in range(4):
        # the decode pick must not advance prefill's turn
        picks.append(chooser.pick(d)[0].worker_id)
        picks.append(chooser.pick(p)[0].worker_id)
    assert picks == ["d0", "p0", "d0", "p1", "d0", "p0", "d0", "p1"]


def test_least_loaded_takes_the_smallest_backlog() -> None:
    chooser = Chooser(RoutingConfig(policy="least_loaded"))
    assert chooser.pick([worker("a", 500), worker("b", 20), worker("c", 90)])[0].worker_id == "b"


def test_prefix_aware_prefers_the_worker_holding_the_prefix_unless_much_busier() -> None:
    chooser = Chooser(RoutingConfig(policy="prefix_aware", block_size=4))
    a, b = worker("a", 100), worker("b", 0)
    prompt = list(range(20))
    chooser.record(a, prompt)  # routed there: held until a report can confirm it
    assert chooser.pick([a, b], [*prompt, 99]) == (a, 20)
    assert chooser.pick([a, b], [7] * 20)[0] is b  # no prefix held: least loaded
    busy = worker("a", 5000)
    busy.held = a.held
    assert chooser.pick([busy, b], prompt)[0] is b  # the holder is far busier


def test_prefix_aware_finds_a_prefill_worker_by_its_own_report() -> None:
    """The router never records a prompt on a worker here: the prefill workers' heartbeats
    report what their caches hold, so the prefill pick matches too."""
    chooser = Chooser(RoutingConfig(policy="prefix_aware", block_size=4))
    prompt = list(range(24))
    p0, p1 = worker("p0", 10), worker("p1", 30, holds=prompt[:16])
    assert chooser.pick([p0, p1], prompt) == (p1, 16)
    p1.held.report(V.CachedBlocks.of(2, []))  # evicted since
    assert chooser.pick([p0, p1], prompt) == (p0, 0)


def test_kv_aware_weighs_prompt_blocks_to_compute_against_work_queued() -> None:
    """cost = weight x (prompt blocks not cached there) + queued blocks + KV blocks in use
    (block size 4): the holder of 16 of 24 tokens saves 4 blocks."""
    prompt = list(range(24))
    chooser = Chooser(RoutingConfig(policy="kv_aware", block_size=4))
    idle, holder = worker("idle"), worker("holder", backlog=8, holds=prompt)
    assert chooser.cost(idle, 24, 0) == 6
    assert chooser.cost(holder, 24, 24) == 2  # 0 to compute + 2 queued
    assert chooser.pick([idle, holder], prompt) == (holder, 24)
    busier = worker("holder", backlog=40, holds=prompt)  # 10 queued blocks > 6 saved
    assert chooser.pick([idle, busier], prompt) == (idle, 0)
    full = worker("holder", kv=0.5, holds=prompt)  # 50 of 100 blocks in use
    assert chooser.pick([idle, full], prompt)[0] is idle
    # a higher weight prefers the cache hit even on the busier worker
    heavy = Chooser(RoutingConfig(policy="kv_aware", block_size=4, kv_overlap_weight=4.0))
    assert heavy.pick([idle, busier], prompt)[0] is busier
    # weight 0: load only; equal costs go to the less loaded one
    flat = Chooser(RoutingConfig(policy="kv_aware", block_size=4, kv_overlap_weight=0.0))
    assert flat.pick([holder, idle], prompt)[0] is idle


def test_kv_aware_holder_for_a_pull_never_counts_the_last_tokens_block() -> None:
    chooser = Chooser(RoutingConfig(policy="kv_aware", block_size=4))
    prompt = list(range(16))
    a, b = worker("a", holds=prompt[:8]), worker("b", holds=prompt)
    # b holds all 4 blocks, but the block holding the last token is always computed
    assert chooser.holder([a, b], prompt) == (b, 12)
    assert chooser.holder([a], prompt) == (a, 8)
    assert chooser.holder([worker("c")], prompt) == (None, 0)


def test_conditional_disaggregation() -> None:
    elastic = Chooser(RoutingConfig(local_prefill_max_tokens=32))
    fixed = Chooser(RoutingConfig(local_prefill_max_tokens=32, elastic_prefill=False))
    idle_p, busy_p = [worker("p", 0)], [worker("p", 3000)]
    idle_d, busy_d, full_d = worker("d"), worker("d", 400, running=8), worker("d", kv=0.9)
    for chooser in (elastic, fixed):
        assert chooser.prefill_locally(500, 0, [], idle_d)  # no prefill worker
        assert chooser.prefill_locally(500, 480, idle_p, busy_d)  # uncached part is short
        assert not chooser.prefill_locally(500, 0, idle_p, idle_d)  # prefill is free
    # Elastic: an idle decode worker takes a prompt while prefill is busy...
    assert elastic.prefill_locally(500, 0, [worker("p", 100)], idle_d)
    assert not fixed.prefill_locally(500, 0, [worker("p", 100)], idle_d)
    # ...a busy one a short prompt only when prefill's backlog outgrows its whole job, a long
    # one only when prefill is past its queue limit, and never when full.
    assert not elastic.prefill_locally(60, 0, [worker("p", 400)], busy_d)
    assert elastic.prefill_locally(60, 0, busy_p, busy_d)
    assert not elastic.prefill_locally(500, 0, busy_p, busy_d)
    assert elastic.prefill_locally(500, 0, [worker("p", 9000)], busy_d)
    assert not elastic.prefill_locally(60, 0, busy_p, full_d)
    assert fixed.prefill_locally(500, 0, [worker("p", 9000)], busy_d)  # the old queue limit


def test_elastic_prefill_keeps_long_prompts_off_a_running_decode_batch() -> None:
    """Each prompt token a decode worker computes delays every running request's next
    token (issue 30: short requests' TPOT p99 rose 1.82x when long prompts came among
    them). With requests running there, a prompt longer than `elastic_busy_max_tokens` goes
    to the prefill worker even when that one has a long prompt queued, unless prefill is
    past `prefill_queue_limit_tokens`; an empty batch still takes it."""
    chooser = Chooser(RoutingConfig(local_prefill_max_tokens=32))
    running = worker("d", running=4)
    one_queued = [worker("p", 1024)]
    assert not chooser.prefill_locally(1024, 0, one_queued, running)
    assert chooser.prefill_locally(60, 0, one_queued, running)  # a short one still goes
    # Requests the router sent there are its batch before a heartbeat says so, those still
    # waiting for their KV too: they decode beside whatever it computes next.
    sent = worker("d")
    sent.inflight = {"a": None, "b": None}  # lengths unknown here
    assert not chooser.prefill_locally(1024, 0, [worker("p", 100)], sent)
    assert chooser.prefill_locally(1024, 0, [worker("p", 100)], worker("d"))  # empty batch
    assert chooser.prefill_locally(1024, 0, [worker("p", 9000)], running)  # prefill hopeless


def test_elastic_prefill_sizes_a_prompt_to_the_outputs_in_flight() -> None:
    """Beside requests of many output tokens a decode worker takes a longer prompt: its
    stall is spread over their output. Each request may be stalled by prompts of up to
    `elastic_tokens_per_output` (6) x its max_tokens, all of them together, and a prompt
    goes there only while the prefill worker is busier (issue 30: on two cores, 1P1D's
    256-token prompts queued behind one another for the one prefill core while the decode
    worker's requests of 64 tokens could have absorbed them)."""
    chooser = Chooser(RoutingConfig(local_prefill_max_tokens=32))
    queued = [worker("p", 256)]  # a 256-token prompt ahead on the prefill worker

    def decoding(*max_tokens: int, by: Chooser = chooser) -> Any:
        d = worker("d")
        for i, n in enumerate(max_tokens):
            d.inflight[f"r{i}"] = by.stall_until(d, W.WireParams(max_tokens=n))
        d.inflight["prefill-only"] = None
        return d

    long_outputs = decoding(64, 128)
    assert chooser.busy_prompt_limit(long_outputs) == 6 * 64
    assert chooser.prefill_locally(256, 0, queued, long_outputs)
    assert not chooser.prefill_locally(400, 0, [worker("p", 400)], long_outputs)  # > 384
    assert not chooser.prefill_locally(256, 0, [worker("p", 100)], long_outputs)  # P is sooner
    # What the first request could absorb, it has absorbed after 256 + 128 tokens.
    long_outputs.prompt_tokens_given += 256
    assert chooser.busy_prompt_limit(long_outputs) == 128
    assert not chooser.prefill_locally(256, 0, queued, long_outputs)
    long_outputs.prompt_tokens_given += 128
    assert chooser.busy_prompt_limit(long_outputs) == 64  # the floor still holds
    assert chooser.prefill_locally(64, 0, queued, long_outputs)

    assert not chooser.prefill_locally(256, 0, queued, decoding(64, 16))  # > max(64, 6 x 16)
    # Requests only a heartbeat reports (their length unknown) leave the floor.
    assert not chooser.prefill_locally(256, 0, queued, worker("d", running=3))
    off = Chooser(RoutingConfig(local_prefill_max_tokens=32, elastic_tokens_per_output=0))
    assert not off.prefill_locally(256, 0, queued, decoding(64, 128, by=off))
    assert chooser.stall_until(worker("d"), W.WireParams(max_tokens=None)) >= 6 * (1 << 20)


def test_a_tpot_target_spends_its_headroom_over_the_decode_step_on_prompts() -> None:
    """With `tpot_slo_ms`, a request on a decode worker absorbs as many prompt tokens per
    output token as half the target's headroom over the worker's decode step buys at its
    cost per prompt token, as its heartbeat reports them (issue 30: at 100 ms TPOT and
    25 ms steps, 1P1D's requests of 64 tokens absorbed 384 prompt tokens while their TPOT
    stayed at a third of the target and the prompts waited for the one prefill core)."""
    queued = [worker("p", 256)]
    measured = worker("d")
    measured.load = V.WorkerLoad(decode_step_s=0.025, prompt_token_s=0.0008)
    target = Chooser(RoutingConfig(local_prefill_max_tokens=32, tpot_slo_ms=100))
    assert target.tokens_per_output(measured) == pytest.approx(0.5 * 0.075 / 0.0008)
    measured.inflight["r"] = target.stall_until(measured, W.WireParams(max_tokens=64))
    assert abs(measured.inflight["r"] - 3000) <= 1  # prompt tokens: 47 per output token
    measured.prompt_tokens_given += 2048
    assert target.prefill_locally(256, 0, queued, measured)
    measured.prompt_tokens_given += 768
    assert not target.prefill_locally(256, 0, queued, measured)  # ~184 left

    # Never less than elastic_tokens_per_output: no target, a worker that has not measured
    # both costs, or a decode step already over the target.
    for chooser, load in [
        (Chooser(RoutingConfig()), V.WorkerLoad(decode_step_s=0.025, prompt_token_s=0.0008)),
        (target, V.WorkerLoad(decode_step_s=0.025)),
        (target, V.WorkerLoad(prompt_token_s=0.0008)),
        (target, V.WorkerLoad(decode_step_s=0.150, prompt_token_s=0.0008)),
    ]:
        d = worker("d")
        d.load = load
        assert chooser.tokens_per_output(d) == 6.0
    # A worker reporting a vanishing cost (5e-324 s) makes the allowance large, not infinite.
    tiny = worker("d")
    tiny.load = V.WorkerLoad(decode_step_s=0.025, prompt_token_s=5e-324)
    assert target.stall_until(tiny, W.WireParams(max_tokens=None)) == int(1e6) * (1 << 20)


def test_a_heartbeats_step_costs_are_checked() -> None:
    """The costs a heartbeat reports steer routing: NaN, infinite or negative ones are
    refused with the frame by the router's own codec, as every other field's bad value is."""
    codec = P.router_codec()
    good = P.Heartbeat(worker="decode-0", load=V.WorkerLoad(prompt_token_s=0.0008))
    assert codec.decode(codec.encode(good)).load.prompt_token_s == 0.0008
    for bad in (float("nan"), float("inf"), -0.001, 1e9):
        raw = msgspec.msgpack.decode(codec.encode(good))
        raw["load"]["prompt_token_s"] = bad
        with pytest.raises(V.MessageError, match="prompt_token_s"):
            codec.decode(msgspec.msgpack.encode(raw))


def test_a_clients_max_tokens_cannot_spend_another_requests_allowance() -> None:
    """max_tokens comes from API clients. A hostile one asking for the most the wire allows
    (or none: until EOS) raises only its own allowance: the limit is the least left among
    the requests there, so a victim of 16 tokens keeps the floor. One asking for a single
    token only brings back the floor, the rule before it had this allowance."""
    chooser = Chooser(RoutingConfig(local_prefill_max_tokens=32))
    queued = [worker("p", 4096)]
    d = worker("d")
    d.inflight["victim"] = chooser.stall_until(d, W.WireParams(max_tokens=16))
    d.inflight["hostile"] = chooser.stall_until(d, W.WireParams(max_tokens=None))
    assert chooser.busy_prompt_limit(d) == 6 * 16 < 4096
    assert not chooser.prefill_locally(4096, 0, queued, d)
    tiny = worker("d")
    tiny.inflight["a"] = chooser.stall_until(tiny, W.WireParams(max_tokens=1))
    tiny.inflight["b"] = chooser.stall_until(tiny, W.WireParams(max_tokens=64))
    assert chooser.busy_prompt_limit(tiny) == 64  # elastic_busy_max_tokens


def test_elastic_prefill_uses_an_idle_decode_worker(
    tiny_llama_dir: Path, tiny_reference: Any
) -> None:
    """Eight long prompts at once on 1P1D: with elastic prefill the decode worker computes
    some prompts itself while the prefill worker works through its queue; every answer
    equals the engine's. Their 50 output tokens each let a decode worker with requests in
    flight take one of these 300-token prompts (6 x 50): the router records what each
    request decoding there can absorb."""
    from hetero_pd import SamplingParams

    dep = deployment(tiny_llama_dir, router={"elastic_prefill": True})
    prompts = random_prompts([300] * 8, seed=5)
    expected = tiny_reference.texts(
        prompts, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    )
    with running_stack(dep) as stack:

        async def run() -> list[str]:
            client = openai.AsyncOpenAI(base_url=stack.base_url, api_key="x", max_retries=0)
            async with client:

                async def one(prompt: list[int]) -> str:
                    r = await client.completions.create(
                        model=dep.model,
                        prompt=prompt,
                        max_tokens=50,
                        temperature=0,
                        extra_body={"ignore_eos": True},
                    )
                    return r.choices[0].text

                return list(await asyncio.gather(*(one(p) for p in prompts)))

        assert asyncio.run(asyncio.wait_for(run(), 120)) == expected
        local = stack.metric(DECISIONS, decision="local_prefill")
        disaggregated = stack.metric(DECISIONS, decision="disaggregated")
        assert local >= 1 and disaggregated >= 1 and local + disaggregated == 8
        assert all(w.pending_tokens == 0 for w in stack.router.workers.values())
        # The decode worker computed prompts and decoded: its heartbeats tell the router
        # what each cost (what a TPOT target weighs).
        decode = stack.router.workers["decode-0"]
        deadline = time.monotonic() + 30
        while not (decode.load.decode_step_s and decode.load.prompt_token_s):
            assert time.monotonic() < deadline, decode.load
            time.sleep(0.1)
        stack.wait_idle()
