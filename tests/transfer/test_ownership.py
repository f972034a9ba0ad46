"""Ownership across failures: peers killed mid-transfer on every transport, stale epochs,
repeated transfer ids, no leaks."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from transfer import KVRegion, RemoteBlocks, TransferEngine, TransferError, TransferState
from transfer.region import sweep_stale_shm
from transfer.testing import PeerProcess, blocks_digest, make_config

from .conftest import FAST, REGION

SRC, DST = [1, 2, 3, 4], [40, 41, 42, 43]


#: transport -> (forced transport, extra sender config)
KILLABLE = {
    "tcp": ("tcp", {}),
    "tcp-link": ("tcp", {"data_channel": False}),
    "shm": ("shm", {}),
}


@pytest.mark.parametrize("transport", sorted(KILLABLE))
def test_receiver_killed_mid_transfer(
    make_engine: Callable[..., TransferEngine], transport: str
) -> None:
    """The decode process dies before the ACK: the push ends inside its deadline, blocks freed."""
    forced, extra = KILLABLE[transport]
    delay_end = [{"kind": "delay", "msg_type": "end", "nth": 1, "delay_s": 0.5}]
    eng = make_engine(faults=delay_end, **extra)
    with PeerProcess(f"decode-doomed-{transport}", make_config(FAST), REGION) as peer:
        eng.link(peer.engine_id, peer.address)
        blocks = RemoteBlocks.from_wire(peer.call("reserve", rid="doomed", ids=DST))
        t0 = time.monotonic()
        h = eng.push_blocks(peer.engine_id, SRC, blocks, transport=forced, timeout_s=3)
        peer.kill()
        assert sweep_stale_shm() >= 1  # the dead peer's /dev/shm region is reclaimed
        state = h.wait(6)
        assert state in (TransferState.TIMED_OUT, TransferState.FAILED)
        assert time.monotonic() - t0 < 5
        assert h.error is not None and h.error.code.name in ("TIMEOUT", "LINK_FAILED", "NOT_LINKED")
        assert h.released in ("timeout", "failed")
        assert eng.held_blocks() == {}
        assert eng.healthy()


def test_local_receiver_closed_mid_transfer(make_engine: Callable[..., TransferEngine]) -> None:
    """In one process the peer engine shuts down mid-push: same outcome as a killed process."""
    eng = make_engine(faults=[{"kind": "delay", "msg_type": "end", "nth": 1, "delay_s": 0.5}])
    doomed = make_engine(shared=True)
    eng.link(doomed.engine_id, doomed.address)
    recv = doomed.reserve("doomed-local", DST, writer=eng.engine_id)
    assert recv.blocks is not None
    t0 = time.monotonic()
    h = eng.push_blocks(doomed.engine_id, SRC, recv.blocks, transport="local", timeout_s=3)
    doomed.close()
    assert h.wait(6) in (TransferState.TIMED_OUT, TransferState.FAILED)
    assert time.monotonic() - t0 < 5
    assert recv.state is TransferState.FAILED  # never DONE: nothing was committed
    assert eng.held_blocks() == {}
    assert eng.healthy()


@pytest.mark.parametrize("transport", sorted(KILLABLE))
def test_sender_killed_reservation_times_out_and_refuses_late_writes(
    make_engine: Callable[..., TransferEngine], transport: str
) -> None:
    """The prefill process's push stalls (its END is lost), the reservation times out and
    the process dies: later writes are refused. A direct (shm) writer's grant that was still
    open fences the blocks until it lapses, since a killed writer cannot be told from a slow
    live one: whether it was still open depends on the race between the kill and the
    writer's own give-up, so the release is checked for what each outcome means."""
    forced, extra = KILLABLE[transport]
    grant_s = 10.0
    eng = make_engine(shared=True, grant_s=grant_s)
    recv = eng.reserve("orphan", DST, timeout_s=1.5)
    assert recv.blocks is not None
    drop_end = [{"kind": "drop", "msg_type": "end", "nth": 1, "count": 99}]
    sender_cfg = {**FAST, **extra, "faults": drop_end}
    with PeerProcess(
        f"prefill-doomed-{transport}",
        make_config(sender_cfg),
        dataclasses.replace(REGION, shared=False),
    ) as peer:
        peer.call("link", peer=eng.engine_id, address=eng.address)
        wire_dst = recv.blocks.to_wire()
        peer.call("push", peer=eng.engine_id, src=SRC, dst=wire_dst, transport=forced)
        assert recv.wait(5) is TransferState.TIMED_OUT
        assert recv.error is not None and recv.error.code.name == "TIMEOUT"
        peer.kill()
    # a late push into the timed-out reservation (same epoch) is refused
    late = make_engine(**extra)
    late.link(eng.engine_id, eng.address)
    h = late.push_blocks(eng.engine_id, SRC, recv.blocks, transport=forced)
    assert h.wait(5) is TransferState.FAILED
    assert h.error is not None and h.error.code.name == "STALE_EPOCH"
    eng.check_integrity()
    wait = eng.release("orphan")
    assert eng.reserved_blocks() == {"kv": 0}
    assert 0.0 <= wait <= grant_s and (wait == 0.0 or forced == "shm")
    if wait > 0.0:  # the blocks are not handed out again while the grant lasts
        with pytest.raises(TransferError, match="fenced"):
            eng.reserve("reuse", DST)
    else:
        assert eng.reserve("reuse", DST).blocks is not None
        assert eng.release("reuse") == 0.0
    eng.check_integrity()


