"""The worker's per-request state machine (`RequestBook`), without sockets or a model: a
recording stand-in for the engine and one for the transfer engine drive every transition."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest

from hetero_pd import SamplingParams
from hetero_pd.engine.block_pool import NoFreeBlocksError
from hetero_pd.engine.health import RequestFailure
from hetero_pd.outputs import CompletionOutput, Logprob, RequestOutput
from hetero_pd.serving.control import protocol as P
from hetero_pd.serving.control import sampling as W
from hetero_pd.serving.control import values as V
from hetero_pd.serving.worker.request import WorkerRequest, output_message, prefill_done
from hetero_pd.serving.worker.requests import Phase, RequestBook
from transfer import RemoteBlocks, TransferState

A, B = b"router-a", b"router-b"
PARAMS = P.WireParams.of(SamplingParams(max_tokens=4))


@dataclass
class Handle:
    state: TransferState = TransferState.IN_FLIGHT
    blocks: RemoteBlocks = field(default_factory=lambda: RemoteBlocks("r", 7, (1, 2)))


class RecordingEngine:
    """Stands in for LLMEngine: records what the book asks of it."""

    class config:  # mirrors engine.config
        start_layer = 0
        role = "decode"
        block_size = 4

    class model_config:
        num_layers = 2
        hidden_size = 8

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.full = False
        self.live: set[str] = set()
        self.cached = 0  # prompt tokens the prefix cache serves

    def add_request(self, ids: list[int], params: Any, rid: str, priority: int) -> None:
        self.calls.append(("add", rid))
        self.live.add(rid)

    def add_remote_request(
        self, ids: list[int], params: Any, rid: str, priority: int, reuse_prefix: bool = False
    ) -> list[int]:
        if self.full:
            raise NoFreeBlocksError(f"request {rid}: no room")
        self.calls.append(("reserve", rid))
        self.live.add(rid)
        return [1, 2]

    def remote_kv_ready(
        self, rid: str, first: int, logprobs: Any = None, prompt_logprobs: Any = None
    ) -> RequestOutput:
        self.calls.append(("kv_ready", rid))
        self.landed_logprobs = (logprobs, prompt_logprobs)
        return output(rid, [first], finished=False)

    def cached_tokens(self, rid: str) -> int:
        return self.cached

    def remote_kv_failed(self, rid: str) -> None:
        self.calls.append(("recompute", rid))

    def abort_request(self, rid: str) -> None:
        self.calls.append(("abort", rid))
        self.live.discard(rid)

    def has_request(self, rid: str) -> bool:
        return rid in self.live

    def has_unfinished_requests(self) -> bool:
        return bool(self.live)

    def is_held(self, rid: str) -> bool:
        return False


class RecordingTransfer:
    """Stands in for TransferEngine; `fence_s` is what release() reports as still open."""

    def __init__(self) -> None:
        self.handles: dict[str, Handle] = {}
        self.fence_s = 0.0
        self.released: list[str] = []

    def reserve(self, rid: str, block_ids: list[int], **kw: Any) -> Handle:
        self.handles[rid] = Handle(blocks=RemoteBlocks(rid, 7, tuple(block_ids)))
        return self.handles[rid]

    def release(self, rid: str) -> float:
        self.released.append(rid)
        return self.fence_s


def output(rid: str, tokens: list[int], finished: bool) -> RequestOutput:
    c = CompletionOutput(0, "x", tokens, "length" if finished else None, None, "x", tokens)
    return RequestOutput(rid, None, [1, 2], [c], finished, 0)


@pytest.fixture
def book() -> tuple[RequestBook, RecordingEngine, RecordingTransfer, list[tuple[bytes, Any]]]:
    engine, transfer, sent = RecordingEngine(), RecordingTransfer(), []
    b = RequestBook("decode-0", engine, transfer, lambda o, m: sent.append((o, m)), 5.0)  # type: ignore[arg-type]
    return b, engine, transfer, sent


def reserve(rid: str) -> P.Reserve:
    return P.Reserve(rid=rid, prompt_ids=[1, 2, 3], params=PARAMS, writer="prefill-0")


def test_reserved_then_landed_then_finished(book: Any) -> None:
    b, _, transfer, sent = book
    b.start(A, reserve("r"))
    assert isinstance(sent[-1][1], P.Reserved) and b.requests["r"].phase is Phase.RESERVED
    transfer.handles["r"].state = TransferState.DONE
    b.kv_ready(A, P.KvReady(rid="r", first_token=9))
    assert b.requests["r"].phase is Phase.LANDED
    assert sent[-1][1].seq == 0 and sent[-1][1].token_ids == [9]
    b.on_output(output("r", [9, 10], finished=True))
    assert sent[-1][1].seq == 1 and "r" not in b.requests


def test_reserved_blocks_leave_out_the_cached_prefix(book: Any) -> None:
    b, engine, transfer, sent = book
    engine.cached = 4  # one block of 4 tokens
    b.start(A, P.Reserve(**{**msgspec.structs.asdict(reserve("r")), "reuse_prefix": True}))
    assert transfer.handles["r"].blocks.block_ids == (2,)
    assert sent[-1][1].cached_tokens == 4 and sent[-1][1].blocks.block_ids == (2,)


@pytest.mark.parametrize(
    ("skip", "prompt_len", "edge"),
    [(3, 8, False), (8, 8, False), (12, 8, False), (4, 8, True)],
    ids=["not_a_block", "whole_prompt", "past_the_prompt", "edge"],
)
def test_prefill_skip_tokens_are_checked(book: Any, skip: int, prompt_len: int, edge: bool) -> None:
    b, engine, _, sent = book
    engine.config.role = "prefill"
    try:
        hidden = V.HiddenFrame(
            version=1, dtype="float32", shape=[1, 8], scale=b"", data=bytes(32), outliers=0,
            outlier_index=b"", outlier_value=b"",
        )  # fmt: skip
        msg = P.Prefill(
            rid="p",
            prompt_ids=list(range(prompt_len)),
            params=PARAMS,
            dest_worker_id="d",
            dest_address="tcp://127.0.0.1:9",
            dest_blocks=RemoteBlocks("p", 1, (1,), "kv"),
            skip_tokens=skip,
            edge=V.EdgePrompt(layer=1, hidden=hidden) if edge else None,
        )
        b.start(A, msg)
        assert sent[-1][1].code is V.ErrorCode.BAD_REQUEST
        assert f"skip_tokens={skip} must be a multiple of the block size 4" in sent[-1][1].message
        assert engine.calls == [] and b.requests == {}
    finally:
        engine.config.role = "decode"


def test_kv_not_whole_at_kv_ready_falls_back(book: Any) -> None:
    b, engine, _, sent = book
    b.start(A, reserve("r"))
    b.kv_ready(A, P.KvReady(rid="r", first_token=9))  # the handle never reached DONE
    assert isinstance(sent[-1][1], P.KvFallback)
    assert b.requests["r"].phase is Phase.FALLBACK and ("recompute", "r") in engine.calls
    assert b.kv_fallbacks == 1


def test_a_fenced_request_waits_out_its_fence(book: Any) -> None:
    b, engine, transfer, sent = book
    b.start(A, reserve("r"))
    transfer.fence_s = 0.2  # a direct writer may still write into the blocks
    b.abort(A, "r")
    assert b.requests["r"].phase is Phase.FENCED and ("abort", "r") not in engine.calls
    b.start(A, reserve("r"))  # the router retries at once
    assert sent[-1][1].code is V.ErrorCode.KV_FENCED and sent[-1][1].recoverable
    deadline = time.monotonic() + 5
    while "r" in b.requests:
        assert time.monotonic() < deadline
        b.tick()
    assert ("abort", "r") in engine.calls


def test_only_the_owner_touches_a_request(book: Any) -> None:
    b, engine, transfer, _ = book
    b.start(A, reserve("r"))
    transfer.handles["r"].state = TransferState.DONE
    b.abort(B, "r")
    b.kv_ready(B, P.KvReady(rid="r", first_token=1))
    assert b.requests["r"].phase is Phase.RESERVED
    b.start(B, reserve("s"))
    b.drop_owner(A)
    assert set(b.requests) == {"s"} and ("abort", "r") in engine.calls


def test_refusals_carry_their_code(book: Any) -> None:
    b, engine, _, sent = book
    engine.full = True
    b.start(A, reserve("r"))
    assert sent[-1][1].code is V.ErrorCode.NO_FREE_BLOCKS and sent[-1][1].recoverable
    engine.full = False
    b.start(A, P.Generate(rid="g", prompt_ids=[1], params=PARAMS))
    b.start(A, P.Generate(rid="g", prompt_ids=[1], params=PARAMS))
    assert sent[-1][1].code is V.ErrorCode.BAD_REQUEST and "is running" in sent[-1][1].message
    b.on_failure(RequestFailure("g", "the engine could not run request g: boom"))
    assert sent[-1][1].code is V.ErrorCode.REQUEST_FAILED and "g" not in b.requests
    assert ("abort", "g") in engine.calls


def test_each_role_takes_only_its_messages(book: Any) -> None:
    """A Generate on a prefill worker once left its prompt's blocks held for a hand-off
    nobody would ask for (found by tests/serving/test_fuzz.py)."""
    b, engine, _, sent = book
    blocks = RemoteBlocks("p", 1, (1,), "kv")
    b.start(
        A,
        P.Prefill(
            rid="p",
            prompt_ids=[1],
            params=PARAMS,
            dest_worker_id="d",
            dest_address="tcp://127.0.0.1:9",
            dest_blocks=blocks,
        ),
    )
    assert "takes no Prefill" in sent[-1][1].message
    engine.config.role = "prefill"
    try:
        b.start(A, P.Generate(rid="g", prompt_ids=[1], params=PARAMS))
        assert "takes no Generate" in sent[-1][1].message
        assert engine.calls == [] and b.requests == {}
    finally:
        engine.config.role = "decode"


# -- n > 1 and logprobs ------------------------------------------------------------------------
def test_n_completions_fan_out_on_the_decode_worker(book: Any) -> None:
    """Completion 0 runs as the request; the others start once it has its first token (its
    prompt is cached then). Outputs carry their completion's index and one sequence."""
    b, engine, _, sent = book
    params = P.WireParams.of(SamplingParams(n=3, seed=5, max_tokens=2))
    b.start(A, P.Generate(rid="g", prompt_ids=[1, 2, 3], params=params))
    assert engine.calls == [("add", "g")]
    b.on_output(output("g", [7], finished=False))
    assert engine.calls[1:] == [("add", "1_g"), ("add", "2_g")]
    for rid, tokens, finished in [("2_g", [4], False), ("g", [7, 8], True), ("2_g", [4, 5], True)]:
        b.on_output(output(rid, tokens, finished))
    assert "g" in b.requests, "completion 1 has not finished"
    b.on_output(output("1_g", [6], finished=True))
    outputs = [m for _, m in sent]
    assert [(m.seq, m.index) for m in outputs] == [(0, 0), (1, 2), (2, 0), (3, 2), (4, 1)]
    assert b.requests == {} and b.children == {}


