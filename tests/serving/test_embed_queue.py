"""A worker embeds a request's inputs one bounded pass per turn of its loop: an Embed of many
inputs once held the loop for all of them (no decode step, no heartbeat until it ended)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from hetero_pd.config import EngineConfig
from hetero_pd.engine.llm_engine import LLMEngine
from hetero_pd.serving.control import protocol as P
from hetero_pd.serving.worker.embeds import EmbedQueue


def test_each_turn_runs_one_bounded_pass_and_the_answer_is_the_whole(
    tiny_llama_dir: Path,
) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), num_kv_blocks=32, num_threads=1))
    inputs = [[(7 * i + j) % 90 + 3 for j in range(40 + i)] for i in range(10)]  # 445 tokens
    sent: list[tuple[bytes, Any]] = []
    passes: list[int] = []
    embed = engine.embed

    def counted(batch: list[list[int]]) -> torch.Tensor:
        passes.append(sum(map(len, batch)))
        return embed(batch)

    engine.embed = counted  # type: ignore[method-assign]
    queue = EmbedQueue(max_tokens=128)
    queue.add(b"router", P.Embed(rid="e1", inputs=inputs))
    queue.add(b"router", P.Embed(rid="e2", inputs=inputs[:1]))
    turns = 0
    while queue.busy:
        queue.step(engine, lambda ident, msg: sent.append((ident, msg)))
        turns += 1
        assert len(passes) == turns  # one pass a turn, never more
    assert max(passes[:-1]) <= 128 and sum(passes) == 445 + 40
    assert turns == len(passes) >= 6
    (_, first), (_, second) = sent
    assert isinstance(first, P.Embedded) and (first.rid, second.rid) == ("e1", "e2")
    got = torch.frombuffer(bytearray(first.vectors), dtype=torch.float32).view(10, first.dim)
    torch.testing.assert_close(got, embed(inputs), atol=1e-5, rtol=0)


def test_a_refused_embed_is_an_error_and_the_next_one_runs(tiny_llama_dir: Path) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), num_kv_blocks=32, num_threads=1))
    queue = EmbedQueue(max_tokens=64)
    sent: list[Any] = []
    queue.add(b"a", P.Embed(rid="gone", inputs=[[5, 6]]))
    queue.drop_owner(b"a")  # its router left: nothing to answer
    assert not queue.busy
    engine.embed = lambda batch: (_ for _ in ()).throw(ValueError("split worker"))  # type: ignore[method-assign]
    queue.add(b"b", P.Embed(rid="bad", inputs=[[5, 6]]))
    queue.step(engine, lambda ident, msg: sent.append(msg))
    assert isinstance(sent[0], P.Error) and "split worker" in sent[0].message
    assert not queue.busy
