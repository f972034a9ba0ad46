"""Maps requests to KV blocks: prefix-cache lookup, slot allocation and freeing.

Prefix caching uses chained hashes over full blocks (hash of the parent block's hash plus
this block's token ids); a hit is confirmed by comparing token ids, so a hash collision can
never serve the wrong KV.
"""

from __future__ import annotations

import hashlib
from array import array

from hetero_pd.engine.block_pool import BlockPool
from hetero_pd.engine.request import Request


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
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.enable_prefix_caching = enable_prefix_caching

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def find_cached_prefix(self, req: Request) -> list[int]:
        """Blocks holding a prefix of the prompt; the last prompt token is always recomputed
        so that the request has logits to sample from."""
        if not self.enable_prefix_caching or req.prompt_hidden is not None:
            return []  # an edge prompt's token ids are placeholders
        if req.params.prompt_logprobs is not None:
            return []  # every prompt position must be computed to have its logits
        bs = self.block_size
        max_blocks = (req.num_prompt_tokens - 1) // bs
        hits: list[int] = []
        parent = None
        for i in range(max_blocks):
            tokens = tuple(req.prompt_token_ids[i * bs : (i + 1) * bs])
            parent = chain_hash(parent, tokens)
            block_id = self.pool.lookup(parent, tokens)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def allocate_new(self, req: Request, cached_blocks: list[int], num_new_tokens: int) -> bool:
        """Gives a request with no blocks its cached prefix plus room for `num_new_tokens`."""
        assert not req.block_ids
        num_cached = len(cached_blocks) * self.block_size
        need = self.blocks_for(num_cached + num_new_tokens) - len(cached_blocks)
        if need + self.pool.num_free_among(cached_blocks) > self.pool.num_free_blocks:
            return False
        self.pool.touch(cached_blocks)
        req.block_ids = cached_blocks + self.pool.get_new_blocks(need)
        req.block_hashes = []
        req.num_computed_tokens = num_cached
        req.num_cached_tokens = num_cached
        self._hash_cached(req, len(cached_blocks))
        return True

    def allocate_slots(self, req: Request, num_new_tokens: int) -> bool:
        """Grows a running request's blocks to hold `num_new_tokens` more tokens."""
        need = self.blocks_for(req.num_computed_tokens + num_new_tokens) - len(req.block_ids)
        if need <= 0:
            return True
        if need > self.pool.num_free_blocks:
            return False
        req.block_ids.extend(self.pool.get_new_blocks(need))
        return True

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

    def free(self, req: Request) -> None:
        if req.block_ids:
            self.pool.free_blocks(req.block_ids)
        req.block_ids = []
        req.block_hashes = []

    def check_integrity(self) -> None:
        self.pool.check_integrity()
