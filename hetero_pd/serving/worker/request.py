"""One request on a worker (`WorkerRequest`, its `Phase`), and the messages its engine
outputs become: `Output` per new token of one of its `n` completions, `PrefillDone` when
a prefill worker handed its prompt's KV off. `RequestBook` (requests.py) owns the
transitions between phases.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hetero_pd.engine.parallel_sampling import ParentRequest
from hetero_pd.outputs import RequestOutput
from hetero_pd.sampling_params import SamplingParams
from hetero_pd.serving.control import protocol as P
from hetero_pd.serving.control import sampling as W
from hetero_pd.serving.control import values as V
from transfer import TransferError, TransferHandle


class Phase(enum.Enum):
    RUNNING = "running"
    RESERVED = "reserved"
    LANDED = "landed"
    FALLBACK = "fallback"
    PREFILLING = "prefilling"
    FENCED = "fenced"
    ARRIVING = "arriving"  # a live migration's destination: blocks reserved, KV coming


@dataclass(slots=True)
class WorkerRequest:
    rid: str
    owner: bytes  # the router it answers to
    phase: Phase
    seq: int = 0  # the next Output's sequence number (over all its completions)
    handle: TransferHandle | None = None  # RESERVED, ARRIVING: the reservation awaiting KV
    fence_until: float = 0.0  # FENCED: when no direct writer can touch its blocks
    then: Callable[[str], None] | None = None  # FENCED: the engine action after the fence
    #: n > 1: the completions of one prompt. Completion 0 runs as `rid`; the others start
    #: from `prompt_ids` once it has its first token (its prompt's blocks are then cached).
    fanout: ParentRequest | None = None
    prompt_ids: list[int] = field(default_factory=list)
    priority: int = 0
    prompt_logprobs_sent: bool = False
    prefilled: RequestOutput | None = None  # PREFILLING: the prompt's last output


class RequestError(Exception):
    """Refuses a request start with an error code."""

    def __init__(self, code: V.ErrorCode, message: str, transfer_status: int | None = None):
        super().__init__(message)
        self.code, self.message, self.transfer_status = code, message, transfer_status

    @classmethod
    def of_transfer(cls, e: TransferError) -> RequestError:
        return cls(V.ErrorCode.TRANSFER_FAILED, str(e), e.code.number)


def fanout_for(
    msg: P.Generate | P.Reserve | P.Prefill, params: SamplingParams
) -> ParentRequest | None:
    """The completions of a request with n > 1. They run on its decode worker: a prefill
    worker computes completion 0's prompt and first token only (the router sends it n = 1),
    and an edge prompt has no token ids to start the others from."""
    if params.n == 1:
        return None
    if isinstance(msg, P.Prefill) or msg.edge is not None:
        what = "a prefill" if isinstance(msg, P.Prefill) else "an edge prompt"
        raise ValueError(f"n={params.n}: {what} computes one completion")
    return ParentRequest(msg.rid, params)


def output_message(req: WorkerRequest, out: RequestOutput) -> P.Output:
    """The `Output` of one engine step of one of `req`'s completions: its new tokens with
    their logprobs, and the prompt's logprobs on completion 0's first output."""
    c = out.outputs[0]
    index = req.fanout.index_of(out.request_id) if req.fanout is not None else 0
    logprobs = None
    if c.logprobs is not None:
        logprobs = W.positions(c.logprobs[len(c.token_ids) - len(c.delta_token_ids) :])
    prompt = None
    if out.prompt_logprobs is not None and index == 0 and not req.prompt_logprobs_sent:
        prompt, req.prompt_logprobs_sent = W.prompt_positions(out.prompt_logprobs), True
    return P.Output(
        rid=req.rid,
        seq=req.seq,
        index=index,
        text=c.delta_text,
        token_ids=c.delta_token_ids,
        logprobs=logprobs,
        prompt_logprobs=prompt,
        finish_reason=c.finish_reason,
        stop_reason=c.stop_reason,
        prompt_tokens=len(out.prompt_token_ids),
        completion_tokens=len(c.token_ids),
        cached_tokens=out.num_cached_tokens,
    )


def prefill_done(req: WorkerRequest, first_token: int, stats: dict[str, Any]) -> P.PrefillDone:
    """A prefill's result, with the logprobs only this worker could compute (the first
    token's and the prompt's) when the request asks for them."""
    out = req.prefilled
    first = prompt = None
    if out is not None and out.outputs[0].logprobs:
        first = W.position(out.outputs[0].logprobs[0])
    if out is not None and out.prompt_logprobs is not None:
        prompt = W.prompt_positions(out.prompt_logprobs)
    return P.PrefillDone(
        rid=req.rid,
        first_token=first_token,
        transfer=V.TransferStats(**stats),
        first_logprobs=first,
        prompt_logprobs=prompt,
    )


def check_endpoint(address: str) -> None:
    """A peer's transfer address must be `tcp://HOST:PORT`; anything else is refused here,
    before the transfer engine tries to connect to it."""
    host, sep, port = address.removeprefix("tcp://").rpartition(":")
    if not address.startswith("tcp://") or not sep or not host or not port.isdigit():
        raise ValueError(f"dest_address {address!r} is not tcp://HOST:PORT")
    if not 0 < int(port) < 65536:
        raise ValueError(f"dest_address {address!r}: port out of range")
