"""How a request's prompt gets onto its decode worker, and what a failure does.

    router            decode D                 prefill P
      |-- Reserve ------>| reserve blocks (after the prefix D's own cache holds)
      |<-- Reserved -----| (block ids + epoch + cached tokens)
      |-- Prefill (dest, skip = cached) -------->| prefill the whole prompt; push the
      |                  |                       | KV of the blocks after `skip` tokens
      |                  |<======= KV blocks ====| checksum, ACK
      |<-- PrefillDone (first token) ------------| frees its blocks after the ACK
      |-- KvReady ------>| joins the decode batch (with the first token's and the
      |                  | prompt's logprobs, when asked: P computed them)
      |<-- Output ... ---| tokens stream to the client

Short prompts (or a deployment of `both` workers) skip all that: D computes the prompt
itself (conditional disaggregation). With the kv_aware policy, when another worker H holds
more of the prompt's prefix than the worker that computes it (P, or D itself), H offers
those blocks and the computing worker pulls them before it computes the rest:

    router --OfferPrefix(prefix, reader)--> H  pins the blocks, offers them (a grant)
           <--PrefixOffered(ticket)-------- H
    router --Prefill/Generate(pull=ticket)--> P pulls the blocks from H, publishes them in
                                              its prefix cache, computes only the rest
                                              (a failed pull: it computes them itself)

On a prefill failure the deployment's policy decides: `recompute` (D prefills itself),
`retry` (a fresh reservation and another P), or `fail`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hetero_pd.sampling_params import SamplingParams
from hetero_pd.serving.control import protocol as P
from hetero_pd.serving.control import values as V
from hetero_pd.serving.router.errors import RouterError, worker_error
from hetero_pd.serving.router.inbox import Inbox, answer_from, get_within, next_message
from hetero_pd.serving.router.metrics import ServingMetrics
from hetero_pd.serving.router.policy import Chooser
from hetero_pd.serving.router.worker_client import WorkerClient, WorkerGone, WorkerUnreachable
from transfer import RemoteBlocks, StatusCode

log = logging.getLogger("hetero_pd.router")
#: How long a prefix holder has to answer OfferPrefix before the prompt is computed.
OFFER_TIMEOUT_S = 2.0
#: Decode-worker answers to `Reserve` that mean "not now": back off and ask again.
BACKPRESSURE = (V.ErrorCode.NO_FREE_BLOCKS, V.ErrorCode.KV_FENCED)


@dataclass(frozen=True, slots=True)
class EdgeRequest:
    """A prompt from an edge device (`prompt`) of `num_tokens` tokens. With early KV
    ("prompt only" mode) it goes to whole-model workers, which then decode alone; without,
    to split workers starting at `prompt.layer`."""

    prompt: V.EdgePrompt
    num_tokens: int

    @property
    def worker_layer(self) -> int:
        """The start layer of the workers that serve it."""
        return 0 if self.prompt.early_kv is not None else self.prompt.layer


@dataclass(frozen=True, slots=True)
class HandoffPolicy:
    """What a hand-off needs from its router: settings, choices, metrics, live workers."""

    max_retries: int
    failure_policy: str
    reserve_timeout_s: float
    prefill_timeout_s: float
    chooser: Chooser
    metrics: ServingMetrics
    live: Callable[..., list[WorkerClient]]


@dataclass(frozen=True, slots=True)
class FirstToken:
    """The prefill worker computed the prompt and its KV landed on the decode worker."""

    done: P.PrefillDone


@dataclass(frozen=True, slots=True)
class PrefillFailed:
    """The prefill (or its KV transfer) failed; `reason` labels the metric."""

    reason: str
    message: str


@dataclass(frozen=True, slots=True)
class DecodeAnswered:
    """The decode worker stopped waiting for the KV, computed the prompt and answered."""

    output: P.Output


Outcome = FirstToken | PrefillFailed | DecodeAnswered


class Handoff:
    """One request's way to its decode worker; `involved` lists every worker it touched."""

    def __init__(
        self,
        policy: HandoffPolicy,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        priority: int,
        queue: Inbox,
        edge: EdgeRequest | None,
    ) -> None:
        self.cfg, self.chooser, self.metrics, self.live = (
            policy,
            policy.chooser,
            policy.metrics,
            policy.live,
        )
        self.rid, self.prompt_ids, self.priority, self.queue = rid, prompt_ids, priority, queue
        self.params = P.WireParams.of(params)
        # n > 1 fans out on the decode worker; a prefill worker computes completion 0's
        # prompt and first token (seed + 0, the prompt's logprobs).
        self.prefill_params = P.WireParams.of(params.for_completion(0))
        self.edge = edge.prompt if edge is not None else None
        self.layer = edge.worker_layer if edge is not None else 0
        self.prompt_len = edge.num_tokens if edge is not None else len(prompt_ids)
        self.involved: list[WorkerClient] = []
        self._charged: dict[str, tuple[WorkerClient, int]] = {}  # backlog this prompt adds

    async def start(self) -> tuple[WorkerClient, P.Output | None]:
        """Gets the prompt's KV onto a decode worker; returns that worker and, when it
        already answered (it stopped waiting for the KV and computed the prompt), its
        first output."""
        rid, chooser = self.rid, self.chooser
        decode, cached = chooser.pick(
            self.live("decode", "both", split_layer=self.layer), self.prompt_ids
        )
        prefill = self.live("prefill", split_layer=self.layer)
        uncached = self.prompt_len - cached
        # Decided before this request joins the decode worker's in-flight set: the policy
        # counts that set as the batch already there.
        local = decode.role == "both" or chooser.prefill_locally(
            self.prompt_len, cached, prefill, decode
        )
        if local:  # given before it joins: its own prompt does not stall it
            decode.prompt_tokens_given += uncached
        self._enlist(decode, chooser.stall_until(decode, self.params))
        chooser.record(decode, self.prompt_ids)
        if local:
            self.metrics.decision("colocated" if decode.role == "both" else "local_prefill")
            pull = await self._offer_prefix(decode, cached)
            self._send(decode, P.Generate(**self._fields(), pull=pull))
            self._charge(decode, uncached)
            return decode, None
        self.metrics.decision("disaggregated")
        tried: set[str] = set()
        reserved = False
        for attempt in range(self.cfg.max_retries + 1):
            live = self.live("prefill", split_layer=self.layer)
            # Another prefill worker if there is one, else the same one again; never a dead
            # one (nothing would ever answer for it).
            candidates = [w for w in live if w.worker_id not in tried] or live
            if not candidates:
                break
            # The prefill worker is chosen first: the reservation names it as the one
            # writer of its blocks.
            worker, worker_cached = chooser.pick(candidates, self.prompt_ids)
            tried.add(worker.worker_id)
            # Charged before the first await: requests arriving together must see each
            # other's prompts in the backlog, or each would find the prefill worker idle.
            self._charge(worker, self.prompt_len)
            if reserved:  # a retry: a fresh reservation, a new epoch for the new writer
                decode.try_send(P.Abort(rid=rid))
            blocks, cached_tokens = await self._reserve(decode, worker)
            reserved = True
            self._enlist(worker)
            pull = await self._offer_prefix(worker, worker_cached) if attempt == 0 else None
            chooser.record(worker, self.prompt_ids)
            self._send(
                worker,
                P.Prefill(
                    **{**self._fields(), "params": self.prefill_params},
                    dest_worker_id=decode.worker_id,
                    dest_address=decode.info.transfer_address,
                    dest_blocks=blocks,
                    skip_tokens=cached_tokens,
                    pull=pull,
                ),
            )
            try:
                outcome = await self._await_prefill(worker, decode)
            finally:
                self._settle(worker)
            worker.inflight.pop(rid, None)
            if isinstance(outcome, FirstToken):
                done = outcome.done
                ready = P.KvReady(
                    rid=rid,
                    first_token=done.first_token,
                    first_logprobs=done.first_logprobs,
                    prompt_logprobs=done.prompt_logprobs,
                )
                self._send(decode, ready)
                return decode, None
            worker.try_send(P.Abort(rid=rid))  # e.g. after a timeout: stop computing
            if isinstance(outcome, DecodeAnswered):
                log.warning("request %s: %s gave up waiting for the KV", rid, decode.worker_id)
                self.metrics.decision("recompute")
                return decode, outcome.output
            log.warning(
                "request %s: prefill on %s failed: %s", rid, worker.worker_id, outcome.message
            )
            self.metrics.transfer_failure(outcome.reason)
            policy = self.cfg.failure_policy
            if policy == "fail":
                self.metrics.decision("fail")
                message = f"prefill failed ({outcome.reason}: {outcome.message})"
                raise RouterError(503, message, "prefill_failed")
            if policy == "recompute" or attempt == self.cfg.max_retries:
                break
            self.metrics.decision("retry")
        self.metrics.decision("recompute")
        # The reservation falls back to computing the prompt; with none (no prefill worker
        # left before the first one), the prompt is computed there from the start.
        self._send(decode, P.KvFailed(rid=rid) if reserved else P.Generate(**self._fields()))
        self._charge(decode, uncached)
        return decode, None

    def prompt_done(self) -> None:
        """The decode worker answered (or the request ended): no prompt work is left."""
        for worker, _ in list(self._charged.values()):
            self._settle(worker)

    def _charge(self, worker: WorkerClient, tokens: int) -> None:
        self._settle(worker)
        worker.pending_tokens += tokens
        self._charged[worker.worker_id] = (worker, tokens)

    def _settle(self, worker: WorkerClient) -> None:
        charged = self._charged.pop(worker.worker_id, None)
        if charged is not None:
            worker.pending_tokens -= charged[1]

    def _fields(self) -> dict[str, Any]:
        return {
            "rid": self.rid,
            "prompt_ids": self.prompt_ids,
            "params": self.params,
            "priority": self.priority,
            "edge": self.edge,
        }

    def _enlist(self, worker: WorkerClient, stall_until: int | None = None) -> None:
        worker.inflight[self.rid] = stall_until
        if worker not in self.involved:
            self.involved.append(worker)

    def _send(self, worker: WorkerClient, msg: Any) -> None:
        try:
            worker.send(msg)
        except WorkerUnreachable as e:
            raise RouterError(503, str(e), "worker_unreachable", 2.0) from None

    async def _reserve(
        self, decode: WorkerClient, writer: WorkerClient
    ) -> tuple[RemoteBlocks, int]:
        """Reserves the prompt's blocks on `decode` for `writer`; returns them and how many
        of the prompt's first tokens decode's prefix cache serves (their KV is not sent).
        The prefix is reused only when both workers' KV blocks are the same size."""
        deadline = time.monotonic() + self.cfg.reserve_timeout_s
        delay = 0.05
        block_size = decode.info.block_size
        reuse = (
            self.chooser.cfg.decode_prefix_reuse
            and self.edge is None
            and block_size > 0
            and block_size == writer.info.block_size
        )
        reserve = P.Reserve(**self._fields(), writer=writer.worker_id, reuse_prefix=reuse)
        while True:
            self._send(decode, reserve)
            while True:
                left = max(deadline - time.monotonic(), 0.01)
                worker_id, msg = await next_message(self.queue, left, self.rid)
                if worker_id != decode.worker_id:
                    continue
                if isinstance(msg, WorkerGone):
                    raise RouterError(503, f"decode worker {worker_id} died", "worker_died")
                if isinstance(msg, P.Reserved):
                    return msg.blocks, self._check_cached(msg, reuse, block_size)
                if isinstance(msg, P.Error):
                    break
            if msg.code not in BACKPRESSURE:
                raise worker_error(msg)
            if time.monotonic() + delay > deadline:
                raise RouterError(429, "no KV cache room on the decode workers", "overloaded", 1.0)
            await asyncio.sleep(delay)  # back-pressure: decode is full, wait for room
            delay = min(delay * 2, 1.0)

    async def _offer_prefix(self, reader: WorkerClient, cached: int) -> V.PrefixSource | None:
        """Asks the worker holding the longest prefix of the prompt, when it holds at least
        `prefix_pull_min_tokens` more than `reader` (`cached`), to offer those blocks to
        `reader`; the ticket for `reader` to pull, or None (no holder, or no answer in
        OFFER_TIMEOUT_S: `reader` computes the prefix)."""
        cfg = self.chooser.cfg
        bs = reader.info.block_size
        if cfg.policy != "kv_aware" or not cfg.prefix_pull_min_tokens or self.edge is not None:
            return None
        others = [
            w
            for w in self.live("prefill", "decode", "both", split_layer=0)
            if w is not reader and w.info.block_size == bs == cfg.block_size
        ]
        holder, tokens = self.chooser.holder(others, self.prompt_ids)
        if holder is None or tokens - cached < cfg.prefix_pull_min_tokens:
            return None
        lease_s = cfg.prefix_pull_timeout_s + OFFER_TIMEOUT_S
        offer = P.OfferPrefix(
            rid=self.rid,
            prompt_ids=self.prompt_ids[:tokens],
            reader=reader.worker_id,
            lease_s=lease_s,
        )
        try:
            holder.send(offer)
        except WorkerUnreachable:
            return None
        reply = await answer_from(self.queue, holder.worker_id, P.PrefixOffered, OFFER_TIMEOUT_S)
        if reply is None or reply.blocks is None or reply.tokens <= cached:
            return None
        if reply.tokens > tokens or reply.tokens != len(reply.blocks.block_ids) * bs:
            log.warning("request %s: %s offered %s", self.rid, holder.worker_id, reply)
            return None
        self.metrics.decision("prefix_pull")
        return V.PrefixSource(
            peer=holder.worker_id,
            address=holder.info.transfer_address,
            blocks=reply.blocks,
            tokens=reply.tokens,
            timeout_s=cfg.prefix_pull_timeout_s,
        )

    def _check_cached(self, msg: P.Reserved, reuse: bool, block_size: int) -> int:
        cached = msg.cached_tokens
        if cached and (not reuse or cached % block_size or cached >= self.prompt_len):
            raise RouterError(
                502,
                f"decode worker answered cached_tokens={cached} for a {self.prompt_len}-token "
                f"prompt (reuse asked: {reuse}, block size {block_size})",
                "bad_worker_reply",
            )
        return cached

    async def _await_prefill(self, prefill: WorkerClient, decode: WorkerClient) -> Outcome:
        deadline = time.monotonic() + self.cfg.prefill_timeout_s
        while True:
            left = deadline - time.monotonic()
            try:
                if left <= 0:
                    raise TimeoutError
                worker_id, msg = await get_within(self.queue, left)
            except TimeoutError:
                return PrefillFailed("TIMEOUT", "no prefill result")
            if worker_id == decode.worker_id:
                match msg:
                    case WorkerGone():
                        raise RouterError(503, f"decode worker {worker_id} died", "worker_died")
                    case P.Error():
                        raise worker_error(msg)
                    case P.Output():
                        return DecodeAnswered(msg)
                continue
            if worker_id != prefill.worker_id:
                continue
            match msg:
                case WorkerGone():
                    return PrefillFailed("WORKER_DIED", f"prefill worker {worker_id} died")
                case P.Error():
                    if msg.code in (V.ErrorCode.BAD_REQUEST, V.ErrorCode.REQUEST_FAILED):
                        raise worker_error(msg)  # the request itself: no other worker helps
                    reason = msg.code.name
                    if msg.transfer_status is not None:
                        reason = StatusCode.from_number(msg.transfer_status).name
                    return PrefillFailed(reason, msg.message)
                case P.PrefillDone(transfer=stats):
                    self.metrics.observe_transfer("kv", stats.bytes, stats.seconds)
                    return FirstToken(msg)
