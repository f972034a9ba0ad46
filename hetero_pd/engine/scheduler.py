"""Continuous batching with chunked prefill, decode first, preemption by recompute.

Each step gets a token budget. Running requests are served first, decoding ones before
those still in prefill; what budget is left admits waiting requests (prefix cache first).
When a running request cannot grow, the lowest-priority, latest request not yet scheduled
this step is preempted: its blocks are freed and it is queued to be recomputed.

Roles: `both` serves a request end to end. `prefill` stops a request after its first token
and holds its blocks (status KV_READY) until `release_held`. `decode` also takes requests
whose KV arrives from elsewhere: `add_remote` reserves their blocks up front
(WAITING_FOR_REMOTE_KVS) and `remote_kv_ready` joins them to the decode batch.
"""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from hetero_pd.engine.block_pool import NoFreeBlocksError
from hetero_pd.engine.kv_cache_manager import KVCacheManager
from hetero_pd.engine.request import Request, RequestStatus

Role = Literal["prefill", "decode", "both"]
ROLES: tuple[str, ...] = ("prefill", "decode", "both")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    max_model_len: int = 2048
    role: Role = "both"

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


@dataclass(slots=True)
class ScheduledChunk:
    request: Request
    num_tokens: int  # tokens computed this step, starting at request.num_computed_tokens
    # of them, proposed tokens to verify (request.spec_token_ids[:num_spec]) after the last
    num_spec: int = 0

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the known tokens, so the step samples."""
        end = self.request.num_computed_tokens + self.num_tokens - self.num_spec
        return end == self.request.num_tokens

    @property
    def token_ids(self) -> list[int]:
        """The chunk's input tokens: known ones, then the proposals it verifies."""
        req, start = self.request, self.request.num_computed_tokens
        if not self.num_spec:
            return req.all_token_ids[start : start + self.num_tokens]
        return req.all_token_ids[start:] + req.spec_token_ids[: self.num_spec]


