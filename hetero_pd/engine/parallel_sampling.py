"""``n > 1``: several completions of one prompt that share its KV blocks.

An engine request is one completion. A ``ParentRequest`` fans ``n`` out into children: child
0 keeps the parent's id (a worker's reservation and KV hand-off are keyed by it), the others
get vLLM's ids (``"{index}_{parent id}"``) and parameters (``SamplingParams.for_completion``:
seed + index, prompt logprobs from the first child only). Child 0 goes first; the others
join once its prompt is computed, when every full block of the prompt is in the prefix
cache, so they compute only the prompt's last partial block and then decode (with prefix
caching off they compute the whole prompt). The children's outputs merge into one
``RequestOutput`` with ``n`` completions, ordered by index.
"""

from __future__ import annotations

import dataclasses

from hetero_pd.outputs import RequestOutput
from hetero_pd.sampling_params import SamplingParams


def check_engine_params(params: SamplingParams, vocab_size: int) -> None:
    """What one engine request can run: token ids inside the vocabulary (an id outside must
    never index the logits) and one completion (``n`` fans out above the engine)."""
    params.check_token_ids(vocab_size)
    if params.n != 1:
        raise ValueError(
            f"n={params.n}: an engine request is one completion; LLM.generate and the API "
            "fan n out into child requests (hetero_pd.engine.parallel_sampling)"
        )


class ParentRequest:
    """The ``n`` completions of one prompt while they run."""

    def __init__(self, request_id: str, params: SamplingParams) -> None:
        self.request_id = request_id
        self.params = params
        self.n = params.n
        self.started = 1  # children handed to the engine so far (child 0 first)
        self._latest: dict[int, RequestOutput] = {}
        self._ended: set[int] = set()  # children that finished elsewhere (live migration)

    @classmethod
    def arriving(cls, request_id: str, params: SamplingParams) -> ParentRequest:
        """The request moving here by live migration: every child started where it was;
        `end` the ones that finished there."""
        parent = cls(request_id, params)
        parent.started = parent.n
        return parent

    def end(self, index: int) -> None:
        self._ended.add(index)

    def done(self, index: int) -> bool:
        """Whether child `index` has finished."""
        out = self._latest.get(index)
        return index in self._ended or (out is not None and out.finished)

    def child_id(self, index: int) -> str:
        return f"{index}_{self.request_id}" if index else self.request_id

    def child_params(self, index: int) -> SamplingParams:
        return self.params.for_completion(index) if self.n > 1 else self.params

    def index_of(self, child_id: str) -> int:
        return 0 if child_id == self.request_id else int(child_id.split("_", 1)[0])

    def record(self, out: RequestOutput) -> list[int]:
        """Takes a child's output; returns the indices of the children to start now (all
        the others once child 0 has its first token, i.e. its prompt is computed)."""
        index = self.index_of(out.request_id)
        self._latest[index] = out
        if index != 0 or self.started == self.n:
            return []
        start, self.started = self.started, self.n
        return list(range(start, self.n))

    @property
    def finished(self) -> bool:
        return all(self.done(index) for index in range(self.n))

    def output(self) -> RequestOutput:
        """The merged output: one completion per child, in index order."""
        first = self._latest[0]
        completions = []
        for index in sorted(self._latest):
            completion = self._latest[index].outputs[0]
            completions.append(dataclasses.replace(completion, index=index))
        return dataclasses.replace(
            first, request_id=self.request_id, outputs=completions, finished=self.finished
        )
