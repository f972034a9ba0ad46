"""Direct writes (local, shm): checksummed by default and verified before commit, written only
inside the receiver's absolute grant window; leases and reservations renewed while alive."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from transfer import (
    KVRegion,
    StatusCode,
    TransferEngine,
    TransferError,
    TransferState,
    checksum,
    layout,
)
from transfer.hashing import tensor_digest
from transfer.testing import blocks_digest
from transfer.transports import direct

from .conftest import Pair

SRC, DST = [1, 2, 3, 4, 5, 6], [40, 41, 42, 43, 44, 45]


def _checksum_failures(eng: TransferEngine, transport: str) -> int:
    return eng.metrics().transport(transport).checksum_failures_total


@pytest.mark.parametrize("transport", ["local", "shm"])
def test_corrupted_direct_write_is_detected_and_retried(
    make_pair: Callable[..., Pair], transport: str
) -> None:
    """Checksums on by default: a byte flipped in the written blocks is caught before commit."""
    p, d = make_pair(sender={"faults": [{"kind": "corrupt", "msg_type": "direct", "nth": 2}]})
    recv = d.reserve("flip", DST, writer=p.engine_id)
    assert recv.blocks is not None
    h = p.push_blocks(d.engine_id, SRC, recv.blocks, transport=transport)
    assert h.wait(10) is TransferState.DONE, h.error
    assert h.attempts >= 2
    assert _checksum_failures(d, transport) >= 1
    assert blocks_digest(d.region(), DST) == blocks_digest(p.region(), SRC)
    d.release("flip")


def _read_back(eng: TransferEngine, transport: str) -> int:
    return eng.metrics().transport(transport).chunks_read_back_total


@pytest.mark.parametrize("dst", [DST, [45, 40, 47, 42, 50, 44]], ids=["run", "scattered"])
@pytest.mark.parametrize("transport", ["local", "shm"])
def test_the_writer_verifies_what_it_copied(
    make_pair: Callable[..., Pair], transport: str, dst: list[int]
) -> None:
    """A direct writer hashes every chunk in the receiver's blocks right after copying it;
    the receiver reads back a chunk the writer found damaged (and NACKs it) and spot-checks
    a few of the others, never all of them."""
    p, d = make_pair(sender={"faults": [{"kind": "corrupt", "msg_type": "direct", "nth": 5}]})
    per_chunk = 4096 // p.region().block_bytes  # FAST's chunk_bytes
    chunks = len(p.region().tensors) * -(-len(SRC) // per_chunk)
    recv = d.reserve("clean", dst, writer=p.engine_id)
    assert recv.blocks is not None
    h = p.push_blocks(d.engine_id, SRC, recv.blocks, transport=transport)
    assert h.wait(10) is TransferState.DONE, h.error
    assert h.attempts == 2  # the fifth chunk of the first attempt landed damaged
    assert _checksum_failures(d, transport) == 1
    # the damaged chunk, plus at least one spot check per attempt: never every chunk
    assert 3 <= _read_back(d, transport) <= chunks
    assert blocks_digest(d.region(), dst) == blocks_digest(p.region(), SRC)
    d.release("clean")
    before = _read_back(d, transport)
    recv = d.reserve("clean2", dst, writer=p.engine_id)
    assert recv.blocks is not None
    h = p.push_blocks(d.engine_id, SRC, recv.blocks, transport=transport)
    assert h.wait(10) is TransferState.DONE, h.error
    assert 1 <= _read_back(d, transport) - before < chunks  # spot checks only
    d.release("clean2")


def test_a_late_claim_from_an_earlier_grant_is_not_believed(
    make_pair: Callable[..., Pair],
) -> None:
    """Attempt 1's "verified" claims arrive after attempt 2 began (its LANDED delayed) while
    attempt 2 damages a chunk: the stale claims must not vouch for attempt 2's blocks."""
    p, d = make_pair(
        sender={
            "faults": [
                {"kind": "corrupt", "msg_type": "direct", "nth": 2},
                {"kind": "corrupt", "msg_type": "direct", "nth": 20},
                {"kind": "delay", "msg_type": "landed", "nth": 1, "delay_s": 0.2},
                {"kind": "delay", "msg_type": "end", "nth": 2, "delay_s": 0.4},
            ]
        }
    )
    recv = d.reserve("late", DST, writer=p.engine_id)
    assert recv.blocks is not None
    h = p.push_blocks(d.engine_id, SRC, recv.blocks, transport="shm")
    assert h.wait(10) is TransferState.DONE, h.error
    assert blocks_digest(d.region(), DST) == blocks_digest(p.region(), SRC)
    d.release("late")


