"""Embeddings on a worker, one bounded forward pass per turn of its loop.

An Embed may hold 2,048 inputs of up to max_model_len tokens each. Run at once, it held the
worker's loop for all of them: no decode step, no transfer progress and no heartbeat until
it ended (a client could stall every request on the worker, and, past the heartbeat timeout,
make the router take the worker for dead). Here a request's inputs are cut into runs of at
most the engine's max_num_batched_tokens (engine/pooling.py `batches`), and each turn of the
loop runs one of them after its engine step, as a prefill chunk would; the answer goes back
when the last run is done. Requests are served in arrival order.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from hetero_pd.engine.pooling import batches
from hetero_pd.serving.control import protocol as P
from hetero_pd.serving.control import values as V

if TYPE_CHECKING:
    from hetero_pd.engine.llm_engine import LLMEngine


@dataclass(slots=True)
class _Job:
    ident: bytes
    rid: str
    runs: list[list[list[int]]]
    done: list[torch.Tensor] = field(default_factory=list)


class EmbedQueue:
    """The worker's Embed requests in flight; `step` runs one bounded pass of the first."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self._jobs: deque[_Job] = deque()

    @property
    def busy(self) -> bool:
        return bool(self._jobs)

    def add(self, ident: bytes, msg: P.Embed) -> None:
        self._jobs.append(_Job(ident, msg.rid, batches(msg.inputs, self.max_tokens)))

    def drop_owner(self, ident: bytes) -> None:
        """Forgets the requests of a router that is gone (no one would read the answer)."""
        self._jobs = deque(job for job in self._jobs if job.ident != ident)

    def step(self, engine: LLMEngine, send: Callable[[bytes, Any], None]) -> None:
        if not self._jobs:
            return
        job = self._jobs[0]
        try:
            job.done.append(engine.embed(job.runs[len(job.done)]))
        except ValueError as e:
            self._jobs.popleft()
            send(job.ident, P.Error(rid=job.rid, code=V.ErrorCode.BAD_REQUEST, message=str(e)))
            return
        if len(job.done) < len(job.runs):
            return
        self._jobs.popleft()
        vectors = torch.cat(job.done)
        blob = vectors.numpy().astype("<f4").tobytes()
        send(job.ident, P.Embedded(rid=job.rid, dim=vectors.shape[1], vectors=blob))
