"""Prefill side of the KV hand-off: push a finished prompt's blocks to the decode worker,
whole or layer by layer while the forward pass goes on, and report once every push is ACKed.

The source blocks stay held by the engine (status KV_READY) until every push handle is
terminal; only then are they freed, whether the ACK arrived or the lease expired.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hetero_pd.engine.llm_engine import LLMEngine
from hetero_pd.engine.scheduler import SchedulerOutput
from transfer import RemoteBlocks, StatusCode, TransferEngine, TransferError, TransferHandle
from transfer import TransferState as S

# (request id, first token, error or None, transfer stats)
ResultCallback = Callable[[str, int, TransferError | None, dict[str, Any]], None]


@dataclass(slots=True)
class _Push:
    peer: str
    dest: RemoteBlocks
    skip_blocks: int = 0  # the prompt's first blocks, which the decode worker holds already
    handles: list[TransferHandle] = field(default_factory=list)
    first_token: int | None = None
    started: float = 0.0
    error: TransferError | None = None  # a push that could not even start


class PushTracker:
    def __init__(
        self, transfer: TransferEngine, engine: LLMEngine, on_result: ResultCallback
    ) -> None:
        self.transfer = transfer
        self.engine = engine
        self.on_result = on_result
        self._pushes: dict[str, _Push] = {}

    @property
    def active(self) -> bool:
        return bool(self._pushes)

    def expect(self, rid: str, peer: str, dest: RemoteBlocks, skip_blocks: int = 0) -> None:
        self._pushes[rid] = _Push(peer, dest, skip_blocks)

    def is_pushing(self, rid: str) -> bool:
        return rid in self._pushes

    def renew_reservations(self) -> None:
        """Asks each decode worker to keep the reservation of a prompt we are still queueing
        or computing (called on every heartbeat), so that a long prefill never outlives it.
        Once a push is under way the decode worker's own deadline counts again: it stops
        waiting for a hand-off that stalls, and one of a prefill worker that died."""
        for push in self._pushes.values():
            if not push.started and push.error is None:
                self.transfer.renew_remote(push.peer, push.dest)

    def layer_hook(self, out: SchedulerOutput) -> Callable[[int], None] | None:
        """Pushes layer i of every prompt that completes in this step right after layer i."""
        finishing = [
            c.request for c in out.chunks if c.samples and c.request.request_id in self._pushes
        ]
        if not finishing:
            return None

        def on_layer_done(layer: int) -> None:
            for req in finishing:
                self._push(req.request_id, req.block_ids, req.num_prompt_tokens, (layer, layer + 1))

        return on_layer_done

    def prefill_finished(self, rid: str, first_token: int) -> None:
        push = self._pushes[rid]
        push.first_token = first_token
        if not push.handles:  # not streamed layer by layer: push all layers now
            block_ids, num_tokens = self.engine.held_blocks(rid)
            start = self.engine.config.start_layer  # a split engine has no KV below it
            layers = (start, self.engine.model_config.num_layers) if start else None
            self._push(rid, block_ids, num_tokens, layers)
        self._check(rid)

    def _push(
        self, rid: str, block_ids: list[int], num_tokens: int, layers: tuple[int, int] | None
    ) -> None:
        push = self._pushes.get(rid)
        if push is None or push.error is not None:
            return
        if not push.started:
            push.started = time.monotonic()
        skip = push.skip_blocks
        src = block_ids[skip : skip + len(push.dest.block_ids)]
        try:
            handle = self.transfer.push_blocks(
                push.peer,
                src,
                push.dest,
                layers=layers,
                num_tokens=num_tokens - skip * self.engine.config.block_size,
                callback=lambda h: self._check(h.request_id),
            )
        except TransferError as e:
            # Reported once the prompt's step is over (never abort inside a forward pass).
            push.error = e
            return
        push.handles.append(handle)

    def _check(self, rid: str) -> None:
        push = self._pushes.get(rid)
        if push is None or push.first_token is None:
            return
        failed = next((h for h in push.handles if h.state.terminal and h.state != S.DONE), None)
        if push.error is not None:
            self._finish(rid, push.error)
        elif failed is not None:
            self._finish(rid, failed.error or TransferError(StatusCode.INTERNAL, "push failed"))
        elif all(h.state == S.DONE for h in push.handles):
            self._finish(rid, None)

    def _finish(self, rid: str, error: TransferError | None) -> None:
        push = self._pushes.pop(rid)
        for h in push.handles:
            if not h.state.terminal:
                h.cancel()
        if self.engine.is_held(rid):
            self.engine.release_held(rid)
        else:
            self.engine.abort_request(rid)
        seconds = time.monotonic() - push.started if push.started else 0.0
        nbytes = sum(h.nbytes for h in push.handles)
        stats = {"bytes": nbytes, "seconds": round(seconds, 6), "pushes": len(push.handles)}
        self.on_result(rid, push.first_token if push.first_token is not None else -1, error, stats)

    def cancel(self, rid: str) -> None:
        push = self._pushes.pop(rid, None)
        if push is None:
            return
        for h in push.handles:
            if not h.state.terminal:
                h.cancel()
