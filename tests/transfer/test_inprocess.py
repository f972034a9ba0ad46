"""One process, two engines: local transport, conversions, callbacks, asyncio, cancel."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
import torch

from transfer import (
    KVRegion,
    StatusCode,
    TransferConfig,
    TransferEngine,
    TransferError,
    TransferHandle,
    TransferState,
)
from transfer.testing import fill


@pytest.fixture
def pair() -> Iterator[tuple[TransferEngine, TransferEngine]]:
    cfg = TransferConfig(secret=b"s", chunk_bytes=4096, timeout_s=5)
    p, d = TransferEngine("p-local", "prefill", cfg), TransferEngine("d-local", "decode", cfg)
    try:
        src = KVRegion.allocate("kv", 2, 16, (16, 2, 8))
        fill(src, 5)
        p.register_region(src)
        p.link("d-local", d.address)
        yield p, d
    finally:
        p.close()
        d.close()


def _expected(src: KVRegion, ids: list[int], dtype: torch.dtype) -> list[torch.Tensor]:
    return [t[ids].reshape(-1, *t.shape[2:]).to(dtype) for t in src.tensors]


@pytest.mark.parametrize("transport", ["local", "tcp"])
def test_dtype_conversion(pair: tuple[TransferEngine, TransferEngine], transport: str) -> None:
    """float32 source, float16 destination: the receiver side converts once."""
    p, d = pair
    dst = KVRegion.allocate("kv", 2, 16, (16, 2, 8), torch.float16)
    d.register_region(dst)
    recv = d.reserve("conv", [7, 3])
    assert recv.blocks is not None
    h = p.push_blocks("d-local", [0, 1], recv.blocks, transport=transport)
    assert h.wait(5) is TransferState.DONE, h.error
    assert recv.wait(5) is TransferState.DONE
    for got, want in zip(dst.tensors, _expected(p.region(), [0, 1], torch.float16), strict=True):
        assert torch.equal(got[[7, 3]].reshape(-1, 2, 8), want)


@pytest.mark.parametrize("transport", ["local", "tcp"])
def test_block_size_conversion(pair: tuple[TransferEngine, TransferEngine], transport: str) -> None:
    """Source blocks of 16 tokens land in destination blocks of 8 (token order kept)."""
    p, d = pair
    dst = KVRegion.allocate("kv", 2, 32, (8, 2, 8))
    d.register_region(dst)
    dst_ids = [9, 2, 30, 4, 5]  # 40 tokens need 5 blocks of 8
    recv = d.reserve("bs", dst_ids)
    assert recv.blocks is not None
    h = p.push_blocks("d-local", [4, 6, 8], recv.blocks, num_tokens=40, transport=transport)
    assert h.wait(5) is TransferState.DONE, h.error
    for got, want in zip(dst.tensors, _expected(p.region(), [4, 6, 8], torch.float32), strict=True):
        assert torch.equal(got[dst_ids].reshape(-1, 2, 8), want[:40])


def test_callbacks_run_in_progress_and_asyncio(pair: tuple[TransferEngine, TransferEngine]) -> None:
    p, d = pair
    d.register_region(KVRegion.allocate("kv", 2, 16, (16, 2, 8)))
    seen: list[TransferHandle] = []
    recv = d.reserve("cb", [1, 2], callback=seen.append)
    assert recv.blocks is not None
    h = p.push_blocks("d-local", [3, 4], recv.blocks, callback=seen.append)

    async def wait_both() -> tuple[TransferState, TransferState]:
        return await h.wait_async(), await recv.wait_async()

    assert asyncio.run(asyncio.wait_for(wait_both(), 5)) == (TransferState.DONE, TransferState.DONE)
    assert seen == []  # callbacks only run from progress(), in the caller's thread
    assert {x.kind for x in p.progress() + d.progress()} == {"push", "recv"}
    assert set(map(id, seen)) == {id(h), id(recv)}
    h.result(0)


def test_a_callback_that_raises_is_contained(pair: tuple[TransferEngine, TransferEngine]) -> None:
    """A bug in one caller's callback neither escapes progress() (the worker's loop) nor
    keeps the other callbacks and handles from running; it is counted in health()."""
    p, d = pair
    d.register_region(KVRegion.allocate("kv", 2, 16, (16, 2, 8)))
    seen: list[TransferHandle] = []

    def buggy(handle: TransferHandle) -> None:
        raise RuntimeError("a bug in the caller's callback")

    first, second = d.reserve("cb1", [1, 2]), d.reserve("cb2", [5, 6])
    assert first.blocks is not None and second.blocks is not None
    h1 = p.push_blocks("d-local", [3, 4], first.blocks, callback=buggy)
    h1.add_done_callback(seen.append)
    h2 = p.push_blocks("d-local", [7, 8], second.blocks, callback=buggy)
    h2.add_done_callback(seen.append)
    assert (h1.wait(5), h2.wait(5)) == (TransferState.DONE, TransferState.DONE)
    done = p.progress()
    assert set(map(id, done)) == set(map(id, seen)) == {id(h1), id(h2)}
    assert p.health().callback_errors == 2 and p.healthy()
    assert p.progress() == [] and p.health().callback_errors == 2


def test_release_cancels_reservation_and_bad_params_raise(
    pair: tuple[TransferEngine, TransferEngine],
) -> None:
    p, d = pair
    d.register_region(KVRegion.allocate("kv", 2, 16, (16, 2, 8)))
    recv = d.reserve("gone", [1])
    with pytest.raises(TransferError) as info:
        d.reserve("other", [1])
    assert info.value.code is StatusCode.PARAM_INVALID
    d.release("gone")
    assert recv.wait(5) is TransferState.CANCELLED
    with pytest.raises(TransferError) as info:
        p.push_blocks("d-local", [99], recv.blocks)  # type: ignore[arg-type]
    assert info.value.code is StatusCode.KV_CACHE_NOT_EXIST
    with pytest.raises(TransferError) as info:
        p.push_blocks("d-local", [1], recv.blocks, layers=(1, 5))  # type: ignore[arg-type]
    assert info.value.code is StatusCode.PARAM_INVALID
    assert d.reserved_blocks() == {"kv": 0}


def test_unlink_then_push_is_not_linked(pair: tuple[TransferEngine, TransferEngine]) -> None:
    p, d = pair
    d.register_region(KVRegion.allocate("kv", 2, 16, (16, 2, 8)))
    recv = d.reserve("after-unlink", [1])
    assert recv.blocks is not None
    assert p.peers() == ["d-local"]
    p.unlink("d-local")
    assert p.peers() == []
    h = p.push_blocks("d-local", [1], recv.blocks)
    assert h.wait(5) is TransferState.FAILED
    assert h.error is not None and h.error.code is StatusCode.NOT_LINKED
    d.release("after-unlink")


def test_config_from_env_rejects_unknown_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HETERO_PD_TRANSFER_SECRET", "from-env")
    assert TransferConfig.from_env(lease_s=3.0).secret == b"from-env"
    with pytest.raises(ValueError, match="leese_s"):
        TransferConfig.from_env(leese_s=3.0)


@pytest.mark.parametrize("transport", ["local", "tcp"])
def test_the_reservation_is_done_before_the_sender_hears_so(
    pair: tuple[TransferEngine, TransferEngine],
    monkeypatch: pytest.MonkeyPatch,
    transport: str,
) -> None:
    """The sender's DONE (its ACK) goes to the router, which tells decode to run: by then
    decode's reservation must read DONE, or decode recomputes KV it already has. A slow
    ``finish`` on the receiver (a descheduled I/O thread) made the old order visible."""
    p, d = pair
    d.register_region(KVRegion.allocate("kv", 2, 16, (16, 2, 8), shared=True))
    loop = d._core.loop  # nothing public can slow the I/O thread down: that is the point
    finish = loop.finish

    def slow_finish(*args: object, **kwargs: object) -> None:
        time.sleep(0.3)
        finish(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(loop, "finish", slow_finish)
    recv = d.reserve("order", [3, 4], writer=p.engine_id)
    assert recv.blocks is not None
    h = p.push_blocks(d.engine_id, [1, 2], recv.blocks, transport=transport)
    assert h.wait(10) is TransferState.DONE, h.error
    assert recv.state is TransferState.DONE  # no wait: it must already be
    d.release("order")


@pytest.mark.parametrize("transport", ["local", "tcp"])
def test_writes_are_counted_one_per_chunk(
    pair: tuple[TransferEngine, TransferEngine], transport: str
) -> None:
    """chunks_sent_total counts a transfer's writes: 6 blocks of 1 KiB in chunks of at most
    4 KiB are 2 chunks (3 blocks each) per tensor, 8 over the 2 layers' K and V."""
    p, d = pair
    d.register_region(KVRegion.allocate("kv", 2, 16, (16, 2, 8)))
    recv = d.reserve("w", [9, 2, 3, 4, 5, 11])
    assert recv.blocks is not None
    h = p.push_blocks("d-local", [0, 1, 2, 3, 4, 5], recv.blocks, transport=transport)
    assert h.wait(5) is TransferState.DONE, h.error
    counters = p.metrics().transport(transport)
    assert (counters.chunks_sent_total, counters.bytes_sent_total) == (8, 6 * 1024 * 4)
