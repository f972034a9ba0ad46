"""The router's prefix index: what workers report (bounded, validated), what the router
records, and that the engine's block hashes are the ones the router computes."""

from __future__ import annotations

import msgspec
import pytest

from hetero_pd.engine.kv_cache_manager import KVCacheManager, prompt_block_hashes
from hetero_pd.engine.request import Request
from hetero_pd.sampling_params import SamplingParams
from hetero_pd.serving.control import protocol as P
from hetero_pd.serving.control import values as V
from hetero_pd.serving.router.prefix_index import HeldBlocks


def test_report_replaces_and_records_expire() -> None:
    held = HeldBlocks(record_ttl_s=5.0)
    prompt = prompt_block_hashes(list(range(64)), 16)  # 4 blocks
    held.report(V.CachedBlocks.of(1, prompt[:2]))
    assert held.matched(prompt) == 2
    held.record(prompt, now=100.0)
    assert held.matched(prompt, now=101.0) == 4
    assert held.matched(prompt, now=106.0) == 2  # the record expired; the report stays
    held.report(V.CachedBlocks.of(2, prompt[1:]))
    assert held.matched(prompt, now=106.0) == 0  # a chain stops at the first block missing
    held.clear()
    assert held.matched(prompt) == 0 and len(held) == 0


def test_records_are_bounded() -> None:
    held = HeldBlocks(record_capacity=3)
    held.record([1, 2, 3, 4, 5], now=0.0)
    assert len(held) == 3 and held.matched([3, 4, 5], now=1.0) == 3
    assert held.matched([1], now=1.0) == 0  # the oldest went first


def test_a_report_is_bounded_and_validated_by_the_codec() -> None:
    codec = P.router_codec()
    encode = msgspec.msgpack.encode

    def heartbeat(packed: object) -> bytes:
        cached = {"version": 1, "packed": packed}
        return encode({"v": 2, "t": "heartbeat", "worker": "w", "load": {}, "cached": cached})

    report = V.CachedBlocks.of(7, [0, 2**64 - 1, 12345])
    ok = codec.decode(heartbeat(report.packed))
    assert ok.cached.hashes == [0, 2**64 - 1, 12345] and ok.cached.version == 1
    too_many = V.CachedBlocks.of(1, [0] * (V.MAX_REPORTED_BLOCKS + 1)).packed
    for bad in (b"\0" * 9, too_many, [1, 2], "x"):
        with pytest.raises(V.MessageError, match="packed"):
            codec.decode(heartbeat(bad))


def test_the_engines_cached_hashes_are_the_routers_prompt_hashes() -> None:
    """What a worker reports (its pool's hashes, most recently used first) is what the
    router computes from the prompt ids: one function, so the two always agree."""
    kv = KVCacheManager(num_blocks=16, block_size=4)
    prompt = list(range(100, 118))  # 4 full blocks and 2 tokens
    req = Request("r", prompt, SamplingParams(max_tokens=1), frozenset())
    assert kv.allocate_new(req, [], len(prompt))
    req.num_computed_tokens = len(prompt)
    kv.cache_computed_blocks(req)
    version = kv.pool.version
    assert kv.pool.cached_hashes(100) == prompt_block_hashes(prompt, 4)
    assert kv.pool.cached_hashes(2) == prompt_block_hashes(prompt, 4)[:2]
    kv.free(req)
    assert sorted(kv.pool.cached_hashes(100)) == sorted(prompt_block_hashes(prompt, 4))
    assert kv.pool.version == version  # freeing keeps the blocks cached: nothing changed
    kv.pool.get_new_blocks(16)  # evicts them all
    assert kv.pool.cached_hashes(100) == [] and kv.pool.version > version
