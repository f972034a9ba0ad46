"""BlockPool and KVCacheManager invariants: free-queue order, reference counts, prefix hits
confirmed by token ids, and free + cached + used == total after random walks."""

from __future__ import annotations

import random

import pytest

from hetero_pd.engine import kv_cache_manager
from hetero_pd.engine.block_pool import BlockPool, NoFreeBlocksError
from hetero_pd.engine.kv_cache_manager import KVCacheManager, chain_hash, prompt_block_hashes
from hetero_pd.engine.request import Request
from hetero_pd.sampling_params import SamplingParams

PARAMS = SamplingParams(max_tokens=4)


def cache_all(pool: BlockPool, block_ids: list[int], salt: int = 0) -> dict[int, int]:
    """Publishes each block under a distinct hash; returns block id -> hash."""
    hashes = {}
    for b in block_ids:
        hashes[b] = chain_hash(None, [salt, b])
        pool.cache_block(b, hashes[b], (salt, b))
    return hashes


def test_plain_free_blocks_are_handed_out_before_cached_ones() -> None:
    pool = BlockPool(6)
    first = pool.get_new_blocks(3)
    hashes = cache_all(pool, first)
    pool.free_blocks(first)
    assert pool.counts() == (3, 3, 0)
    assert sorted(pool.get_new_blocks(3)) == [3, 4, 5]
    # the cached blocks are still served by the prefix cache until they are evicted
    assert all(pool.lookup(hashes[b], (0, b)) == b for b in first)
    evicted = pool.get_new_blocks(1)[0]
    assert evicted in first
    assert pool.lookup(hashes[evicted], (0, evicted)) is None
    assert pool.counts() == (0, 2, 4)
    pool.check_integrity()


def test_freed_plain_blocks_are_reused_first() -> None:
    pool = BlockPool(4)
    a = pool.get_new_blocks(2)
    cache_all(pool, a)
    pool.free_blocks(a)  # cached: to the back
    b = pool.get_new_blocks(2)
    pool.free_blocks(b)  # plain: to the front
    assert sorted(pool.get_new_blocks(2)) == sorted(b)
    pool.check_integrity()


def test_cached_blocks_are_evicted_least_recently_used_first() -> None:
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2), pool.get_new_blocks(2)
    cache_all(pool, a + b)
    pool.free_blocks(a)
    pool.free_blocks(b)
    # a prefix hit on a[0] makes it the most recently used
    pool.touch([a[0]])
    pool.free_blocks([a[0]])
    # within one request, tail blocks are queued for eviction first
    assert pool.get_new_blocks(4) == [a[1], b[1], b[0], a[0]]
    assert pool.counts() == (0, 0, 4)
    pool.check_integrity()


def test_held_blocks_keep_their_eviction_place_but_are_not_handed_out() -> None:
    pool = BlockPool(4)
    a = pool.get_new_blocks(4)
    hashes = cache_all(pool, a)
    pool.free_blocks(a)  # eviction order: a[3], a[2], a[1], a[0]
    pool.hold(a[3])
    pool.hold(a[1])
    assert pool.num_free_blocks == 2 and pool.usage == 0.5
    assert pool.num_free_among([a[3], a[2]]) == 1
    assert pool.get_new_blocks(1) == [a[2]], "the oldest unheld cached block goes"
    with pytest.raises(NoFreeBlocksError, match="2 KV blocks, 1 free"):
        pool.get_new_blocks(2)
    assert pool.lookup(hashes[a[3]], (0, a[3])) == a[3], "a held block still serves hits"
    pool.release(a[3])
    assert pool.get_new_blocks(1) == [a[3]], "released: back in its old place, first"
    pool.hold(a[1])  # holds are counted
    pool.release(a[1])
    assert pool.get_new_blocks(1) == [a[0]]
    pool.release(a[1])
    with pytest.raises(RuntimeError, match="released more often than held"):
        pool.release(a[1])
    with pytest.raises(RuntimeError, match="no cached KV"):
        pool.hold(a[2])  # no hash: nothing to copy
    pool.check_integrity()


def test_shared_prefix_blocks_are_reference_counted() -> None:
    pool = BlockPool(4)
    owned = pool.get_new_blocks(2)
    hashes = cache_all(pool, owned)
    shared = [pool.lookup(hashes[b], (0, b)) for b in owned]
    assert shared == owned
    pool.touch(owned)  # a second request takes the same blocks
    assert [pool.blocks[b].ref_cnt for b in owned] == [2, 2]
    pool.free_blocks(owned)
    assert pool.counts() == (2, 0, 2), "blocks freed while another request holds them"
    pool.free_blocks(owned)
    assert pool.counts() == (2, 2, 0)
    # a cached block taken back from the free queue leaves it
    pool.touch([owned[0]])
    assert pool.num_free_blocks == 3
    pool.check_integrity()


def test_double_free_raises() -> None:
    pool = BlockPool(2)
    ids = pool.get_new_blocks(1)
    pool.free_blocks(ids)
    with pytest.raises(RuntimeError, match=f"double free of KV block {ids[0]}"):
        pool.free_blocks(ids)
    with pytest.raises(RuntimeError, match="double free of KV block 1"):
        pool.free_blocks([1])  # never allocated
    pool.check_integrity()


