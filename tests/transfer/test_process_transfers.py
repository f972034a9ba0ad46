"""Two real processes on loopback: bytes identical after tcp and shm pushes and tcp pulls
(of blocks the source offered)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from transfer import RemoteBlocks, TransferEngine, TransferState
from transfer.testing import PeerProcess, RegionSpec, blocks_digest, make_config


def _reserve(peer: PeerProcess, rid: str, ids: list[int]) -> RemoteBlocks:
    return RemoteBlocks.from_wire(peer.call("reserve", rid=rid, ids=ids))


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_push_bytes_identical(
    receiver: PeerProcess, make_engine: Callable[..., TransferEngine], transport: str
) -> None:
    eng = make_engine()
    eng.link(receiver.engine_id, receiver.address)
    src, dst_ids = [3, 4, 5, 9, 20, 21, 22, 40], [10, 11, 12, 13, 30, 2, 1, 50]
    blocks = _reserve(receiver, f"push-{transport}", dst_ids)
    h = eng.push_blocks(receiver.engine_id, src, blocks, transport=transport)
    assert h.wait(10) is TransferState.DONE, h.error
    assert h.released == "ack"
    assert receiver.wait(f"push-{transport}", 5).state == "done"
    assert receiver.call("digest", ids=dst_ids) == blocks_digest(eng.region(), src)
    receiver.call("release", rid=f"push-{transport}")
    counts = receiver.counts()
    assert counts.reserved == 0 and eng.held_blocks() == {}
    assert counts.metrics.transport(transport).transfers_received_total >= 1


def test_layer_streaming_push(
    receiver: PeerProcess, make_engine: Callable[..., TransferEngine]
) -> None:
    """Prefill pushes layer by layer; the reservation completes only after the last layer."""
    eng = make_engine()
    eng.link(receiver.engine_id, receiver.address)
    blocks = _reserve(receiver, "stream", [5, 6, 7])
    handles = []
    for layer in range(4):
        handles.append(
            eng.push_blocks(receiver.engine_id, [0, 1, 2], blocks, layers=(layer, layer + 1))
        )
        if layer < 3:
            assert handles[-1].wait(10) is TransferState.DONE
            assert receiver.wait("stream", 0.05).state == "pending"
    assert handles[-1].wait(10) is TransferState.DONE
    assert receiver.wait("stream", 5).state == "done"
    assert receiver.call("digest", ids=[5, 6, 7]) == blocks_digest(eng.region(), [0, 1, 2])
    receiver.call("release", rid="stream")


def test_pull_over_tcp(make_engine: Callable[..., TransferEngine]) -> None:
    """The decode side (parent) pulls from a prefill process that linked to it."""
    eng = make_engine()
    with PeerProcess(
        "prefill-src",
        make_config({"secret": "test-secret"}),
        RegionSpec(seed=3, shared=False),
    ) as prefill:
        prefill.call("link", peer=eng.engine_id, address=eng.address)
        ticket = prefill.call(
            "offer", rid="held-1", ids=[30, 31], reader=eng.engine_id, layers=[1, 3]
        )
        recv = eng.reserve("pull-1", [7, 8], writer="prefill-src")
        assert recv.blocks is not None
        h = eng.pull_blocks(
            "prefill-src", RemoteBlocks.from_wire(ticket), recv.blocks, layers=(1, 3)
        )
        assert h.wait(10) is TransferState.DONE, h.error
        assert prefill.call("digest", ids=[30, 31], layers=[1, 3]) == blocks_digest(
            eng.region(), [7, 8], (1, 3)
        )
        assert recv.wait(0.01) is TransferState.PENDING  # layers 0 and 3 never came
        eng.release("pull-1")
        assert prefill.counts().held == 0


def test_unknown_region_and_bad_blocks(
    receiver: PeerProcess, make_engine: Callable[..., TransferEngine]
) -> None:
    eng = make_engine()
    eng.link(receiver.engine_id, receiver.address)
    blocks = _reserve(receiver, "bad", [1, 2])
    wrong = RemoteBlocks("bad", blocks.epoch, blocks.block_ids, region="nope")
    h = eng.push_blocks(receiver.engine_id, [1, 2], wrong)
    assert h.wait(5) is TransferState.FAILED
    assert h.error is not None and h.error.code.name == "KV_CACHE_NOT_EXIST"
    h = eng.push_blocks(receiver.engine_id, [1, 2, 3], blocks)  # 3 blocks into 2
    assert h.wait(5) is TransferState.FAILED
    assert h.error is not None and h.error.code.name == "PARAM_INVALID"
    receiver.call("release", rid="bad")
