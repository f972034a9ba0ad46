"""The pool of KV cache blocks: an O(1) free queue, reference counts and a prefix-hash index.

A block is in exactly one of three states::

    free    ref_cnt == 0, no hash      in the free queue, handed out first
    cached  ref_cnt == 0, has a hash   in the free queue (evictable, LRU) and in the hash index
    used    ref_cnt  > 0               owned by one or more requests

A cached or used block may also be *held* while a KV tier copies it down: it keeps its
place in the eviction order but is not handed out until released.
"""

from __future__ import annotations

import itertools
from collections import Counter, OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass


class NoFreeBlocksError(RuntimeError):
    """The pool cannot hand out the blocks asked for."""


@dataclass(slots=True)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] = ()


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # Eviction order: front first. Plain free blocks go to the front, cached ones to the back.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._by_hash: dict[int, int] = {}
        self._held: Counter[int] = Counter()  # block id -> holds
        #: Changes whenever a hash enters or leaves the index (the router's report skips
        #: a pool that did not change).
        self.version = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free plus evictable cached, not held)."""
        return len(self._free) - sum(1 for b in self._held if b in self._free)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_new_blocks(self, n: int) -> list[int]:
        free = self.num_free_blocks
        if n > free:
            raise NoFreeBlocksError(f"asked for {n} KV blocks, {free} free")
        if self._held:
            ids = list(itertools.islice(self._unheld_free(), n))
        else:
            ids = list(itertools.islice(self._free, n))
        for block_id in ids:
            del self._free[block_id]
            block = self.blocks[block_id]
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
        return ids

    def _unheld_free(self) -> Iterator[int]:
        return (b for b in self._free if b not in self._held)

    def hold(self, block_id: int) -> None:
        """Keeps a cached block from being handed out (its KV is being copied, or it must
        survive an allocation) without changing its place in the eviction order."""
        block = self.blocks[block_id]
        if block.block_hash is None:
            raise RuntimeError(f"KV block {block_id} holds no cached KV to keep: {block}")
        self._held[block_id] += 1

    def release(self, block_id: int) -> None:
        if self._held[block_id] <= 0:
            raise RuntimeError(f"KV block {block_id} released more often than held")
        self._held[block_id] -= 1
        if not self._held[block_id]:
            del self._held[block_id]

    def evicts_held(self, n: int) -> bool:
        """Whether `n` new blocks, in plain LRU order, would include a held block."""
        return bool(self._held) and any(b in self._held for b in itertools.islice(self._free, n))

    @property
    def num_held(self) -> int:
        return len(self._held)

    def touch(self, block_ids: list[int]) -> None:
        """Takes a reference on blocks found in the prefix cache."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                del self._free[block_id]
            block.ref_cnt += 1

    def free_blocks(self, block_ids: list[int]) -> None:
        # Tail blocks are the least likely to be shared again: queue them for eviction first.
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of KV block {block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block_id] = None
                if block.block_hash is None:
                    self._free.move_to_end(block_id, last=False)

    def cache_block(self, block_id: int, block_hash: int, token_ids: tuple[int, ...]) -> None:
        """Publishes a full block under its chained hash (first writer wins)."""
        block = self.blocks[block_id]
        if block.block_hash is not None or block_hash in self._by_hash:
            return
        block.block_hash = block_hash
        block.token_ids = token_ids
        self._by_hash[block_hash] = block_id
        self.version += 1

    def lookup(self, block_hash: int, token_ids: tuple[int, ...]) -> int | None:
        """A cached block with this hash, confirmed by comparing its token ids."""
        block_id = self._by_hash.get(block_hash)
        if block_id is None or self.blocks[block_id].token_ids != token_ids:
            return None
        return block_id

    def num_free_among(self, block_ids: list[int]) -> int:
        """How many of `block_ids` count in `num_free_blocks`."""
        return sum(1 for b in block_ids if self.blocks[b].ref_cnt == 0 and b not in self._held)

    def reset_prefix_cache(self) -> None:
        for block_id in list(self._by_hash.values()):
            self._evict(self.blocks[block_id])

    def _evict(self, block: KVCacheBlock) -> None:
        assert block.block_hash is not None
        del self._by_hash[block.block_hash]
        block.block_hash = None
        block.token_ids = ()
        self.version += 1

    def cached_hashes(self, limit: int) -> list[int]:
        """Hashes of at most `limit` cached blocks, most recently used first: blocks in use,
        then evictable ones from the back of the eviction order."""
        used = [b.block_hash for b in self.blocks if b.ref_cnt > 0 and b.block_hash is not None]
        hashes = used[:limit]
        for block_id in reversed(self._free):
            if len(hashes) >= limit:
                break
            block_hash = self.blocks[block_id].block_hash
            if block_hash is not None:
                hashes.append(block_hash)
        return hashes

    def counts(self) -> tuple[int, int, int]:
        """(free, cached, used) block counts."""
        used = sum(1 for b in self.blocks if b.ref_cnt > 0)
        cached = sum(1 for b in self.blocks if b.ref_cnt == 0 and b.block_hash is not None)
        return self.num_blocks - used - cached, cached, used

    def check_integrity(self) -> None:
        """Raises AssertionError unless free + cached + used == total and the indexes agree."""
        free, cached, used = self.counts()
        assert free + cached + used == self.num_blocks
        assert len(self._free) == free + cached, (len(self._free), free, cached)
        for block in self.blocks:
            assert block.ref_cnt >= 0, block
            assert (block.block_id in self._free) == (block.ref_cnt == 0), block
            if block.block_hash is not None:
                assert self._by_hash[block.block_hash] == block.block_id, block
        assert len(self._by_hash) == sum(1 for b in self.blocks if b.block_hash is not None)