def test_no_free_blocks_error_says_how_many() -> None:
    pool = BlockPool(4)
    pool.get_new_blocks(1)
    with pytest.raises(NoFreeBlocksError, match="asked for 5 KV blocks, 3 free"):
        pool.get_new_blocks(5)
    assert pool.num_free_blocks == 3, "a failed request must not take any block"
    pool.check_integrity()


def test_pool_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="num_blocks must be > 0, got 0"):
        BlockPool(0)


def test_lookup_refuses_a_hash_whose_tokens_differ() -> None:
    pool = BlockPool(2)
    (b,) = pool.get_new_blocks(1)
    h = chain_hash(None, [1, 2, 3, 4])
    pool.cache_block(b, h, (1, 2, 3, 4))
    assert pool.lookup(h, (1, 2, 3, 4)) == b
    assert pool.lookup(h, (1, 2, 3, 5)) is None
    # first writer wins: a second block under the same hash is not published
    (c,) = pool.get_new_blocks(1)
    pool.cache_block(c, h, (9, 9, 9, 9))
    assert pool.lookup(h, (9, 9, 9, 9)) is None
    assert pool.lookup(h, (1, 2, 3, 4)) == b
    pool.check_integrity()


def test_reset_prefix_cache_forgets_every_hash() -> None:
    pool = BlockPool(4)
    held, freed = pool.get_new_blocks(2), pool.get_new_blocks(2)
    hashes = cache_all(pool, held + freed)
    pool.free_blocks(freed)
    pool.reset_prefix_cache()
    assert all(pool.lookup(hashes[b], (0, b)) is None for b in held + freed)
    assert pool.counts() == (2, 0, 2)
    pool.free_blocks(held)
    assert pool.counts() == (4, 0, 0)
    pool.check_integrity()


def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), PARAMS)


def run_prompt(kv: KVCacheManager, req: Request) -> list[int]:
    """Admits a request with its cached prefix, computes its prompt and publishes it."""
    cached = kv.find_cached_prefix(req)
    assert kv.allocate_new(req, cached, req.num_prompt_tokens - len(cached) * kv.block_size)
    req.num_computed_tokens = req.num_prompt_tokens
    kv.cache_computed_blocks(req)
    return cached


def test_forged_hash_collision_is_not_served(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_cache_manager, "chain_hash", lambda parent, tokens: 42)
    kv = KVCacheManager(8, 4)
    first = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    run_prompt(kv, first)
    first_blocks = list(first.block_ids)
    kv.free(first)
    other = make_request("b", [5, 5, 5, 5, 6, 6, 6, 6, 7])
    assert kv.find_cached_prefix(other) == [], "a colliding hash served another prompt's KV"
    # the first block really holds these tokens; the next one collides and is refused
    same = make_request("c", [1, 2, 3, 4, 0, 0, 0, 0, 0])
    assert kv.find_cached_prefix(same) == first_blocks[:1]
    kv.check_integrity()


def test_prefix_hits_and_the_last_prompt_token_is_recomputed() -> None:
    kv = KVCacheManager(16, 4)
    prompt = list(range(100, 108))  # exactly two blocks
    a = make_request("a", prompt)
    assert run_prompt(kv, a) == []
    assert a.block_hashes == prompt_block_hashes(prompt, 4)
    a_blocks = list(a.block_ids)
    kv.free(a)

    again = make_request("again", prompt)
    cached = run_prompt(kv, again)
    assert cached == a_blocks[:1], "the block with the last prompt token must be recomputed"
    assert again.num_cached_tokens == 4

    longer = make_request("longer", [*prompt, 1])
    cached = run_prompt(kv, longer)
    assert cached == a_blocks
    assert longer.num_cached_tokens == 8
    assert kv.pool.blocks[a_blocks[0]].ref_cnt == 2

    diverged = make_request("diverged", [100, 101, 102, 103, 0, 0, 0, 0, 0])
    assert len(run_prompt(kv, diverged)) == 1
    for req in (again, longer, diverged):
        kv.free(req)
    assert kv.pool.counts()[2] == 0
    kv.check_integrity()


def test_prefix_caching_disabled_never_hits() -> None:
    kv = KVCacheManager(8, 4, enable_prefix_caching=False)
    prompt = list(range(9))
    a = make_request("a", prompt)
    run_prompt(kv, a)
    kv.free(a)
    assert kv.find_cached_prefix(make_request("b", prompt)) == []
    assert kv.pool.counts() == (8, 0, 0)
    kv.check_integrity()


def test_allocate_refuses_without_taking_blocks() -> None:
    kv = KVCacheManager(4, 4)
    a = make_request("a", list(range(12)))
    assert kv.allocate_new(a, [], 12)
    b = make_request("b", list(range(50, 58)))
    assert not kv.allocate_new(b, [], 8)
    assert b.block_ids == [] and kv.num_free_blocks == 1
    a.num_computed_tokens = 12
    assert kv.allocate_slots(a, 4)
    assert not kv.allocate_slots(a, 5)
    assert len(a.block_ids) == 4
    kv.check_integrity()


