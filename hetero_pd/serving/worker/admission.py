"""How a new request enters a worker's engine; `RequestBook` (requests.py) decides when and
keeps its state.

    Generate  -> the engine computes the prompt and decodes
    Reserve   -> the engine holds blocks for the prompt, minus the prefix its cache serves;
                 the transfer engine lets the prefill worker write them (a reservation)
    Prefill   -> the engine computes the prompt; its KV is to be pushed to the decode
                 worker's blocks past the `skip_tokens` that worker already holds

A prompt may come as an edge device's hidden states instead of token ids (edge_inputs.py).
"""

from __future__ import annotations

from typing import Any

from hetero_pd.engine.block_pool import NoFreeBlocksError
from hetero_pd.engine.llm_engine import LLMEngine
from hetero_pd.serving.control import protocol as P
from hetero_pd.serving.control import values as V
from hetero_pd.serving.worker.edge_inputs import edge_prompt
from hetero_pd.serving.worker.request import RequestError
from transfer import RemoteBlocks, TransferEngine, TransferError, TransferHandle

Start = P.Generate | P.Reserve | P.Prefill


def check_role(worker_id: str, engine: LLMEngine, msg: Start) -> None:
    """A prefill worker takes only Prefill; the others take only Generate and Reserve
    (their engines would hold or hand off KV nobody asked for)."""
    role = engine.config.role
    if (role == "prefill") != isinstance(msg, P.Prefill):
        kind = type(msg).__name__
        raise RequestError(V.ErrorCode.BAD_REQUEST, f"worker {worker_id} ({role}) takes no {kind}")


def add(
    engine: LLMEngine, worker_id: str, msg: Start, params: Any, remote_kv: bool = False
) -> list[int] | None:
    """Puts the prompt on the engine; with `remote_kv`, the blocks its KV is to land in."""
    edge = edge_prompt(msg.edge, engine, worker_id)
    if edge is None:
        if remote_kv:
            reuse = isinstance(msg, P.Reserve) and msg.reuse_prefix
            return engine.add_remote_request(
                list(msg.prompt_ids), params, msg.rid, msg.priority, reuse_prefix=reuse
            )
        engine.add_request(list(msg.prompt_ids), params, msg.rid, msg.priority)
        return None
    hidden, early = edge
    if early is None:
        return engine.add_split_request(hidden, params, msg.rid, msg.priority, remote_kv)
    return engine.add_edge_prompt_request(hidden, early, params, msg.rid, msg.priority, remote_kv)


def reserve(
    engine: LLMEngine,
    transfer: TransferEngine,
    worker_id: str,
    msg: P.Reserve,
    params: Any,
    timeout_s: float,
) -> tuple[TransferHandle, P.Reserved]:
    """The prompt on the engine awaiting its KV, the reservation of its blocks (for
    `timeout_s`), and the Reserved reply naming them."""
    try:
        block_ids = add(engine, worker_id, msg, params, remote_kv=True)
    except NoFreeBlocksError as e:
        raise RequestError(V.ErrorCode.NO_FREE_BLOCKS, str(e)) from None
    assert block_ids is not None
    # The prefix this worker's cache serves stays out of the reservation: only the rest's
    # KV is written here.
    cached = engine.cached_tokens(msg.rid) if msg.edge is None else 0
    block_ids = block_ids[cached // engine.config.block_size :]
    start = engine.config.start_layer
    # A split engine has no KV below its start layer: only [start, L) will arrive.
    layers = (start, engine.model_config.num_layers) if start else None
    try:
        handle = transfer.reserve(
            msg.rid, block_ids, timeout_s=timeout_s, layers=layers, writer=msg.writer
        )
    except TransferError as e:
        engine.abort_request(msg.rid)
        raise RequestError.of_transfer(e) from None
    assert handle.blocks is not None
    blocks = handle.blocks
    return handle, P.Reserved(rid=msg.rid, blocks=blocks, cached_tokens=cached)


def push_target(
    engine: LLMEngine, transfer: TransferEngine, msg: P.Prefill
) -> tuple[RemoteBlocks, int]:
    """Where a Prefill's KV goes: the decode worker's blocks, and how many of the prompt's
    first blocks it already holds (not pushed)."""
    skip, bs = msg.skip_tokens, engine.config.block_size
    if skip and (msg.edge is not None or skip % bs or skip >= len(msg.prompt_ids)):
        raise ValueError(
            f"request {msg.rid}: skip_tokens={skip} must be a multiple of the block size "
            f"{bs} below the prompt's {len(msg.prompt_ids)} tokens (and 0 for an edge prompt)"
        )
    # The router's current view of the peer: a no-op while unchanged; a decode worker
    # restarted elsewhere is re-linked at once. Never blocks the worker's loop.
    try:
        transfer.set_peer_address(msg.dest_worker_id, msg.dest_address)
    except TransferError as e:
        raise RequestError.of_transfer(e) from None
    return msg.dest_blocks, skip // bs
