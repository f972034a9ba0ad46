"""Fixtures: a receiver engine in a child process, and parent-side engines cleaned up."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from transfer import KVRegion, TransferEngine, TransferState
from transfer.testing import PeerProcess, RegionSpec, blocks_digest, fill, make_config

SECRET = "test-secret"
REGION = RegionSpec(seed=7)
#: Small frames so that a transfer of a few blocks spans many of them.
FAST = {
    "secret": SECRET,
    "chunk_bytes": 4096,
    "ack_timeout_s": 0.5,
    "link_timeout_s": 2.0,
    "timeout_s": 8.0,
    "retry": {"attempts": 6, "base_delay_s": 0.01, "max_delay_s": 0.1},
}

_ids = itertools.count()


@pytest.fixture(scope="module")
def receiver() -> Iterator[PeerProcess]:
    """A decode-side engine in its own process (shared-memory region)."""
    peer = PeerProcess(f"decode-{next(_ids)}", make_config(FAST), REGION)
    try:
        yield peer
    finally:
        peer.close()


@pytest.fixture
def make_engine() -> Iterator[Callable[..., TransferEngine]]:
    """Build parent-side engines (closed at teardown) with a region filled with seed 99."""
    engines: list[TransferEngine] = []

    def build(shared: bool = False, **overrides: object) -> TransferEngine:
        spec = {**FAST, **overrides}
        eng = TransferEngine(f"prefill-{next(_ids)}", "prefill", make_config(spec))
        region = KVRegion.allocate("kv", 4, 64, (16, 2, 8), shared=shared)
        fill(region, 99)
        eng.register_region(region)
        engines.append(eng)
        return eng

    try:
        yield build
    finally:
        for eng in engines:
            eng.close()


Pair = tuple[TransferEngine, TransferEngine]


@pytest.fixture
def make_pair() -> Iterator[Callable[..., Pair]]:
    """A prefill engine linked to a decode engine (region in /dev/shm), both in this process,
    so every transport (local, shm, tcp) can run between them; closed at teardown."""
    made: list[TransferEngine] = []

    def build(sender: dict[str, Any] | None = None, receiver: dict[str, Any] | None = None) -> Pair:
        n = next(_ids)
        p = TransferEngine(f"p-pair-{n}", "prefill", make_config({**FAST, **(sender or {})}))
        d = TransferEngine(f"d-pair-{n}", "decode", make_config({**FAST, **(receiver or {})}))
        made.extend((p, d))
        src = KVRegion.allocate("kv", 4, 64, (16, 2, 8))
        fill(src, 3)
        p.register_region(src)
        d.register_region(KVRegion.allocate("kv", 4, 64, (16, 2, 8), shared=True))
        p.link(d.engine_id, d.address)
        return p, d

    try:
        yield build
    finally:
        for eng in made:
            eng.close()


def push_tcp(
    p: TransferEngine, d: TransferEngine, rid: str, src: list[int], dst: list[int]
) -> None:
    """One tcp push of ``src`` into ``dst`` reserved for ``p``, DONE with identical bytes."""
    recv = d.reserve(rid, dst)
    assert recv.blocks is not None
    h = p.push_blocks(d.engine_id, src, recv.blocks, transport="tcp")
    assert h.wait(10) is TransferState.DONE, h.error
    assert blocks_digest(d.region(), dst) == blocks_digest(p.region(), src)
    d.release(rid)