@pytest.mark.parametrize("seed", range(4))
def test_random_pool_walk_keeps_integrity(seed: int) -> None:
    rng = random.Random(seed)
    pool = BlockPool(24)
    owners: list[list[int]] = []
    published: dict[int, tuple[int, ...]] = {}
    for _ in range(400):
        op = rng.random()
        if op < 0.35:
            n = rng.randint(1, 6)
            if n > pool.num_free_blocks:
                with pytest.raises(NoFreeBlocksError):
                    pool.get_new_blocks(n)
            else:
                owners.append(pool.get_new_blocks(n))
        elif op < 0.6 and owners:
            pool.free_blocks(owners.pop(rng.randrange(len(owners))))
        elif op < 0.8 and owners:
            block = rng.choice(rng.choice(owners))
            tokens = (rng.randrange(4), rng.randrange(4))
            h = chain_hash(None, tokens)
            pool.cache_block(block, h, tokens)
            published[h] = tokens
        elif published:
            h, tokens = rng.choice(list(published.items()))
            hit = pool.lookup(h, tokens)
            if hit is not None:
                assert pool.blocks[hit].token_ids == tokens
                pool.touch([hit])
                owners.append([hit])
        pool.check_integrity()
        free, cached, used = pool.counts()
        assert free + cached + used == pool.num_blocks
        assert used == len({b for blocks in owners for b in blocks})
    for blocks in owners:
        pool.free_blocks(blocks)
    assert pool.counts()[2] == 0
    pool.check_integrity()


@pytest.mark.parametrize("seed", range(3))
def test_random_manager_walk_keeps_integrity(seed: int) -> None:
    """Requests sharing prefixes come and go; hits always carry the right tokens."""
    rng = random.Random(seed)
    bs = 4
    kv = KVCacheManager(20, bs)
    stems = [[rng.randrange(8) for _ in range(12)] for _ in range(3)]
    live: list[Request] = []
    for i in range(150):
        if live and (rng.random() < 0.45 or kv.num_free_blocks < 5):
            req = live.pop(rng.randrange(len(live)))
            if rng.random() < 0.5 and kv.allocate_slots(req, 3):
                req.all_token_ids.extend([1, 2, 3])
                req.num_computed_tokens += 3
                kv.cache_computed_blocks(req)
            kv.free(req)
        else:
            stem = rng.choice(stems)
            prompt = stem[: rng.randint(1, 12)] + [
                rng.randrange(8) for _ in range(rng.randint(0, 6))
            ]
            req = make_request(f"r{i}", prompt)
            cached = kv.find_cached_prefix(req)
            for j, block in enumerate(cached):
                assert kv.pool.blocks[block].token_ids == tuple(prompt[j * bs : (j + 1) * bs])
            assert len(cached) * bs < len(prompt)
            if kv.allocate_new(req, cached, len(prompt) - len(cached) * bs):
                req.num_computed_tokens = len(prompt)
                kv.cache_computed_blocks(req)
                live.append(req)
        kv.check_integrity()
    for req in live:
        kv.free(req)
    assert kv.pool.counts()[2] == 0
    kv.check_integrity()


def test_pinned_prefix_survives_eviction_and_pulled_blocks_become_hits() -> None:
    """A holder pins a prompt's cached leading blocks (not evicted while a peer reads them);
    a puller takes fresh blocks, publishes them once the KV landed, and a request then finds
    the whole prefix cached."""
    kv = KVCacheManager(num_blocks=8, block_size=4)
    prompt = list(range(50, 63))  # 3 full blocks + 1 token
    req = Request("a", prompt, PARAMS, frozenset())
    assert kv.allocate_new(req, [], len(prompt))
    req.num_computed_tokens = len(prompt)
    kv.cache_computed_blocks(req)
    kv.free(req)
    pinned = kv.pin_prefix(prompt, 2)
    assert len(pinned) == 2
    kv.pool.get_new_blocks(kv.num_free_blocks)  # evicts everything not pinned
    assert kv.pin_prefix(prompt, 3) == pinned  # only the pinned blocks are still there
    kv.unpin(pinned)  # that call's references
    kv.unpin(pinned)
    kv.pool.check_integrity()

    puller = KVCacheManager(num_blocks=8, block_size=4)
    assert puller.pin_prefix(prompt, 3) == []
    taken = puller.take_blocks(3)
    with pytest.raises(NoFreeBlocksError):
        puller.take_blocks(6)
    puller.publish_prefix(prompt, 1, taken[1:])  # blocks 1 and 2 landed; block 0 did not
    assert puller.pin_prefix(prompt, 3) == []  # a chain is found from its first block only
    puller.publish_prefix(prompt, 0, taken[:1])
    puller.unpin(taken)
    req = Request("b", prompt, PARAMS, frozenset())
    assert puller.find_cached_prefix(req) == taken
    puller.pool.check_integrity()
