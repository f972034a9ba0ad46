"""A decoding request leaves one engine and continues in another (the engine side of live
migration): its blocks' KV copied, its state snapshotted and adopted, the rest of its
tokens equal those of the engine that never let it go; a state that does not fit it is
refused with nothing changed in the batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hetero_pd import SamplingParams, StructuredOutputsParams
from hetero_pd.config import EngineConfig
from hetero_pd.engine import migration as E
from hetero_pd.engine.llm_engine import LLMEngine

PROMPT = list(range(3, 40))  # two full blocks and a partial one


def engine(model: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model), num_kv_blocks=64, num_threads=1))


def run(e: LLMEngine, steps: int) -> list[int]:
    tokens: list[int] = []
    for _ in range(steps):
        for out in e.step():
            tokens += out.outputs[0].delta_token_ids
    return tokens


def move(a: LLMEngine, b: LLMEngine, rid: str, params: SamplingParams) -> E.Snapshot:
    blocks, computed = E.pause(a, rid)
    snap = E.snapshot(a, rid)
    room = E.reserve(b, PROMPT, params, rid, 0, computed + 16)
    used = -(-computed // a.config.block_size)
    for src, dst in zip(a.runner.kv_tensors, b.runner.kv_tensors, strict=True):
        dst[room[:used]] = src[blocks[:used]]
    E.adopt(b, rid, snap)
    a.abort_request(rid)
    return snap


#: The grammar's state matters: after the a's only b's may follow.
ORDERED = StructuredOutputsParams(regex="a{3}b{80}")


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=0.9, seed=7, max_tokens=24, ignore_eos=True, logprobs=2),
], ids=["greedy", "seeded"])  # fmt: skip
def test_moved_request_continues_with_the_same_tokens(
    tiny_llama_dir: Path, params: SamplingParams
) -> None:
    check_move(tiny_llama_dir, params, 9)


def test_moved_request_keeps_its_grammar_state(text_llama_dir: Path) -> None:
    """The destination replays the grammar over the tokens so far (a fresh matcher would
    allow the a's again); the tiny text model, whose vocabulary is the default model's
    tokenizer's (the grammar is built for it). Without the replay its tokens differ right
    after the move (checked by dropping `grammar.accept` from `migration.adopt`)."""
    check_move(text_llama_dir, SamplingParams(temperature=0, structured_outputs=ORDERED), 5)


def check_move(model: Path, params: SamplingParams, steps: int) -> None:
    still = engine(model)
    still.add_request(PROMPT, params, "r")
    reference = run(still, 40)
    a, b = engine(model), engine(model)
    a.add_request(PROMPT, params, "r")
    before = run(a, steps)
    snap = move(a, b, "r", params)
    assert snap.output_ids == before and (snap.logprobs is None) == (params.logprobs is None)
    after = run(b, 40)
    assert before + after == reference
    assert not a.has_unfinished_requests()
    a.check_integrity()
    b.check_integrity()


def test_a_state_that_does_not_fit_is_refused(tiny_llama_dir: Path) -> None:
    params = SamplingParams(temperature=0.9, seed=7, max_tokens=24, ignore_eos=True)
    a, b = engine(tiny_llama_dir), engine(tiny_llama_dir)
    a.add_request(PROMPT, params, "r")
    run(a, 5)
    E.pause(a, "r")
    snap = E.snapshot(a, "r")
    bad = [
        E.Snapshot(**{**_fields(snap), "sent_chars": snap.sent_chars + 1}),
        E.Snapshot(**{**_fields(snap), "generator": None}),
        E.Snapshot(**{**_fields(snap), "output_ids": [10**6]}),
        E.Snapshot(**{**_fields(snap), "generator": b"\x00" * 3}),
    ]
    for i, state in enumerate(bad):
        E.reserve(b, PROMPT, params, f"r{i}", 0, 64)
        with pytest.raises(ValueError):
            E.adopt(b, f"r{i}", state)
        b.abort_request(f"r{i}")
    assert not b.scheduler.running
    b.check_integrity()
    E.resume(a, "r")  # called off: it decodes on where it was
    assert run(a, 30)


def _fields(snap: E.Snapshot) -> dict[str, object]:
    return {f: getattr(snap, f) for f in E.Snapshot.__dataclass_fields__}


def test_generator_state_round_trips() -> None:
    g = torch.Generator().manual_seed(3)
    torch.rand(5, generator=g)
    state = g.get_state().numpy().tobytes()
    h = torch.Generator().manual_seed(99)
    h.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
    assert torch.equal(torch.rand(4, generator=g), torch.rand(4, generator=h))
