"""`hetero-pd bench tp MODEL --handoff`: KV handed from prefill at TP 2 to decode at TP 1,
against TP 1 -> TP 1, on this host: writes per request and bytes/s.

One 1P1D stack per prefill TP size (real worker processes, the transport chosen), whole
pushes (so a push's seconds are its transfer's own, not a layer's compute), one warm-up
request (the link), then `requests` prompts of `prompt_tokens` tokens, one output token
each::

    writes per request  prefill-0's chunks_sent_total (heartbeat) / requests
    bytes/s             the router's hetero_pd_kv_transfer_bytes_total / _seconds_sum

A TP worker's region holds every KV head (engine/tp/kv.py), so the writes should match.
"""

from __future__ import annotations

import time
from pathlib import Path

import openai

from hetero_pd.deploy.testing import Stack, deployment, random_prompts, running_stack

BYTES = "hetero_pd_kv_transfer_bytes_total"
SECONDS = "hetero_pd_kv_transfer_seconds_sum"
DECISIONS = "hetero_pd_policy_decisions_total"


def sent(stack: Stack, transport: str, at_least_bytes: float) -> tuple[int, int]:
    """prefill-0's (chunks, bytes) sent over `transport`, once its heartbeats report at
    least `at_least_bytes` (what the router saw moved)."""
    assert stack.router is not None
    deadline = time.monotonic() + 30
    while True:
        counters = stack.router.workers["prefill-0"].load.transfer.get(transport)
        chunks, nbytes = (0, 0) if counters is None else (
            counters.chunks_sent_total, counters.bytes_sent_total
        )  # fmt: skip
        if nbytes >= at_least_bytes:
            return chunks, nbytes
        if time.monotonic() > deadline:
            raise RuntimeError(f"prefill-0 reported {nbytes} bytes sent of {at_least_bytes}")
        time.sleep(0.05)


def handoff(
    model: Path, prefill_tp: int, transport: str, requests: int, prompt_tokens: int
) -> dict[str, float]:
    """Writes per request, KV bytes per request and bytes/s of prefill TP `prefill_tp` ->
    decode TP 1 over `transport`."""
    dep = deployment(
        model,
        workers=[{"role": "prefill", "tensor_parallel_size": prefill_tp}, {"role": "decode"}],
        transfer={"transports": [transport]},
        engine={"max_model_len": prompt_tokens + 16},
    )
    warm, *prompts = random_prompts([prompt_tokens] * (requests + 1), seed=29)
    with running_stack(dep) as stack:
        client = openai.OpenAI(base_url=stack.base_url, api_key="x", max_retries=0, timeout=120)

        def complete(prompt: list[int]) -> None:
            client.completions.create(
                model=dep.model, prompt=prompt, max_tokens=1, temperature=0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip

        complete(warm)
        bytes0, seconds0 = (
            stack.metric(BYTES, transport="kv"),
            stack.metric(SECONDS, transport="kv"),
        )
        chunks0, _ = sent(stack, transport, bytes0)
        for prompt in prompts:
            complete(prompt)
        moved = stack.metric(BYTES, transport="kv") - bytes0
        seconds = stack.metric(SECONDS, transport="kv") - seconds0
        chunks, _ = sent(stack, transport, bytes0 + moved)
        handed = stack.metric(DECISIONS, decision="disaggregated")
        if handed != requests + 1:
            raise RuntimeError(
                f"{handed:.0f} of {requests + 1} prompts went through the prefill worker: "
                "make --prompt-tokens longer than router.local_prefill_max_tokens"
            )
    return {
        "writes_per_request": (chunks - chunks0) / requests,
        "kv_bytes_per_request": moved / requests,
        "bytes_per_s": round(moved / seconds) if seconds > 0 else 0.0,
    }


def compare(model: Path, transport: str, requests: int, prompt_tokens: int) -> dict[str, object]:
    """TP 2 -> 1 beside TP 1 -> 1: the bench's `kv_handoff` entry."""
    matched = handoff(model, 1, transport, requests, prompt_tokens)
    mismatched = handoff(model, 2, transport, requests, prompt_tokens)
    return {
        "transport": transport,
        "requests": requests,
        "prompt_tokens": prompt_tokens,
        "tp1_to_tp1": matched,
        "tp2_to_tp1": mismatched,
        "writes_ratio": mismatched["writes_per_request"] / matched["writes_per_request"],
        "bytes_per_s_ratio": round(mismatched["bytes_per_s"] / max(matched["bytes_per_s"], 1), 3),
    }