@dataclass(slots=True)
class SchedulerOutput:
    # single-token chunks (decode) come first, then longer prefill chunks
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    def __bool__(self) -> bool:
        return bool(self.chunks)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: list[Request] = []  # sorted by (priority, arrival)
        self.running: list[Request] = []
        self.remote: dict[str, Request] = {}  # waiting for KV from a prefill worker
        self.held: dict[str, Request] = {}  # prefill role: blocks held for hand-off
        self.paused: dict[str, Request] = {}  # out of the batch, blocks kept (migrating)
        self.requests: dict[str, Request] = {}

    def switch_role(self, role: Role) -> None:
        """Schedule as `role` from now on (the engine checks it is idle)."""
        self.config = dataclasses.replace(self.config, role=role)

    # -- admission ---------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        self._check_fits(req)
        self.requests[req.request_id] = req
        bisect.insort(self.waiting, req, key=Request.sort_key)

    def add_remote(self, req: Request, reuse_prefix: bool = False) -> list[int]:
        """Reserves blocks for a prompt whose KV another worker computes; returns block ids.
        With `reuse_prefix`, the prompt's prefix found in this worker's device prefix cache
        (`find_cached_prefix`'s full blocks, never the last token's) is held like a local
        hit and only the rest is reserved: `req.num_cached_tokens` of its KV is already here.

        Raises NoFreeBlocksError when the blocks are not there now (back-pressure)."""
        if self.config.role == "prefill":
            raise ValueError("a prefill-role engine does not accept remote KV")
        self._check_fits(req)
        # Only device blocks: the KV is on its way, so the request cannot wait for the tiers.
        cached = (self.kv.find_cached_prefix(req, onload=False) or []) if reuse_prefix else []
        num_cached = len(cached) * self.kv.block_size
        if not self.kv.allocate_new(req, cached, req.num_prompt_tokens - num_cached):
            raise NoFreeBlocksError(
                f"request {req.request_id}: no room for {req.num_prompt_tokens} tokens of KV "
                f"({self.kv.num_free_blocks} blocks free)"
            )
        req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.requests[req.request_id] = req
        self.remote[req.request_id] = req
        return list(req.block_ids)

    def remote_kv_ready(self, request_id: str, first_token_id: int) -> Request:
        """The prompt's KV has landed in the reserved blocks; decode from `first_token_id`."""
        req = self.remote[request_id]
        if req.grammar is not None:  # the prefill worker sampled it under the same grammar
            req.grammar.accept(first_token_id)  # raises ValueError when it broke the grammar
        del self.remote[request_id]
        req.num_computed_tokens = req.num_prompt_tokens
        self.kv.cache_computed_blocks(req)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        self.append_token(req, first_token_id)
        return req

    def remote_kv_failed(self, request_id: str) -> None:
        """The KV never arrived: compute the prompt here instead (recompute policy)."""
        req = self.remote.pop(request_id)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        bisect.insort(self.waiting, req, key=Request.sort_key)

    def pause(self, request_id: str) -> Request:
        """Takes a decoding request (every token but the newest computed) out of the batch,
        keeping its blocks: a live migration copies its last KV while it is paused."""
        req = self.requests.get(request_id)
        if req is None or req not in self.running or req.num_computed_tokens != req.num_tokens - 1:
            raise ValueError(f"request {request_id} is not decoding here")
        self.running.remove(req)
        self.paused[request_id] = req
        return req

    def resume(self, request_id: str) -> None:
        """Back into the batch after `pause` (the migration was called off)."""
        self.running.append(self.paused.pop(request_id))

    def adopt(self, request_id: str, output_ids: list[int]) -> Request:
        """A request reserved by `add_remote` whose KV came from a worker that decoded it
        so far: every token but the newest of `output_ids` is in its blocks; decode on."""
        req = self.remote[request_id]
        num_tokens = req.num_prompt_tokens + len(output_ids)
        if not output_ids or num_tokens >= self.config.max_model_len:
            raise ValueError(f"request {request_id}: {len(output_ids)} output tokens to adopt")
        if self.kv.blocks_for(num_tokens - 1) > len(req.block_ids):
            raise ValueError(
                f"request {request_id}: {num_tokens - 1} tokens of KV do not fit its "
                f"{len(req.block_ids)} reserved blocks"
            )
        del self.remote[request_id]
        req.all_token_ids = req.prompt_token_ids + list(output_ids)
        req.num_computed_tokens = num_tokens - 1
        self.kv.cache_computed_blocks(req)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        return req

    def _check_fits(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        if not req.prompt_token_ids:
            raise ValueError(f"request {req.request_id}: the prompt is empty")
        if req.num_prompt_tokens >= self.config.max_model_len:
            raise ValueError(
                f"request {req.request_id}: prompt has {req.num_prompt_tokens} tokens, the "
                f"limit is max_model_len - 1 = {self.config.max_model_len - 1}"
            )
        if self.kv.blocks_for(req.num_prompt_tokens + 1) > self.kv.pool.num_blocks:
            raise ValueError(
                f"request {req.request_id}: {req.num_prompt_tokens} prompt tokens need more "
                f"KV blocks than the cache has ({self.kv.pool.num_blocks})"
            )

    # -- one step ----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self.kv.begin_step(idle=not self.running)
        budget = self.config.max_num_batched_tokens
        self.running.sort(key=lambda r: (r.num_tokens - r.num_computed_tokens > 1, r.sort_key()))
        pending = [r for r in self.running if r.num_ready_tokens > r.num_computed_tokens]
        while pending and budget > 0:
            req = pending.pop(0)
            n = min(req.num_ready_tokens - req.num_computed_tokens, budget)
            # A decode step verifies the request's proposals too, where budget and KV allow.
            spec = min(len(req.spec_token_ids), budget - 1) if n == 1 else 0
            if spec and not self.kv.allocate_slots(req, 1 + spec):
                spec = 0
            n += spec
            while not self.kv.allocate_slots(req, n):
                victim = max(pending, key=Request.sort_key) if pending else req
                if victim is not req:
                    pending.remove(victim)
                self._preempt(victim)
                out.preempted.append(victim.request_id)
                if victim is req:
                    break
            else:
                out.chunks.append(ScheduledChunk(req, n, spec))
                budget -= n
        if not out.preempted:
            budget = self._admit(out, budget)
        out.chunks.sort(key=lambda c: c.num_tokens > 1)
        return out

    def _admit(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[i]
            cached = self.kv.find_cached_prefix(req)
            if cached is None:  # its prefix is still coming up from the KV tiers
                i += 1
                continue
            remaining = req.num_ready_tokens - len(cached) * self.kv.block_size
            n = min(remaining, budget)
            if not self.kv.allocate_new(req, cached, n):
                break
            self.waiting.pop(i)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.chunks.append(ScheduledChunk(req, n))
            budget -= n
        return budget

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.spec_token_ids = []
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.PREEMPTED
        bisect.insort(self.waiting, req, key=Request.sort_key)

    def update(self, out: SchedulerOutput, sampled: dict[str, list[int]]) -> list[Request]:
        """Records the step's progress and sampled tokens (a run per request: one token,
        or a verified speculative run, which is cut where the request finishes); returns
        requests that changed state to finished (or KV_READY on a prefill worker)."""
        done = []
        for chunk in out.chunks:
            req = chunk.request
            run = sampled.get(req.request_id)
            if chunk.num_spec:
                assert run is not None, "a verifying chunk samples"
                if self._append_run(req, run):
                    done.append(req)
                continue
            req.num_computed_tokens += chunk.num_tokens
            self.kv.cache_computed_blocks(req)
            if run is None:
                continue
            token = run[0]
            if self.config.role == "prefill" and req.num_output_tokens == 0:
                req.all_token_ids.append(token)
                self.running.remove(req)
                req.status = RequestStatus.KV_READY
                self.held[req.request_id] = req
                done.append(req)
                continue
            if self.append_token(req, token):
                done.append(req)
        return done

    def _append_run(self, req: Request, run: list[int]) -> bool:
        """A verified run: its tokens but the last were proposals, so their KV (and the
        input token's) is computed; the rejected proposals' slots are given back. Cuts
        `run` (in place) where the request finishes; returns whether it did."""
        req.spec_token_ids = []
        req.num_computed_tokens += len(run)
        for i, token in enumerate(run):
            if self.append_token(req, token):
                del run[i + 1 :]
                req.drop_outputs_after(req.num_output_tokens)
                return True
        self.kv.cache_computed_blocks(req)
        self.kv.trim(req)
        return False

    def append_token(self, req: Request, token: int) -> bool:
        """Appends a sampled token; finishes the request on EOS, stop ids or length."""
        req.all_token_ids.append(token)
        params = req.params
        n_out = req.num_output_tokens
        status = None
        if req.grammar is not None and req.grammar.complete:
            status, req.stop_reason = RequestStatus.FINISHED_STOPPED, None
        elif n_out >= params.min_tokens:
            if not params.ignore_eos and token in req.eos_token_ids:
                status, req.stop_reason = RequestStatus.FINISHED_STOPPED, None
            elif params.stop_token_ids and token in params.stop_token_ids:
                status, req.stop_reason = RequestStatus.FINISHED_STOPPED, token
        if status is None and (
            (params.max_tokens is not None and n_out >= params.max_tokens)
            or req.num_tokens >= self.config.max_model_len
            # the next step would need more KV than the whole cache: it could never run
            or self.kv.blocks_for(req.num_tokens) > self.kv.pool.num_blocks
        ):
            status = RequestStatus.FINISHED_LENGTH
        if status is None:
            return False
        self.finish(req, status)
        return True

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Ends a request wherever it is and frees its blocks."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.remote.pop(req.request_id, None)
        self.held.pop(req.request_id, None)
        self.paused.pop(req.request_id, None)
        self.kv.free(req)
        req.status = status
        self.requests.pop(req.request_id, None)

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is not None:
            self.finish(req, RequestStatus.FINISHED_ABORTED)
        return req

    def release_held(self, request_id: str) -> None:
        """Prefill role: the KV was handed off (or its lease expired); free the blocks."""
        req = self.held.pop(request_id)
        self.kv.free(req)
        req.status = RequestStatus.FINISHED_STOPPED
        self.requests.pop(request_id, None)

    def get(self, request_id: str) -> Request:
        req = self.requests.get(request_id)
        if req is None:
            raise KeyError(f"no request {request_id!r}")
        return req

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.remote)

    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.remote)