def test_aborting_n_completions_aborts_each(book: Any) -> None:
    b, engine, _, _ = book
    params = P.WireParams.of(SamplingParams(n=2, max_tokens=2))
    b.start(A, P.Generate(rid="g", prompt_ids=[1, 2], params=params))
    b.on_output(output("g", [7], finished=False))
    b.on_failure(RequestFailure("1_g", "the engine could not run request 1_g: boom"))
    assert ("abort", "g") in engine.calls and ("abort", "1_g") in engine.calls
    assert b.requests == {} and b.children == {}


def test_n_above_one_is_refused_where_it_cannot_run(book: Any) -> None:
    b, engine, _, sent = book
    engine.config.role = "prefill"
    try:
        blocks = RemoteBlocks("p", 1, (1,), "kv")
        prefill = P.Prefill(
            rid="p",
            prompt_ids=[1],
            params=P.WireParams.of(SamplingParams(n=2)),
            dest_worker_id="d",
            dest_address="tcp://127.0.0.1:9",
            dest_blocks=blocks,
        )
        b.start(A, prefill)
        assert sent[-1][1].code is V.ErrorCode.BAD_REQUEST
        assert "n=2: a prefill computes one completion" in sent[-1][1].message
    finally:
        engine.config.role = "decode"


LP = {7: Logprob(-0.5, 1), 3: Logprob(-1.5, 2)}