@pytest.mark.parametrize("path", ["tensors", "addresses"])
def test_a_writer_that_claims_what_it_never_wrote_is_caught(
    make_pair: Callable[..., Pair], monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    """A hostile granted writer says every chunk landed and verified but copies nothing: the
    receiver spot-checks claimed chunks at END, so the blocks' old contents are never
    committed as this transfer's KV. Either copy path may lie: by tensors (scattered
    blocks, other layouts) or by address (plain runs of blocks)."""

    def claim_only(out: Any, seq: int, data: torch.Tensor, dst: torch.Tensor, corrupt: bool):
        out.digests[seq] = tensor_digest(out.algo, data)
        out.verified.add(seq)

    def claim_by_address(out: Any, seq: int, plain: tuple[list[int], list[int], int]) -> int:
        chunk, (sources, _, block) = out.chunks[seq], plain
        nbytes = (chunk.hi - chunk.lo) * block
        data = bytes(direct._bytes_at(sources[chunk.ti] + chunk.lo * block, nbytes))
        out.digests[seq] = checksum.digest(out.algo, data)
        out.verified.add(seq)
        return nbytes

    if path == "tensors":
        monkeypatch.setattr(direct, "_plain_runs", lambda out: None)
        monkeypatch.setattr(direct, "_copy_verified", claim_only)
    else:
        monkeypatch.setattr(direct, "_copy_plain", claim_by_address)
    p, d = make_pair(sender={"retry": {"attempts": 2, "base_delay_s": 0.01, "max_delay_s": 0.01}})
    _fails_uncommitted(p, d, "liar")
    assert _read_back(d, "shm") >= 1


def _fails_uncommitted(p: TransferEngine, d: TransferEngine, rid: str) -> None:
    """An shm push from ``p`` to ``d`` fails on checksums and commits nothing."""
    recv = d.reserve(rid, DST, writer=p.engine_id)
    assert recv.blocks is not None
    h = p.push_blocks(d.engine_id, SRC, recv.blocks, transport="shm")
    assert h.wait(10) is TransferState.FAILED
    assert h.error is not None and h.error.code is StatusCode.CHECKSUM_MISMATCH
    assert recv.wait(0.01) is TransferState.PENDING  # never committed
    d.release(rid)


def test_direct_corruption_that_never_stops_fails_uncommitted(
    make_pair: Callable[..., Pair],
) -> None:
    p, d = make_pair(
        sender={
            "faults": [{"kind": "corrupt", "msg_type": "direct", "nth": 1, "count": 1000}],
            "retry": {"attempts": 2, "base_delay_s": 0.01, "max_delay_s": 0.01},
        }
    )
    _fails_uncommitted(p, d, "rotten")
    assert p.held_blocks() == {}


@pytest.mark.parametrize("transport", ["local", "shm"])
def test_direct_write_converts_and_verifies(make_pair: Callable[..., Pair], transport: str) -> None:
    """Checksums hold across a dtype and block-size conversion on the direct path too."""
    p, d = make_pair()
    d.register_region(KVRegion.allocate("half", 4, 64, (8, 2, 8), torch.float16, shared=True))
    dst_ids = [9, 2, 30, 4, 5, 11, 12, 13, 14, 15, 16]  # 88 tokens in blocks of 8
    recv = d.reserve("conv", dst_ids, region="half", writer=p.engine_id)
    assert recv.blocks is not None
    h = p.push_blocks(d.engine_id, SRC, recv.blocks, num_tokens=88, transport=transport)
    assert h.wait(10) is TransferState.DONE, h.error
    for got, src in zip(d.region("half").tensors, p.region().tensors, strict=True):
        want = src[SRC].reshape(-1, 2, 8)[:88].to(torch.float16)
        assert torch.equal(got[dst_ids].reshape(-1, 2, 8), want)
    assert _checksum_failures(d, transport) == 0


def test_late_grant_writes_nothing(make_pair: Callable[..., Pair]) -> None:
    """A GRANT that arrives after its window writes nothing, even into reused blocks."""
    p, d = make_pair(
        sender={"ack_timeout_s": 5.0},
        receiver={
            "grant_s": 0.5,
            "faults": [{"kind": "delay", "msg_type": "grant", "nth": 1, "delay_s": 1.5}],
        },
    )
    recv = d.reserve("late", DST, writer=p.engine_id)
    assert recv.blocks is not None
    h = p.push_blocks(d.engine_id, SRC, recv.blocks, transport="shm")
    deadline = time.monotonic() + 5
    while d.metrics().faults_injected_total < 1:  # the grant is on its (slow) way
        assert time.monotonic() < deadline, "no grant was issued"
        time.sleep(0.01)
    fence = d.release("late")
    assert 0 < fence <= 0.5  # the blocks stay fenced while the grant window is open
    time.sleep(fence)  # honour the fence, as the worker does, then reuse the blocks
    reuse = d.reserve("reuse", DST)
    assert h.wait(10) is TransferState.FAILED
    assert h.error is not None and h.error.code in (StatusCode.STALE_EPOCH, StatusCode.TIMEOUT)
    zeros = KVRegion.allocate("z", 4, 64, (16, 2, 8))
    assert blocks_digest(d.region(), DST) == blocks_digest(zeros, DST)  # nothing landed
    assert reuse.state is TransferState.PENDING
    d.release("reuse")


def test_reservation_renewed_across_a_slow_prefill(make_pair: Callable[..., Pair]) -> None:
    """The prefill side keeps the decode reservation alive while it computes, then pushes."""
    p, d = make_pair()
    kept = d.reserve("slow", DST, writer=p.engine_id, timeout_s=1.0)
    lapsed = d.reserve("lapsed", [50], writer=p.engine_id, timeout_s=1.0)
    assert kept.blocks is not None
    end = time.monotonic() + 2.5
    while time.monotonic() < end:  # a long prefill, renewing on each heartbeat
        p.renew_remote(d.engine_id, kept.blocks)
        time.sleep(0.2)
    assert lapsed.wait(0) is TransferState.TIMED_OUT  # what happens without renewal
    assert not kept.done()
    h = p.push_blocks(d.engine_id, SRC, kept.blocks)
    assert h.wait(10) is TransferState.DONE, h.error
    assert kept.wait(5) is TransferState.DONE
    d.release("slow")
    d.release("lapsed")


def test_only_the_grantee_renews(make_pair: Callable[..., Pair]) -> None:
    p, d = make_pair()
    q, _ = make_pair()
    q.link(d.engine_id, d.address)
    recv = d.reserve("mine", DST, writer=p.engine_id, timeout_s=1.0)
    assert recv.blocks is not None
    before = d.metrics().rejected("not_granted")
    end = time.monotonic() + 1.5
    while time.monotonic() < end:
        q.renew_remote(d.engine_id, recv.blocks)  # not the writer: ignored and counted
        time.sleep(0.2)
    assert recv.wait(5) is TransferState.TIMED_OUT
    assert d.metrics().rejected("not_granted") > before
    d.release("mine")


def test_offer_lease_renewed_by_its_owner_and_its_reader(make_pair: Callable[..., Pair]) -> None:
    p, d = make_pair()
    held = p.offer("held", SRC, reader=d.engine_id, lease_s=0.6)
    assert held.blocks is not None
    end = time.monotonic() + 1.5
    while time.monotonic() < end:
        p.renew("held")  # the owner's own heartbeat
        d.renew_remote(p.engine_id, held.blocks)  # and the reader's
        time.sleep(0.15)
    assert not held.done()
    recv = d.reserve("pull-held", DST, writer=p.engine_id)
    assert recv.blocks is not None
    pull = d.pull_blocks(p.engine_id, held.blocks, recv.blocks)
    assert pull.wait(10) is TransferState.DONE, pull.error
    assert held.wait(5) is TransferState.DONE
    assert blocks_digest(d.region(), DST) == blocks_digest(p.region(), SRC)
    d.release("pull-held")


def test_a_peer_cannot_pin_our_blocks_past_the_renewal_limit(
    make_pair: Callable[..., Pair],
) -> None:
    """A writer renewing our reservation and a reader renewing our offer keep them alive at
    most ``max_renewed_s`` past their making: a peer that renews for ever cannot pin our
    blocks (issue 27: a worker's reports cannot pin another's blocks beyond a lease)."""
    limit = {"max_renewed_s": 1.0}
    p, d = make_pair(sender=limit, receiver=limit)
    recv = d.reserve("pinned", DST, writer=p.engine_id, timeout_s=0.4)
    held = p.offer("pinned-offer", SRC, reader=d.engine_id, lease_s=0.4)
    assert recv.blocks is not None and held.blocks is not None
    end = time.monotonic() + 4.0
    while time.monotonic() < end and not (recv.done() and held.done()):
        p.renew_remote(d.engine_id, recv.blocks)  # the writer's renewals
        d.renew_remote(p.engine_id, held.blocks)  # the reader's
        time.sleep(0.1)
    assert recv.wait(0) is TransferState.TIMED_OUT
    assert held.wait(0) is TransferState.TIMED_OUT
    d.release("pinned")


def test_two_threads_copy_only_while_the_grant_is_open(monkeypatch: pytest.MonkeyPatch) -> None:
    """Direct writes copy a slice's chunks on two threads (the I/O thread and a helper);
    each chunk starts only while the grant is open, and the chunks neither thread started
    go back to the front of the queue in their order."""
    copied: list[tuple[int, str]] = []
    out = SimpleNamespace(
        queue=deque(range(8)),
        chunks=[layout.Chunk(seq, 0, seq, seq + 1) for seq in range(10)],
        region=SimpleNamespace(block_bytes=1 << 20),
        grant_until=time.monotonic() + 60,
    )

    def copy_chunk(o: Any, seq: int, fault: str | None) -> int:
        assert o is out and fault is None
        copied.append((seq, threading.current_thread().name))
        if len(copied) == 5:
            out.grant_until = time.monotonic() - 1  # the grant runs out during chunk 5
        # out of step (chunks start at 0, 40, 80 ms here and 0, 60, 120 ms on the helper),
        # so the fifth start is the third here and both threads then find the grant closed
        time.sleep(0.06 if threading.current_thread().name.startswith("helper") else 0.04)
        return 1 << 20

    monkeypatch.setattr(direct, "_copy_chunk", copy_chunk)
    with ThreadPoolExecutor(1, "helper") as pool:
        done, nbytes = direct._copy_in_two(out, pool.submit)  # type: ignore[arg-type]
        assert nbytes == len(done) << 20
        assert sorted(done) == sorted(seq for seq, _ in copied) and len(done) == 5
        assert len({name for _, name in copied}) == 2  # both threads copied
        assert list(out.queue) == [seq for seq in range(8) if seq not in done]
        out.queue.extend([8, 9])
        assert direct._copy_in_two(out, pool.submit) == ([], 0)  # type: ignore[arg-type]
    assert list(out.queue) == [seq for seq in range(10) if seq not in done]


@pytest.mark.parametrize("ids", [[62, 63, 64, 65], [-2, -1, 0, 1]], ids=["past-end", "negative"])
def test_destination_blocks_outside_the_mapped_region_are_refused(ids: list[int]) -> None:
    """A hostile receiver grants blocks its region does not have: the writer refuses before
    copying anything (a memmove there would write outside the mapping), the region intact."""
    _refused_grant(ids, sources=len(ids))


@pytest.mark.parametrize("ids", [[63], [60, 61, 62]], ids=["one-at-the-end", "too-few"])
def test_a_grant_of_fewer_blocks_than_the_source_is_refused(ids: list[int]) -> None:
    """A hostile receiver grants fewer destination blocks than the tokens need, ending at its
    region's last block: all inside the mapping and a run, but copying the source's length
    from there would write past the mapping's end. The writer refuses before any copy."""
    assert "32 tokens need 8" in _refused_grant(ids, sources=8)


def _refused_grant(ids: list[int], sources: int) -> str:
    """Pushes ``sources`` full blocks (4 tokens each) under a grant of destination ``ids``
    in a 64-block region; the writer must refuse before copying anything. The error text."""
    region = KVRegion.allocate("kv", 2, 64, (4, 2, 8))
    dst = [torch.zeros_like(t) for t in region.tensors]
    out = SimpleNamespace(
        session=object(),
        src_ids=torch.arange(sources),
        num_tokens=sources * 4,
        dst_tensors=dst,
        dst=SimpleNamespace(block_ids=tuple(ids)),
        dst_ids=None,
    )
    with pytest.raises(TransferError) as err:
        direct.pump_direct(out, None, None, None, None)  # type: ignore[arg-type]
    assert err.value.code is StatusCode.KV_CACHE_NOT_EXIST
    assert all(int(t.count_nonzero()) == 0 for t in dst)
    return str(err.value)


@pytest.mark.parametrize(
    ("src", "dst", "by_address"),
    [
        (list(range(4, 28)), list(range(30, 54)), True),  # runs: copied by address
        (list(range(4, 28)), [*range(30, 41), *range(42, 55)], False),  # a gap: by tensors
    ],
    ids=["runs", "scattered"],
)
def test_plain_runs_are_copied_by_address_and_verified(
    make_pair: Callable[..., Pair],
    monkeypatch: pytest.MonkeyPatch,
    src: list[int],
    dst: list[int],
    by_address: bool,
) -> None:
    """Runs of whole blocks in the same format are copied and hashed by address, a chunk
    at a time without a tensor op; the writer verifies every chunk, the receiver reads back
    only its spot checks, and the blocks land equal. Anything else takes the tensor path."""
    calls: list[int] = []
    real = direct._copy_plain

    def counted(out: Any, seq: int, plain: tuple[list[int], list[int], int]) -> int:
        calls.append(seq)
        return real(out, seq, plain)

    monkeypatch.setattr(direct, "_copy_plain", counted)
    p, d = make_pair(sender={"chunk_bytes": 4096})
    recv = d.reserve("plain", dst, writer=p.engine_id)
    assert recv.blocks is not None
    h = p.push_blocks(d.engine_id, src, recv.blocks, transport="shm")
    assert h.wait(10) is TransferState.DONE, h.error
    assert blocks_digest(d.region(), dst) == blocks_digest(p.region(), src)
    shm = d.metrics().transport("shm")
    assert (len(calls) > 1) is by_address
    if by_address:
        assert 1 <= shm.chunks_read_back_total < len(calls)  # spot checks only
    d.release("plain")