def test_released_blocks_reject_old_epoch(
    receiver: PeerProcess, make_engine: Callable[..., TransferEngine]
) -> None:
    eng = make_engine()
    eng.link(receiver.engine_id, receiver.address)
    old = RemoteBlocks.from_wire(receiver.call("reserve", rid="epoch-a", ids=DST))
    receiver.call("release", rid="epoch-a")
    receiver.call("zero")
    new = RemoteBlocks.from_wire(receiver.call("reserve", rid="epoch-b", ids=DST))
    assert new.epoch != old.epoch
    h = eng.push_blocks(receiver.engine_id, SRC, old)
    assert h.wait(5) is TransferState.FAILED
    assert h.error is not None and h.error.code.name == "STALE_EPOCH"
    assert not h.error.recoverable
    assert receiver.call("digest", ids=DST) == blocks_digest(_zeros(eng), DST)  # untouched
    ok = eng.push_blocks(receiver.engine_id, SRC, new)
    assert ok.wait(5) is TransferState.DONE
    receiver.call("release", rid="epoch-b")


def test_repeated_transfer_id_applied_once(
    receiver: PeerProcess, make_engine: Callable[..., TransferEngine]
) -> None:
    eng = make_engine()
    eng.link(receiver.engine_id, receiver.address)
    blocks = RemoteBlocks.from_wire(receiver.call("reserve", rid="dup", ids=DST))
    first = eng.push_blocks(receiver.engine_id, SRC, blocks, transfer_id="xid-dup", transport="tcp")
    assert first.wait(5) is TransferState.DONE
    receiver.call("zero")
    again = eng.push_blocks(receiver.engine_id, SRC, blocks, transfer_id="xid-dup", transport="tcp")
    assert again.wait(5) is TransferState.DONE  # acknowledged as a duplicate...
    assert receiver.call("digest", ids=DST) == blocks_digest(_zeros(eng), DST)  # ...not re-applied
    assert receiver.counts().metrics.transport("tcp").duplicates_total >= 1
    receiver.call("release", rid="dup")


def _zeros(eng: TransferEngine) -> KVRegion:
    region = eng.region()
    return KVRegion.allocate("z", region.num_layers, region.num_blocks, region.block_shape)


def test_a_live_region_is_never_swept_whatever_its_pid_says() -> None:
    """/dev/shm may be shared by PID namespaces (containers): a live region whose name holds
    a pid that means nothing here (or another process) must survive a sweep; it was
    deleted, since the sweep asked os.kill about the pid in its own namespace."""
    import os

    from transfer.region import SHM_PREFIX, SHM_ROOT

    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    unused = next(p for p in range(pid_max - 1, 1, -1) if not os.path.exists(f"/proc/{p}"))
    region = KVRegion.allocate("kv", 1, 4, (4, 2, 2), shared=True)
    assert region.shm_paths is not None
    home = os.path.dirname(region.shm_paths[0])
    elsewhere = os.path.join(SHM_ROOT, f"{SHM_PREFIX}-{unused}-{os.urandom(4).hex()}")
    os.rename(home, elsewhere)  # as a process of another namespace names it
    try:
        sweep_stale_shm()
        assert os.path.isdir(elsewhere), "a live region was swept"
    finally:
        if os.path.isdir(elsewhere):
            os.rename(elsewhere, home)
        region.close()
    assert not os.path.exists(home)
