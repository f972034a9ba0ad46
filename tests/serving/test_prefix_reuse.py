"""Suffix-only KV transfer: a decode worker serves a disaggregated prompt's prefix from its own
prefix cache, and the prefill worker pushes only the blocks after it. Multi-turn chat on the
real stack (router, prefill and decode processes, the official openai client): the bytes on
the wire (the router's `hetero_pd_kv_transfer_bytes_total`) are the suffix's blocks x the
bytes of one block (from the model's config), and the greedy text equals the engine's."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from hetero_pd import SamplingParams
from hetero_pd.config import parse_dtype
from hetero_pd.deploy.testing import Stack, deployment, random_prompts, running_stack
from hetero_pd.models.config import ModelConfig
from transfer import RemoteBlocks

BYTES = "hetero_pd_kv_transfer_bytes_total"
DECISIONS = "hetero_pd_policy_decisions_total"
#: Every data frame of the prefill worker's KV stream is corrupted: every transfer fails.
ALWAYS_CORRUPT = [{"kind": "corrupt", "msg_type": "data", "nth": 1, "count": 10**9}]
MAX_TOKENS = 12


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


class Chat:
    """One stack's view for the test: block geometry and a counted, checked completion."""

    def __init__(self, stack: Stack, model_dir: Path) -> None:
        assert stack.router is not None
        self.stack = stack
        self.model_dir = model_dir
        self.block_size = stack.router.workers["decode-0"].info.block_size
        assert self.block_size == stack.router.workers["prefill-0"].info.block_size > 0
        cfg = ModelConfig.from_dir(model_dir)
        elem = torch.tensor([], dtype=parse_dtype(stack.dep.dtype)).element_size()
        self.block_bytes = self.block_size * cfg.kv_bytes_per_token * elem
        self.client = openai.OpenAI(
            base_url=stack.base_url, api_key="unused", max_retries=0, timeout=60
        )

    def blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def complete(self, prompt: list[int]) -> tuple[str, float]:
        """The greedy text and the KV bytes its hand-off moved."""
        before = self.stack.metric(BYTES, transport="kv")
        r = self.client.completions.create(
            model=self.stack.dep.model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        return r.choices[0].text, self.stack.metric(BYTES, transport="kv") - before


def reference(ref: Any, prompt: list[int]) -> tuple[str, list[int]]:
    out = ref.llm.generate([prompt], greedy())[0].outputs[0]
    return out.text, list(out.token_ids)


#: (model, layer-wise push): Llama both ways; a mixture of experts (Qwen3-MoE) and MLA
#: (DeepSeek-V3: one latent tensor per layer, no heads, so its blocks have their own size)
#: once each, MLA layer-wise, where a layer's tensors are pushed as they are computed.
CHATS = [
    pytest.param(("tiny_llama_dir", False), id="llama-whole"),
    pytest.param(("tiny_llama_dir", True), id="llama-layerwise"),
    pytest.param(("tiny_qwen3_moe_dir", False), id="moe-whole"),
    pytest.param(("tiny_deepseek_v3_dir", True), id="mla-layerwise"),
]


@pytest.fixture(scope="module", params=CHATS)
def chat(request: pytest.FixtureRequest) -> Iterator[Chat]:
    model_fixture, layerwise = request.param
    model_dir: Path = request.getfixturevalue(model_fixture)
    # least_loaded: the router does not count the decode worker's prefix as computed, so
    # every long prompt goes through the prefill worker (the path under test).
    transfer = {"layerwise": True, "transports": ["shm"]} if layerwise else {}
    dep = deployment(model_dir, router={"policy": "least_loaded"}, transfer=transfer)
    with running_stack(dep) as stack:
        yield Chat(stack, model_dir)


def test_multi_turn_chat_transfers_only_the_new_suffix(
    chat: Chat, reference_for: Callable[[Path], Any]
) -> None:
    ref = reference_for(chat.model_dir)
    bs = chat.block_size
    turn1, more, other = random_prompts([120, 60, 100], seed=71)
    text1, out1 = reference(ref, turn1)
    got, nbytes = chat.complete(turn1)
    assert got == text1
    assert nbytes == chat.blocks(len(turn1)) * chat.block_bytes, "no prefix: the whole prompt"

    # Turn 2 extends turn 1 (its prompt and answer): decode computed every token of it but
    # the answer's last one, so those tokens' full blocks are in its prefix cache.
    turn2 = turn1 + out1 + more
    cached = (len(turn1) + len(out1) - 1) // bs * bs
    assert 0 < cached < len(turn2)
    got, nbytes = chat.complete(turn2)
    assert got == reference(ref, turn2)[0]
    suffix_bytes = chat.blocks(len(turn2) - cached) * chat.block_bytes
    assert nbytes == suffix_bytes < chat.blocks(len(turn2)) * chat.block_bytes

    # Every full block cached: the last token's block is still sent (its logits are needed).
    same = turn2[: len(turn2) // bs * bs]
    got, nbytes = chat.complete(same)
    assert got == reference(ref, same)[0]
    assert nbytes == chat.block_bytes

    # An unrelated prompt shares nothing: everything is sent, as before.
    got, nbytes = chat.complete(other)
    assert got == reference(ref, other)[0]
    assert nbytes == chat.blocks(len(other)) * chat.block_bytes
    assert chat.stack.metric(DECISIONS, decision="disaggregated") == 4
    assert chat.stack.metric(DECISIONS, decision="recompute") == 0
    chat.stack.wait_idle()


def test_failed_suffix_transfer_recomputes_with_the_cached_prefix(
    tiny_llama_dir: Path, tiny_reference: Any
) -> None:
    """Every transfer fails its checksum (recompute policy): the decode worker, holding its
    cached prefix for the reservation, computes the prompt itself; the answer is the
    engine's and no block is left in use on either worker."""
    dep = deployment(
        tiny_llama_dir,
        router={"policy": "least_loaded", "failure_policy": "recompute"},
        transfer={"transports": ["tcp"], "faults": {"prefill-0": ALWAYS_CORRUPT}},
    )
    with running_stack(dep) as stack:
        chat = Chat(stack, tiny_llama_dir)
        turn1, more = random_prompts([100, 50], seed=72)
        text1, out1 = reference(tiny_reference, turn1)
        assert chat.complete(turn1)[0] == text1  # recomputed on decode: now in its cache
        turn2 = turn1 + out1 + more
        assert chat.complete(turn2)[0] == reference(tiny_reference, turn2)[0]
        assert stack.metric(DECISIONS, decision="recompute") == 2
        stack.wait_idle()  # every block free again, pools consistent


@pytest.mark.parametrize(
    ("cached", "reuse", "ok"),
    [(32, True, True), (0, False, True), (33, True, False), (48, True, False), (16, False, False)],
)
def test_the_router_refuses_a_decode_workers_claim_of_cached_tokens(
    cached: int, reuse: bool, ok: bool
) -> None:
    """A decode worker's Reserved comes over the control socket: a cached-token count that is
    not whole blocks, covers the prompt, or answers a Reserve that asked no reuse would make
    the prefill worker skip KV the decode worker does not hold. It is a 502, never used."""
    from types import SimpleNamespace

    from hetero_pd.serving.control import protocol as P
    from hetero_pd.serving.router.errors import RouterError
    from hetero_pd.serving.router.handoff import Handoff

    flow = SimpleNamespace(prompt_len=40)
    blocks = RemoteBlocks("r", 1, (3,), "decode-0")
    msg = P.Reserved(rid="r", blocks=blocks, cached_tokens=cached)
    if ok:
        assert Handoff._check_cached(flow, msg, reuse, 16) == cached  # type: ignore[arg-type]
    else:
        with pytest.raises(RouterError) as e:
            Handoff._check_cached(flow, msg, reuse, 16)  # type: ignore[arg-type]
        assert (e.value.status, e.value.code) == (502, "bad_worker_reply")


def test_decode_prefix_reuse_off_moves_the_whole_prompt(
    tiny_llama_dir: Path, tiny_reference: Any
) -> None:
    """`router.decode_prefix_reuse: false` (the comparison `bench routing` makes): decode
    receives every block of turn 2, though its cache holds turn 1, and answers the same."""
    router = {"policy": "least_loaded", "decode_prefix_reuse": False}
    with running_stack(deployment(tiny_llama_dir, router=router)) as stack:
        chat = Chat(stack, tiny_llama_dir)
        turn1, more = random_prompts([120, 60], seed=71)
        text1, out1 = reference(tiny_reference, turn1)
        assert chat.complete(turn1)[0] == text1
        turn2 = turn1 + out1 + more
        got, nbytes = chat.complete(turn2)
        assert got == reference(tiny_reference, turn2)[0]
        assert nbytes == chat.blocks(len(turn2)) * chat.block_bytes
        stack.wait_idle()
