"""What an engine reports of itself: its load, the requests it ended, and its own fault."""

from __future__ import annotations

from dataclasses import dataclass


class EngineFault(RuntimeError):
    """The engine itself failed (not one request): its process should be restarted."""


@dataclass(frozen=True, slots=True)
class RequestFailure:
    """A request the engine ended because running it raised; the batch went on."""

    request_id: str
    message: str


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """What is queued and running on an engine, and how full its KV cache is."""

    waiting: int
    running: int
    remote: int  # decode: reservations waiting for KV from another worker
    held: int  # prefill: finished prompts whose KV is being handed off
    waiting_tokens: int  # prompt tokens not computed yet, over waiting requests
    kv_usage: float
    free_blocks: int
    used_blocks: int
    #: Prompt tokens computed (not served by the prefix cache) since the engine started.
    prompt_tokens_computed: int = 0
    #: Seconds of a decode-only step and of a prompt token, lately (engine/step_costs.py).
    decode_step_s: float = 0.0
    prompt_token_s: float = 0.0
