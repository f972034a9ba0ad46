"""Prefix KV shared between workers: a holder offers cached blocks, a puller pulls them.

    holder H (OfferPrefix from the router)           puller C (Prefill/Generate with pull)
      pin the prompt's cached leading blocks            pin its own cached leading blocks,
      offer them to C (a grant: C only, this epoch,     take fresh blocks for the rest of the
      these blocks, until the lease ends)               prefix, reserve them for H (writer)
      PrefixOffered(ticket) --router--> ...             PULL (ticket) ------------------> H
                                   <--------- KV blocks, checksummed, ACKed ----------
      offer DONE (or lease over): unpin                 pull DONE: publish the blocks in the
                                                        prefix cache, start the request (its
                                                        prefix is now a cache hit), unpin
                                                        pull failed / timed out / refused:
                                                        start the request (it computes the
                                                        prefix); the blocks are freed once no
                                                        writer can touch them (fence)

Blocks are published only after the whole pull committed, and a cache hit is confirmed by
token ids, so a failed or partial pull can never serve wrong KV; nothing waits past the
pull's deadline.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from hetero_pd.engine.block_pool import NoFreeBlocksError
from hetero_pd.engine.kv_cache_manager import KVCacheManager
from hetero_pd.engine.llm_engine import LLMEngine
from hetero_pd.serving.control import protocol as P
from transfer import RemoteBlocks, TransferEngine, TransferError, TransferHandle, TransferState

log = logging.getLogger("hetero_pd.worker")
Start = P.Generate | P.Prefill
Resume = Callable[[bytes, Start], None]


def shares_prefixes(engine: LLMEngine) -> bool:
    """Whether `engine`'s cached blocks can be offered and pulled: its KV tensors (the
    transfer region) hold every KV head of every block, which a tensor-parallel worker's do
    when its ranks share one whole-head cache (engine/tp/kv.py), and it caches prefixes of
    token ids (a split engine, which sees hidden states, does not)."""
    ranks = engine.ranks
    return engine.config.start_layer == 0 and (ranks is None or ranks.kv_whole)


def offer_id(rid: str) -> str:
    """The transfer request id of a prefix offer (apart from the request's own ids)."""
    return f"{rid}/prefix"


def offer_prefix(
    kv: KVCacheManager, transfer: TransferEngine, msg: P.OfferPrefix
) -> P.PrefixOffered:
    """Holder side: pins the cached leading blocks of `msg.prompt_ids` and offers them to
    `msg.reader` until pulled or the lease ends (then unpinned); the answer for the router."""
    blocks = kv.pin_prefix(list(msg.prompt_ids), len(msg.prompt_ids) // kv.block_size)
    if not blocks:
        return P.PrefixOffered(rid=msg.rid)
    try:
        handle = transfer.offer(
            offer_id(msg.rid),
            blocks,
            reader=msg.reader,
            lease_s=msg.lease_s,
            callback=lambda h: kv.unpin(blocks),
        )
    except TransferError as e:
        kv.unpin(blocks)
        log.warning("request %s: no prefix offer to %s: %s", msg.rid, msg.reader, e)
        return P.PrefixOffered(rid=msg.rid)
    assert handle.blocks is not None
    ticket = handle.blocks
    return P.PrefixOffered(rid=msg.rid, blocks=ticket, tokens=len(blocks) * kv.block_size)


@dataclass(slots=True)
class _Pull:
    owner: bytes
    msg: Start
    resume: Resume
    pinned: list[int]  # this worker's own leading hits, kept while the pull runs
    taken: list[int]  # the blocks the pulled KV lands in
    first: int  # the prompt block the first taken block holds
    dst: RemoteBlocks | None = None  # the reservation of `taken` for the holder
    link: concurrent.futures.Future[None] | None = None  # linking to the holder first


class PrefixPulls:
    """Puller side: requests waiting for their prefix KV, and the counts a heartbeat sends."""

    def __init__(self, worker_id: str, engine: LLMEngine, transfer: TransferEngine) -> None:
        self.worker_id, self.engine, self.transfer = worker_id, engine, transfer
        self._pulls: dict[str, _Pull] = {}
        self._fenced: list[tuple[float, list[int]]] = []  # (free after, blocks)
        self.done = self.tokens = self.failed = 0

    @property
    def kv(self) -> KVCacheManager:
        return self.engine.kv

    @property
    def active(self) -> bool:
        return bool(self._pulls or self._fenced)

    def __contains__(self, rid: str) -> bool:
        return rid in self._pulls

    def begin(self, owner: bytes, msg: Start, resume: Resume) -> bool:
        """Starts pulling `msg.pull`'s blocks; True if the request now waits for them
        (`resume(owner, msg)` starts it when the pull ends, whichever way), False when there
        is nothing to pull (start it now)."""
        src = msg.pull
        if src is None or not shares_prefixes(self.engine):
            return False  # nothing to pull, or no pulling into a split KV: compute it
        bs, prompt = self.kv.block_size, list(msg.prompt_ids)
        wanted = src.tokens // bs
        if msg.edge is not None or src.tokens % bs or not 0 < src.tokens < len(prompt):
            raise ValueError(
                f"request {msg.rid}: a prefix pull of {src.tokens} tokens must be whole blocks "
                f"of {bs} below the prompt's {len(prompt)} tokens (and not for an edge prompt)"
            )
        if len(src.blocks.block_ids) != wanted or src.peer == self.worker_id:
            raise ValueError(f"request {msg.rid}: the prefix offer of {src.peer} is malformed")
        pinned = self.kv.pin_prefix(prompt, wanted)
        first = len(pinned)
        if first == wanted:
            self.kv.unpin(pinned)
            return False  # it is all here already
        try:
            taken = self.kv.take_blocks(wanted - first)
        except NoFreeBlocksError:
            self.kv.unpin(pinned)
            return False  # no room to pull into: compute it
        pull = _Pull(owner, msg, resume, pinned, taken, first)
        try:
            reservation = self.transfer.reserve(
                offer_id(msg.rid), taken, timeout_s=src.timeout_s, writer=src.peer
            )
            pull.dst = reservation.blocks
            if src.peer in self.transfer.peers():
                self.transfer.set_peer_address(src.peer, src.address)
                self._send(pull)
            else:  # never linked to the holder (it may be a decode worker): link first
                pull.link = self.transfer.link_async(src.peer, src.address)
        except TransferError as e:
            self._end(pull, f"could not start: {e}")
            return False
        self._pulls[msg.rid] = pull
        return True

    def _send(self, pull: _Pull) -> None:
        msg, src = pull.msg, pull.msg.pull
        assert src is not None and pull.dst is not None
        ticket = msgspec.structs.replace(src.blocks, block_ids=src.blocks.block_ids[pull.first :])

        def ended(handle: TransferHandle) -> None:
            if self._pulls.get(msg.rid) is not pull:
                return  # cancelled meanwhile
            del self._pulls[msg.rid]
            if handle.state is TransferState.DONE:
                self._landed(pull)
            else:
                self._end(pull, str(handle.error))
            pull.resume(pull.owner, msg)

        self.transfer.pull_blocks(
            src.peer,
            ticket,
            pull.dst,
            timeout_s=src.timeout_s,
            num_tokens=len(pull.taken) * self.kv.block_size,
            callback=ended,
        )

    def _landed(self, pull: _Pull) -> None:
        """Every block committed: they join the prefix cache (the request finds them)."""
        self.transfer.release(offer_id(pull.msg.rid))
        self.kv.publish_prefix(list(pull.msg.prompt_ids), pull.first, pull.taken)
        self.kv.unpin(pull.pinned + pull.taken)
        self.done += 1
        self.tokens += len(pull.taken) * self.kv.block_size

    def _end(self, pull: _Pull, why: str | None) -> None:
        """The pull failed (`why`) or was cancelled (None): the request computes its
        prefix; the taken blocks are freed once no writer can touch them (fence)."""
        if why is not None:
            log.warning("%s: request %s: prefix pull failed (%s); computing it", self.worker_id,
                        pull.msg.rid, why)  # fmt: skip
            self.failed += 1
        wait = self.transfer.release(offer_id(pull.msg.rid))
        if wait > 0:
            self._fenced.append((time.monotonic() + wait, pull.taken))
        else:
            self.kv.unpin(pull.taken)
        self.kv.unpin(pull.pinned)

    def cancel(self, rid: str, owner: bytes) -> None:
        """Router `owner` aborted the request while it was pulling: forget it."""
        pull = self._pulls.get(rid)
        if pull is not None and pull.owner == owner:
            del self._pulls[rid]
            self._end(pull, None)

    def drop_owner(self, owner: bytes) -> None:
        for rid in [rid for rid, p in self._pulls.items() if p.owner == owner]:
            self.cancel(rid, owner)

    def tick(self, now: float) -> None:
        """Sends the pulls whose link came up (or ends those whose link failed); frees
        taken blocks whose fence ended."""
        for rid, pull in list(self._pulls.items()):
            if pull.link is None or not pull.link.done():
                continue
            error, pull.link = pull.link.exception(), None
            if error is None:
                try:
                    self._send(pull)
                    continue
                except TransferError as e:
                    error = e
            del self._pulls[rid]
            self._end(pull, f"no link to {pull.msg.pull and pull.msg.pull.peer}: {error}")
            pull.resume(pull.owner, pull.msg)
        if self._fenced:
            ended = [blocks for until, blocks in self._fenced if until <= now]
            self._fenced = [(until, b) for until, b in self._fenced if until > now]
            for blocks in ended:
                self.kv.unpin(blocks)
