"""Prefix reuse across the deployment, on the real stack (router, prefill and decode worker
processes, the official openai client): a prefix the decode worker computed is pulled by the
prefill worker through a grant instead of being computed again; a pull that fails is
computed instead. Greedy text equals transformers' and the engine's."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest
from transformers import AutoTokenizer

from hetero_pd import SamplingParams
from hetero_pd.deploy.testing import Stack, deployment, random_prompts, running_stack
from hetero_pd.engine.kv_cache_manager import prompt_block_hashes
from hetero_pd.models.config import ModelConfig
from hetero_pd.serving.control import values as V

DECISIONS = "hetero_pd_policy_decisions_total"
BYTES = "hetero_pd_kv_transfer_bytes_total"
#: Every data frame of the worker's KV stream is corrupted: every transfer it sends fails.
ALWAYS_CORRUPT = [{"kind": "corrupt", "msg_type": "data", "nth": 1, "count": 10**9}]
MAX_TOKENS = 10
SHARED = 64  # the shared prefix: 4 blocks of 16, prefilled on the decode worker itself
ROUTER = {"policy": "kv_aware", "local_prefill_max_tokens": SHARED}


def complete(stack: Stack, prompt: list[int]) -> str:
    client = openai.OpenAI(base_url=stack.base_url, api_key="x", max_retries=0, timeout=120)
    r = client.completions.create(
        model=stack.dep.model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    return r.choices[0].text


def wait_for(what: str, check: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not true after {timeout_s}s: {what}")
        time.sleep(0.05)


def load(stack: Stack, worker: str) -> V.WorkerLoad:
    assert stack.router is not None
    return stack.router.workers[worker].load


def expected(model_dir: Path, tiny_reference: Any, hf_greedy: Any, prompt: list[int]) -> str:
    """The engine's greedy text, checked against transformers' generate first."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    out = tiny_reference.llm.generate([prompt], params)[0].outputs[0]
    assert list(out.token_ids) == hf_greedy(model_dir, prompt, MAX_TOKENS)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert out.text == tokenizer.decode(out.token_ids, skip_special_tokens=True)
    return str(out.text)


def share_prefix(stack: Stack) -> tuple[list[int], list[int]]:
    """Computes a 64-token prompt on the decode worker (short: it prefills it itself) and
    waits until the decode worker's heartbeat reports its blocks; returns (prefix, a
    longer prompt sharing it)."""
    prefix, suffix = random_prompts([SHARED, 70], seed=31)
    complete(stack, prefix)
    assert stack.metric(DECISIONS, decision="local_prefill") == 1
    assert stack.router is not None
    held = stack.router.workers["decode-0"].held
    hashes = prompt_block_hashes(prefix, 16)
    # The worker's engine hashed its blocks exactly as the router hashes the prompt.
    wait_for("decode-0 reports the prefix", lambda: set(hashes) <= held.reported)
    return prefix, prefix + suffix


@pytest.mark.parametrize(
    ("transports", "tp"),
    [([], 1), (["tcp"], 1), (["tcp"], 2)],
    # tp2: both workers at TP 2; each offers or pulls through its ranks' whole-head cache.
    ids=["default", "tcp", "tp2-tcp"],
)
def test_prefill_worker_pulls_the_prefix_the_decode_worker_computed(
    tiny_llama_dir: Path, tiny_reference: Any, hf_greedy: Any, transports: list[str], tp: int
) -> None:
    transfer = {"transports": transports} if transports else {}
    workers = [{"role": r, "tensor_parallel_size": tp} for r in ("prefill", "decode")]
    dep = deployment(tiny_llama_dir, workers=workers, router=ROUTER, transfer=transfer)
    with running_stack(dep) as stack:
        prefix, prompt = share_prefix(stack)
        assert complete(stack, prefix) == expected(
            tiny_llama_dir, tiny_reference, hf_greedy, prefix
        )
        before = load(stack, "prefill-0").prompt_tokens_computed
        got = complete(stack, prompt)
        assert got == expected(tiny_llama_dir, tiny_reference, hf_greedy, prompt)
        assert stack.metric(DECISIONS, decision="disaggregated") == 1
        assert stack.metric(DECISIONS, decision="prefix_pull") == 1
        wait_for("a heartbeat counts the pull", lambda: load(stack, "prefill-0").prefix_pulls == 1)
        p = load(stack, "prefill-0")
        assert (p.prefix_pulled_tokens, p.prefix_pull_failures) == (SHARED, 0)
        # The prefill worker computed only the suffix: its prompt's prefix was a cache hit.
        assert p.prompt_tokens_computed - before == len(prompt) - SHARED
        received = sum(c.transfers_received_total for c in p.transfer.values())
        assert received == 1  # the pull's answer; the decode worker's push went out
        # The decode worker held the prefix too: only the suffix's blocks were pushed to it.
        cfg = ModelConfig.from_dir(tiny_llama_dir)
        block_bytes = 16 * cfg.kv_bytes_per_token * 4  # float32
        suffix_blocks = -(-(len(prompt) - SHARED) // 16)
        assert stack.metric(BYTES, transport="kv") == suffix_blocks * block_bytes
        stack.wait_idle()  # the holder's pins and the puller's blocks are all released


def test_a_failed_pull_computes_the_prefix(
    tiny_llama_dir: Path, tiny_reference: Any, hf_greedy: Any
) -> None:
    """Every KV frame the decode worker sends is corrupted, so the pull from it fails its
    checksums: the prefill worker computes the whole prompt; the answer is still right and
    nothing is left pinned or reserved."""
    transfer = {"transports": ["tcp"], "faults": {"decode-0": ALWAYS_CORRUPT}}
    dep = deployment(tiny_llama_dir, router=ROUTER, transfer=transfer)
    with running_stack(dep) as stack:
        _, prompt = share_prefix(stack)
        before = load(stack, "prefill-0").prompt_tokens_computed
        got = complete(stack, prompt)
        assert got == expected(tiny_llama_dir, tiny_reference, hf_greedy, prompt)
        assert stack.metric(DECISIONS, decision="prefix_pull") == 1
        wait_for("a heartbeat counts the failure",
                 lambda: load(stack, "prefill-0").prefix_pull_failures == 1)  # fmt: skip
        p = load(stack, "prefill-0")
        assert (p.prefix_pulls, p.prefix_pulled_tokens) == (0, 0)
        assert p.prompt_tokens_computed - before == len(prompt)
        stack.wait_idle()
