"""Maps requests to KV blocks: prefix-cache lookup, slot allocation and freeing.

Prefix caching uses chained hashes over full blocks (hash of the parent block's hash plus
this block's token ids); a hit is confirmed by comparing token ids, so a hash collision can
never serve the wrong KV.

With KV tiers (host DRAM, SSD) below the device, a request's lookup continues in the tiers
past the device's last hit; that run is brought up into device blocks first, and the request
is not scheduled until all of it has landed (`find_cached_prefix` returns None meanwhile).
A block being copied down is *held* in the pool (not handed out, its eviction order kept);
device blocks an onload writes into are referenced by the onload until it lands.
"""

from __future__ import annotations

import hashlib
import weakref
from array import array
from collections.abc import Iterator

from hetero_pd.engine.block_pool import BlockPool, NoFreeBlocksError
from hetero_pd.engine.kv_tiers import KVTiers, KVTierStats
from hetero_pd.engine.kv_tiers.mover import Job, Offload
from hetero_pd.engine.request import Request

Block = tuple[int, tuple[int, ...]]  # (chained hash, token ids)
# The engine waits for the tiers only when it is idle (a load in flight) or out of blocks.
IDLE_WAIT_S = 0.05


def chain_hash(parent: int | None, token_ids: tuple[int, ...] | list[int]) -> int:
    """A hash that is stable across processes (the router computes it too)."""
    h = hashlib.blake2b(digest_size=8)
    if parent is not None:
        h.update(parent.to_bytes(8, "little"))
    h.update(array("q", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little")


def prompt_block_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """Chained hashes of every full block of `token_ids`."""
    hashes: list[int] = []
    parent = None
    for i in range(len(token_ids) // block_size):
        parent = chain_hash(parent, token_ids[i * block_size : (i + 1) * block_size])
        hashes.append(parent)
    return hashes


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        tiers: KVTiers | None = None,
    ):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.tiers = tiers
        # stops the tiers' threads (after the copies queued) when the manager goes away
        self._close_tiers = weakref.finalize(self, tiers.close) if tiers is not None else None
        self._loading: set[str] = set()  # requests whose prefix is being brought up
        self._device_hits = 0

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        """Blocks some request holds (not free, not merely cached)."""
        return self.pool.counts()[2]

    @property
    def usage(self) -> float:
        return self.pool.usage

    def blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def _prompt_blocks(self, req: Request) -> Iterator[Block]:
        """(chained hash, token ids) of the prompt's full blocks but the last token's."""
        bs = self.block_size
        parent = None
        for i in range((req.num_prompt_tokens - 1) // bs):
            tokens = tuple(req.prompt_token_ids[i * bs : (i + 1) * bs])
            parent = chain_hash(parent, tokens)
            yield parent, tokens

    def find_cached_prefix(self, req: Request, onload: bool = True) -> list[int] | None:
        """Blocks holding a prefix of the prompt; the last prompt token is always recomputed
        so that the request has logits to sample from. None while part of the prefix is
        being brought up from the KV tiers: the request must wait. With `onload` False only
        the device's blocks count (never None): a request that cannot wait for the tiers."""
        if not self.enable_prefix_caching or req.prompt_hidden is not None:
            return []  # an edge prompt's token ids are placeholders
        if req.params.prompt_logprobs is not None:
            return []  # every prompt position must be computed to have its logits
        if req.request_id in self._loading:
            return None
        hits: list[int] = []
        blocks = self._prompt_blocks(req)
        for block_hash, tokens in blocks:
            block_id = self.pool.lookup(block_hash, tokens)
            if block_id is None:
                rest = [(block_hash, tokens), *blocks] if self.tiers and onload else []
                if rest and self._onload(req, hits, rest):
                    return None
                break
            hits.append(block_id)
        return hits

    def _onload(self, req: Request, hits: list[int], rest: list[Block]) -> bool:
        """Starts bringing up the run of `rest` (the prompt's blocks after the device hits)
        that the tiers hold, when the pool has room for it and one more block; True if it
        started. The blocks are the job's until it lands."""
        assert self.tiers is not None
        run = self.tiers.find_run(rest)
        if run == 0 or not self._make_room(run + 1 + self.pool.num_free_among(hits)):
            return False

        def allocate(n: int) -> list[int]:
            for block_id in hits:  # the blocks found on the device stay there
                self.pool.hold(block_id)
            try:
                return self._new_blocks(n)
            finally:
                for block_id in hits:
                    self.pool.release(block_id)

        if not self.tiers.onload(req.request_id, rest[:run], allocate):
            return False
        self._loading.add(req.request_id)
        return True

    def begin_step(self, idle: bool) -> None:
        """Applies the tiers' finished copies; when `idle` (nothing running) and a request
        waits for its prefix, first waits briefly for it to land."""
        if self.tiers is None:
            return
        if idle and self._loading:
            self.tiers.wait_done(IDLE_WAIT_S)
        self._apply(self.tiers.poll())

    def _apply(self, jobs: list[Job]) -> None:
        for job in jobs:
            if isinstance(job, Offload):
                for block_id in job.block_ids:
                    self.pool.release(block_id)
                continue
            # Published only now that every copy has landed; freed blocks stay cached (the
            # request finds them on the device), except those past the valid run.
            valid = job.num_valid
            for block_id, block_hash, tokens in zip(
                job.block_ids[:valid], job.hashes, job.token_ids, strict=False
            ):
                self.pool.cache_block(block_id, block_hash, tokens)
            self.pool.free_blocks(job.block_ids)
            self._loading.discard(job.request_id)

    def _new_blocks(self, n: int) -> list[int]:
        """`n` blocks in LRU order: a block still being copied down is not skipped but
        waited for (a host-memory copy), so the tiers never change what the device keeps."""
        if self.tiers is not None and self.pool.evicts_held(n):
            self.tiers.wait_copies()
            self._apply(self.tiers.poll())
        return self.pool.get_new_blocks(n)

    def _make_room(self, need: int) -> bool:
        """Whether `need` blocks are free, after waiting for offloads holding blocks."""
        if need <= self.pool.num_free_blocks:
            return True
        if self.tiers is None or not self.tiers.busy:
            return False
        self.tiers.wait_copies()
        self._apply(self.tiers.poll())
        return need <= self.pool.num_free_blocks

    def allocate_new(self, req: Request, cached_blocks: list[int], num_new_tokens: int) -> bool:
        """Gives a request with no blocks its cached prefix plus room for `num_new_tokens`."""
        assert not req.block_ids
        num_cached = len(cached_blocks) * self.block_size
        need = self.blocks_for(num_cached + num_new_tokens) - len(cached_blocks)
        if not self._make_room(need + self.pool.num_free_among(cached_blocks)):
            return False
        self.pool.touch(cached_blocks)
        req.block_ids = cached_blocks + self._new_blocks(need)
        req.block_hashes = []
        req.num_computed_tokens = num_cached
        req.num_cached_tokens = num_cached
        self._device_hits += len(cached_blocks)
        self._hash_cached(req, len(cached_blocks))
        return True

    def allocate_slots(self, req: Request, num_new_tokens: int) -> bool:
        """Grows a running request's blocks to hold `num_new_tokens` more tokens."""
        need = self.blocks_for(req.num_computed_tokens + num_new_tokens) - len(req.block_ids)
        if need <= 0:
            return True
        if not self._make_room(need):
            return False
        req.block_ids.extend(self._new_blocks(need))
        return True

    def trim(self, req: Request) -> None:
        """Frees the blocks past those the request's tokens need (speculative slots that
        held rejected proposals); they were never published."""
        keep = self.blocks_for(req.num_tokens)
        if len(req.block_ids) > keep:
            self.pool.free_blocks(req.block_ids[keep:])
            del req.block_ids[keep:]

    def cache_computed_blocks(self, req: Request) -> None:
        """Publishes every block that is full and computed, once."""
        if not self.enable_prefix_caching or req.prompt_hidden is not None:
            return
        num_full = req.num_computed_tokens // self.block_size
        self._hash_cached(req, num_full, publish=True)

    def _hash_cached(self, req: Request, num_full: int, publish: bool = False) -> None:
        bs = self.block_size
        parent = req.block_hashes[-1] if req.block_hashes else None
        for i in range(len(req.block_hashes), num_full):
            tokens = tuple(req.all_token_ids[i * bs : (i + 1) * bs])
            parent = chain_hash(parent, tokens)
            req.block_hashes.append(parent)
            if publish:
                self.pool.cache_block(req.block_ids[i], parent, tokens)
            if self.tiers is not None:
                self.tiers.note_seen(parent)

    def free(self, req: Request) -> None:
        self._loading.discard(req.request_id)  # its onload still lands, as cached blocks
        if req.block_ids:
            if self.tiers is not None:
                self._offload(req)
            self.pool.free_blocks(req.block_ids)
        req.block_ids = []
        req.block_hashes = []

    def _offload(self, req: Request) -> None:
        """Copies the request's cached blocks that the tiers admit down to host memory;
        each block keeps its place in the device's eviction order but is not reused before
        its copy is done."""
        assert self.tiers is not None
        admitted = []
        for block_id, block_hash in zip(req.block_ids, req.block_hashes, strict=False):
            tokens = self.pool.blocks[block_id].token_ids
            published = self.pool.blocks[block_id].block_hash == block_hash
            if published and self.tiers.admits(block_hash, tokens):
                admitted.append((block_id, block_hash, tokens))
        for block_id in self.tiers.offload(admitted) if admitted else []:
            self.pool.hold(block_id)

    # -- sharing a prefix between workers (a pull: serving/worker/prefix_share.py) -----------
    def pin_prefix(self, token_ids: list[int], max_blocks: int) -> list[int]:
        """Takes a reference on the device blocks holding the longest cached run of
        `token_ids`' first (at most `max_blocks`) full blocks, so they are not evicted while
        another worker reads them or this one writes after them; `unpin` gives it back."""
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        found: list[int] = []
        parent = None
        for i in range(min(len(token_ids) // bs, max_blocks)):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            parent = chain_hash(parent, tokens)
            block_id = self.pool.lookup(parent, tokens)
            if block_id is None:
                break
            found.append(block_id)
        self.pool.touch(found)
        return found

    def take_blocks(self, n: int) -> list[int]:
        """`n` fresh blocks referenced by the caller (NoFreeBlocksError when the pool has
        not that many); `unpin` returns them."""
        if not self._make_room(n):
            raise NoFreeBlocksError(f"asked for {n} KV blocks, {self.num_free_blocks} free")
        return self._new_blocks(n)

    def publish_prefix(self, token_ids: list[int], first: int, block_ids: list[int]) -> None:
        """Publishes `block_ids`, now holding the KV of `token_ids`' full blocks `first`,
        `first + 1`, ..., in the prefix cache (a block another request published first is
        left unpublished)."""
        bs = self.block_size
        parent = None
        for i in range(first + len(block_ids)):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            parent = chain_hash(parent, tokens)
            if i >= first:
                self.pool.cache_block(block_ids[i - first], parent, tokens)

    def unpin(self, block_ids: list[int]) -> None:
        """Drops the reference `pin_prefix` or `take_blocks` took."""
        self.pool.free_blocks(block_ids)

    def drain_tiers(self, timeout: float = 60.0) -> None:
        """Waits for every tier copy in flight (SSD reads and writes included) and applies
        them: afterwards only requests hold blocks."""
        if self.tiers is not None:
            self.tiers.wait_done(timeout, all_jobs=True)
            self._apply(self.tiers.poll())

    def tier_stats(self) -> KVTierStats | None:
        if self.tiers is None:
            return None
        return self.tiers.stats(self._device_hits)

    def close(self) -> None:
        """Stops the tiers' threads and releases the SSD folder (the next engine may use it)."""
        if self.tiers is not None and self._close_tiers is not None:
            self.drain_tiers()
            self._close_tiers()
            self.tiers = None

    def check_integrity(self) -> None:
        """Pool invariants, after the tier copies in flight have landed."""
        self.drain_tiers()
        self.pool.check_integrity()
        if self.tiers is not None:
            assert self.pool.num_held == 0, "a block is still held for a finished copy"
            self.tiers.check_integrity()
