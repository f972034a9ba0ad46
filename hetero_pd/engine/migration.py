"""A decoding request leaving this engine or arriving in it with its KV (live migration).

Leaving: `pause` takes it out of the batch with its blocks kept, `snapshot` is its state,
`resume` puts it back when the migration is called off. Arriving: `reserve` holds blocks
for its tokens, and once its KV landed in them `adopt` rebuilds it from its state and
joins it to the batch. Everything that follows from its tokens (penalties' counts, the
grammar's place, the detokenizer, the stop-string matcher) is replayed here, not moved.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hetero_pd.engine.block_pool import NoFreeBlocksError
from hetero_pd.engine.llm_engine import LLMEngine
from hetero_pd.outputs import SampleLogprobs
from hetero_pd.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A paused request's state besides its prompt and its KV."""

    output_ids: list[int]
    generator: bytes | None
    logprobs: SampleLogprobs | None
    cumulative_logprob: float
    sent_chars: int
    cached_tokens: int


def pause(engine: LLMEngine, request_id: str) -> tuple[list[int], int]:
    """Takes a decoding request out of the batch; returns its blocks and the number of
    its tokens whose KV they hold. Raises ValueError when it is not decoding."""
    req = engine.scheduler.pause(request_id)
    return list(req.block_ids), req.num_computed_tokens


def resume(engine: LLMEngine, request_id: str) -> None:
    """Back into the batch, if it is still paused (not aborted meanwhile)."""
    if request_id in engine.scheduler.paused:
        engine.scheduler.resume(request_id)


def decoding(engine: LLMEngine, request_id: str) -> tuple[list[int], int, int] | None:
    """(blocks, tokens of KV computed, preemptions so far) of a request in the decode
    batch, or None when it is not there (finished, waiting, preempted, paused)."""
    req = engine.scheduler.requests.get(request_id)
    if req is None or req not in engine.scheduler.running:
        return None
    return list(req.block_ids), req.num_computed_tokens, req.num_preemptions


def snapshot(engine: LLMEngine, request_id: str) -> Snapshot:
    req = engine.scheduler.paused[request_id]
    generator = None
    if req.generator is not None:
        generator = req.generator.get_state().numpy().tobytes()
    asked = req.params.logprobs is not None
    return Snapshot(
        output_ids=list(req.output_token_ids),
        generator=generator,
        logprobs=list(req.output_logprobs) if asked else None,
        cumulative_logprob=req.cumulative_logprob,
        sent_chars=engine.outputs.sent_chars(request_id),
        cached_tokens=req.num_cached_tokens,
    )


def reserve(
    engine: LLMEngine,
    prompt_ids: list[int],
    params: SamplingParams,
    request_id: str,
    priority: int,
    num_tokens: int,
) -> list[int]:
    """Holds blocks for `num_tokens` tokens of an arriving request; returns them. Raises
    NoFreeBlocksError when there is no room now, ValueError for a bad request."""
    if params.n != 1:
        raise ValueError(f"request {request_id}: n={params.n} does not migrate")
    if num_tokens <= len(prompt_ids) or num_tokens >= engine.max_model_len:
        raise ValueError(f"request {request_id}: num_tokens={num_tokens} for a migration")
    engine.add_remote_request(prompt_ids, params, request_id, priority)
    req = engine.scheduler.get(request_id)
    if not engine.kv.allocate_slots(req, num_tokens):
        engine.abort_request(request_id)
        raise NoFreeBlocksError(f"request {request_id}: no room for {num_tokens} tokens of KV")
    return list(req.block_ids)


def adopt(engine: LLMEngine, request_id: str, state: Snapshot) -> None:
    """The arriving request's KV is in its blocks: rebuild it from `state` and decode on.
    Raises ValueError (nothing changed in the batch) when the state does not fit it."""
    sched = engine.scheduler
    req = sched.remote[request_id]
    vocab = engine.model_config.vocab_size
    if any(not 0 <= t < vocab for t in state.output_ids):
        raise ValueError(f"request {request_id}: output token ids outside the vocabulary")
    n_out = len(state.output_ids)
    if (state.logprobs is None) != (req.params.logprobs is None) or (
        state.logprobs is not None and len(state.logprobs) != n_out
    ):
        raise ValueError(f"request {request_id}: logprobs do not match its {n_out} tokens")
    if (state.generator is None) != (req.generator is None):
        raise ValueError(f"request {request_id}: a generator state without a seed, or none")
    if req.generator is not None and state.generator is not None:
        try:
            req.generator.set_state(torch.frombuffer(bytearray(state.generator), dtype=torch.uint8))
        except RuntimeError as e:
            raise ValueError(f"request {request_id}: bad generator state: {e}") from None
    if req.grammar is not None:
        for token in state.output_ids:
            req.grammar.accept(token)  # ValueError when a token breaks it
    sched.adopt(request_id, state.output_ids)
    req.output_logprobs = list(state.logprobs or [])
    req.cumulative_logprob = state.cumulative_logprob
    req.num_cached_tokens = state.cached_tokens
    sent = engine.outputs.replay(req)
    if sent != state.sent_chars:
        sched.abort(request_id)
        raise ValueError(
            f"request {request_id}: {state.sent_chars} characters were streamed, the replay "
            f"gives {sent}"
        )
