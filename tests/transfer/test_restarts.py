"""Peers that restart (same or new address) are re-linked at once; the data channel
advertises a reachable host and falls back to the link when it cannot connect."""

from __future__ import annotations

import socket
from collections.abc import Callable

import pytest

from transfer import RemoteBlocks, TransferConfig, TransferEngine, TransferState
from transfer.testing import PeerProcess, blocks_digest, make_config

from .conftest import FAST, REGION

SRC, DST = [1, 2, 3, 4], [20, 21, 22, 23]
#: Long enough that a push waiting for any timeout would retry, which the tests count.
PATIENT = {**FAST, "ack_timeout_s": 8.0, "timeout_s": 20.0}


def _push(eng: TransferEngine, peer: PeerProcess, rid: str, **kw: object) -> int:
    """Pushes SRC into the peer's DST, checks the bytes landed; the attempts it took."""
    blocks = RemoteBlocks.from_wire(peer.call("reserve", rid=rid, ids=DST))
    h = eng.push_blocks(peer.engine_id, SRC, blocks, **kw)  # type: ignore[arg-type]
    assert h.wait(15) is TransferState.DONE, h.error
    assert peer.call("digest", ids=DST) == blocks_digest(eng.region(), SRC)
    peer.call("release", rid=rid)
    return h.attempts


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _relink_counts(eng: TransferEngine) -> tuple[int, int, int]:
    """Links made, retries and timeouts so far (every transport). Relinked at once: one new
    link and no retry, which an attempt that waited for its (PATIENT: 8 s) ACK would count."""
    m = eng.metrics()
    counters = m.transports.values()
    return (
        m.links_total,
        sum(c.retries_total for c in counters),
        sum(c.transfers_timed_out_total for c in counters),
    )


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_decode_restarted_at_a_new_address_is_relinked_at_once(
    make_engine: Callable[..., TransferEngine], transport: str
) -> None:
    eng = make_engine(ack_timeout_s=8.0, timeout_s=20.0)
    first = PeerProcess("decode-phoenix", make_config(PATIENT), REGION)
    try:
        eng.set_peer_address(first.engine_id, first.address)
        _push(eng, first, "before", transport=transport)
    finally:
        first.kill()
    with PeerProcess("decode-phoenix", make_config(PATIENT), REGION) as second:
        assert second.address != first.address
        before = _relink_counts(eng)
        eng.set_peer_address(second.engine_id, second.address)  # the router's view
        _push(eng, second, "after", transport=transport)
        assert _relink_counts(eng) == (before[0] + 1, *before[1:])


def test_decode_restarted_at_the_same_address_is_relinked_at_once(
    make_engine: Callable[..., TransferEngine],
) -> None:
    fixed = {**PATIENT, "port": _free_port(), "data_port": _free_port()}
    eng = make_engine(ack_timeout_s=8.0, timeout_s=20.0)
    first = PeerProcess("decode-same", make_config(fixed), REGION)
    try:
        eng.link(first.engine_id, first.address)
        _push(eng, first, "before", transport="tcp")
    finally:
        first.kill()
    with PeerProcess("decode-same", make_config(fixed), REGION) as second:
        assert second.address == first.address
        before = _relink_counts(eng)
        _push(eng, second, "after", transport="tcp")
        assert _relink_counts(eng) == (before[0] + 1, *before[1:])


def test_advertise_host_names_both_listeners() -> None:
    cfg = TransferConfig(host="0.0.0.0", advertise_host="127.0.0.1", secret=b"s")
    with TransferEngine("adv", "decode", cfg) as eng:
        assert eng.address.startswith("tcp://127.0.0.1:")
        assert eng.data_address.startswith("127.0.0.1:")
    with pytest.raises(ValueError, match="advertise_host"):
        TransferConfig(advertise_host="host:123")


def _data_links(peer: PeerProcess) -> int:
    return peer.counts().metrics.data_links_total


def test_wildcard_bind_data_reaches_the_host_the_link_dialled(
    make_engine: Callable[..., TransferEngine],
) -> None:
    """Bound to 0.0.0.0 without advertise_host: peers use the host they reached us by."""
    with PeerProcess("decode-wild", make_config({**FAST, "host": "0.0.0.0"}), REGION) as peer:
        port = peer.address.rsplit(":", 1)[1]
        eng = make_engine()
        eng.link(peer.engine_id, f"tcp://127.0.0.2:{port}")
        before = _data_links(peer)
        _push(eng, peer, "wild", transport="tcp")
        assert _data_links(peer) == before + 1


@pytest.mark.parametrize(
    "advertised",
    [
        {"host": "127.0.0.2", "advertise_host": "127.0.0.1"},  # refused: nothing listens there
        {"advertise_host": "no-such-host.invalid"},  # does not resolve
    ],
    ids=["refused", "unresolvable"],
)
def test_unreachable_data_channel_falls_back_to_the_link(
    make_engine: Callable[..., TransferEngine], advertised: dict[str, str]
) -> None:
    with PeerProcess("decode-far", make_config({**PATIENT, **advertised}), REGION) as peer:
        bound = advertised.get("host", "127.0.0.1")
        eng = make_engine(ack_timeout_s=8.0, timeout_s=20.0)
        eng.link(peer.engine_id, f"tcp://{bound}:{peer.address.rsplit(':', 1)[1]}")
        before = _data_links(peer)
        # The first push tries the data channel, then the link; the second goes over the
        # link at once (the channel is not tried per push). No attempt waited for its ACK
        # (PATIENT: 8 s): an attempt that times out re-links its peer, and none did.
        assert _push(eng, peer, "far-1", transport="tcp") == 2
        assert _push(eng, peer, "far-2", transport="tcp") == 1
        tcp = eng.metrics().transport("tcp")
        assert (tcp.relinks_total, tcp.transfers_timed_out_total) == (0, 0)
        assert _data_links(peer) == before
        assert eng.metrics().data_fallbacks_total == 1
        assert eng.healthy()