def test_kv_ready_hands_the_prefill_workers_logprobs_to_the_engine(book: Any) -> None:
    b, engine, transfer, _ = book
    b.start(A, reserve("r"))
    transfer.handles["r"].state = TransferState.DONE
    first, prompt = W.position(LP), [None, W.position(LP), W.position(LP)]
    b.kv_ready(A, P.KvReady(rid="r", first_token=7, first_logprobs=first, prompt_logprobs=prompt))
    assert engine.landed_logprobs == (LP, [None, LP, LP])


def test_prefill_done_and_outputs_carry_logprobs() -> None:
    req = WorkerRequest("r", A, Phase.PREFILLING)
    out = output("r", [7], finished=True)
    out.outputs[0].logprobs, out.prompt_logprobs = [LP], [None, LP]
    req.prefilled = out
    done = prefill_done(req, 7, {"bytes": 1, "seconds": 0.1, "pushes": 1})
    assert done.first_logprobs == W.position(LP)
    assert done.prompt_logprobs == [None, W.position(LP)]
    assert W.entry(done.first_logprobs) == LP and list(W.entry(done.first_logprobs)) == [7, 3]
    # An Output carries its new tokens' positions, and the prompt's on its first output only.
    out.outputs[0].token_ids, out.outputs[0].logprobs = [7, 7], [LP, LP]
    req.phase = Phase.RUNNING
    first = output_message(req, out)
    req.seq += 1
    second = output_message(req, out)
    assert first.logprobs == [W.position(LP)] and first.prompt_logprobs is not None
    assert second.prompt_logprobs is None and second.seq == 1
