"""A batch's streams merged: messages as they come with their prompt's answer, and the
first error ends the merge with every other stream stopped (so its request is aborted)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from hetero_pd.serving.api.choices import Answer, Batch
from hetero_pd.serving.api.protocol import parse_completion_request
from hetero_pd.serving.control.protocol import Output
from hetero_pd.serving.router.router import RouterError


def answers(n_prompts: int) -> list[Answer]:
    req = parse_completion_request({"model": "m", "prompt": [[1, 2]] * n_prompts, "n": 2})
    return [Answer(one, [1, 2], str, base=i * 2) for i, one in enumerate(req.each_prompt())]


def out(index: int, text: str, seq: int, finish: str | None = None) -> Output:
    return Output(rid="r", seq=seq, index=index, text=text, token_ids=[5],
                  finish_reason=finish, completion_tokens=1)  # fmt: skip


def test_choices_of_a_batch_are_numbered_per_prompt() -> None:
    async def main() -> list[tuple[int, str]]:
        async def stream(tag: str) -> AsyncIterator[Output]:
            for j in range(2):
                await asyncio.sleep(0)
                yield out(j, f"{tag}{j}", j, "length")

        batch = Batch(answers(2))
        got = []
        async for answer, msg in batch.merge([stream("a"), stream("b")]):
            answer.add(msg)
            got.append((answer.base + msg.index, msg.text))
        body = batch.body()
        assert [(c["index"], c["text"]) for c in body["choices"]] == sorted(got)
        assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8}
        return got

    assert sorted(asyncio.run(main())) == [(0, "a0"), (1, "a1"), (2, "b0"), (3, "b1")]


def test_the_first_error_stops_every_stream() -> None:
    closed: list[str] = []

    async def main() -> None:
        async def failing() -> AsyncIterator[Output]:
            yield out(0, "x", 0)
            raise RouterError(503, "worker died", "worker_died")

        async def endless() -> AsyncIterator[Output]:
            try:
                seq = 0
                while True:
                    await asyncio.sleep(0.01)
                    yield out(0, "y", seq)
                    seq += 1
            finally:
                closed.append("endless")

        with pytest.raises(RouterError, match="worker died"):
            async for _ in Batch(answers(2)).merge([failing(), endless()]):
                pass

    asyncio.run(main())
    assert closed == ["endless"]
