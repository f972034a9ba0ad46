"""A secret per pair of engines (``per_peer_secrets``): a process holding one engine's
secrets (every pair key it was given) cannot complete a link as another engine id, in
either direction, so it cannot use what was granted to that id; an id nobody gave a
secret for is refused at its HELLO. Each refusal is AUTH_FAILED and counted."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Iterator

import pytest

from transfer import (
    KVRegion,
    RemoteBlocks,
    StatusCode,
    TransferConfig,
    TransferEngine,
    TransferError,
    TransferState,
)
from transfer.messages import Error
from transfer.testing import PeerProcess, blocks_digest, fill, hostile_link, make_config

from .conftest import FAST, REGION

#: What a router would hold (the deployment secret); engines only get their pair keys.
ROOT = b"r" * 32
PER_PEER = {**FAST, "secret": "", "per_peer_secrets": True}


def pair_key(a: str, b: str) -> bytes:
    """The secret of the pair {a, b} (as the serving layer's router derives it)."""
    lo, hi = sorted((a, b))
    return hmac.new(ROOT, f"{len(lo)}:{lo}/{hi}".encode(), hashlib.sha256).digest()


Make = Callable[..., TransferEngine]


@pytest.fixture
def make() -> Iterator[Make]:
    """Engines in per-peer mode, each trusting the ids in ``peers`` under their pair key."""
    made: list[TransferEngine] = []

    def build(engine_id: str, peers: tuple[str, ...] = (), shared: bool = False) -> TransferEngine:
        eng = TransferEngine(engine_id, "both", make_config(PER_PEER))
        made.append(eng)
        region = KVRegion.allocate("kv", 4, 64, (16, 2, 8), shared=shared)
        fill(region, len(made))
        eng.register_region(region)
        for peer in peers:
            eng.trust(peer, pair_key(engine_id, peer))
        return eng

    try:
        yield build
    finally:
        for eng in made:
            eng.close()


def test_each_peer_links_under_its_own_pair_key(make: Make) -> None:
    c = make("c", ("a", "b"), shared=True)
    a, b = make("a", ("c",)), make("b", ("c",))
    a.link("c", c.address)
    b.link("c", c.address)
    assert c.peers() == ["a", "b"]
    for eng in (a, b):
        recv = c.reserve(f"from-{eng.engine_id}", [40, 41], writer=eng.engine_id)
        assert recv.blocks is not None
        h = eng.push_blocks("c", [1, 2], recv.blocks, transport="tcp")
        assert h.wait(10) is TransferState.DONE, h.error
        assert blocks_digest(c.region(), [40, 41]) == blocks_digest(eng.region(), [1, 2])
        c.release(recv.request_id)
    assert c.metrics().auth_failures_total == 0


def test_a_holder_of_one_engines_keys_cannot_link_as_another(make: Make) -> None:
    """Engine a is compromised: it holds k(a, b) and k(a, c). It claims to be b when it
    dials c: whichever of its keys it proves, c refuses (AUTH_FAILED, counted), and links
    only the real b. Claiming an id c holds no key for is refused at the HELLO."""
    c = make("c", ("a", "b"), shared=True)
    held = [pair_key("a", "c"), pair_key("a", "b")]
    for secret in held:
        before = c.metrics()
        answer = hostile_link(c.address, "b", secret)
        assert isinstance(answer, Error) and answer.status is StatusCode.AUTH_FAILED, answer
        after = c.metrics()
        assert after.auth_failures_total == before.auth_failures_total + 1
        assert after.rejected("auth_failed") == before.rejected("auth_failed") + 1
        # The engine code refuses it too: c's CHALLENGE is proven under k(b, c).
        insider = make("b", ())
        insider.trust("c", secret)
        with pytest.raises(TransferError) as info:
            insider.link("c", c.address)
        assert info.value.code is StatusCode.AUTH_FAILED
        insider.close()
    before = c.metrics()
    answer = hostile_link(c.address, "z", held[0])
    assert isinstance(answer, Error) and answer.status is StatusCode.AUTH_FAILED, answer
    assert c.metrics().rejected("unknown_peer") == before.rejected("unknown_peer") + 1
    assert c.metrics().auth_failures_total == before.auth_failures_total + 1
    assert c.peers() == []
    real_b = make("b", ("c",))
    real_b.link("c", c.address)
    assert c.peers() == ["b"]


def test_a_holder_of_one_engines_keys_cannot_pull_what_was_offered_to_another(
    make: Make,
) -> None:
    """c offers blocks to b. a, with every key it holds, cannot link as b, and linked as
    itself it is not the reader (NOT_GRANTED); b pulls the blocks."""
    c = make("c", ("a", "b"))
    ticket = c.offer("for-b", [5, 6], reader="b").blocks
    assert ticket is not None
    for secret in (pair_key("a", "c"), pair_key("a", "b")):
        posing = make("b", ())
        posing.trust("c", secret)
        with pytest.raises(TransferError) as info:
            posing.link("c", c.address)
        assert info.value.code is StatusCode.AUTH_FAILED
        recv = posing.reserve("steal", [20, 21])
        assert recv.blocks is not None
        h = posing.pull_blocks("c", ticket, recv.blocks)
        assert h.wait(10) is TransferState.FAILED
        assert h.error is not None and h.error.code is StatusCode.NOT_LINKED, h.error
        assert blocks_digest(posing.region(), [20, 21]) != blocks_digest(c.region(), [5, 6])
        posing.close()
    a = make("a", ("c",))
    a.link("c", c.address)
    recv = a.reserve("steal", [20, 21])
    assert recv.blocks is not None
    h = a.pull_blocks("c", ticket, recv.blocks)
    assert h.wait(10) is TransferState.FAILED
    assert h.error is not None and h.error.code is StatusCode.NOT_GRANTED
    b = make("b", ("c",))
    b.link("c", c.address)
    recv = b.reserve("mine", [20, 21])
    assert recv.blocks is not None
    h = b.pull_blocks("c", ticket, recv.blocks)
    assert h.wait(10) is TransferState.DONE, h.error
    assert blocks_digest(b.region(), [20, 21]) == blocks_digest(c.region(), [5, 6])


def test_a_listener_posing_as_another_engine_is_refused_by_the_dialler(make: Make) -> None:
    """a dials "c" but reaches b (a compromised engine that listens as c, holding k(a, b)):
    its CHALLENGE cannot prove k(a, c), so a refuses the link before saying anything."""
    impostor = make("c", ())
    impostor.trust("a", pair_key("a", "b"))
    a = make("a", ("c",))
    with pytest.raises(TransferError) as info:
        a.link("c", impostor.address)
    assert info.value.code is StatusCode.AUTH_FAILED
    assert a.metrics().auth_failures_total >= 1
    assert impostor.peers() == [] and a.peers() == []


def test_an_engine_dials_no_peer_it_holds_no_secret_for(make: Make) -> None:
    c = make("c", ("a",))
    a = make("a", ())
    with pytest.raises(TransferError) as info:
        a.link("c", c.address)
    assert info.value.code is StatusCode.AUTH_FAILED
    assert c.metrics().auth_failures_total == 0  # a never sent its HELLO


def test_per_peer_secrets_are_configured_apart_from_the_shared_one() -> None:
    with pytest.raises(ValueError, match="per_peer_secrets"):
        TransferConfig(secret=b"x" * 32, per_peer_secrets=True)
    shared = TransferEngine("shared", "both", make_config(FAST))
    try:
        with pytest.raises(TransferError) as info:
            shared.trust("a", b"k" * 32)
        assert info.value.code is StatusCode.PARAM_INVALID
    finally:
        shared.close()
    per_peer = TransferEngine(
        "pp", "both", TransferConfig(per_peer_secrets=True, require_secret=True)
    )
    try:
        with pytest.raises(TransferError) as info:
            per_peer.trust("a", b"short")
        assert info.value.code is StatusCode.PARAM_INVALID
    finally:
        per_peer.close()


def test_an_engine_in_another_process_links_under_its_pair_key(make: Make) -> None:
    peer = PeerProcess("d-proc", make_config(PER_PEER), REGION)
    try:
        peer.call("trust", peer="p-proc", secret=pair_key("p-proc", "d-proc"))
        p = make("p-proc", ("d-proc",))
        p.link("d-proc", peer.address)
        blocks = RemoteBlocks.from_wire(
            peer.call("reserve", rid="x", ids=[50, 51], writer="p-proc")
        )
        h = p.push_blocks("d-proc", [3, 4], blocks, transport="tcp")
        assert h.wait(10) is TransferState.DONE, h.error
        assert peer.call("digest", ids=[50, 51]) == blocks_digest(p.region(), [3, 4])
        other = make("q-proc", ("d-proc",))
        with pytest.raises(TransferError) as info:
            other.link("d-proc", peer.address)
        assert info.value.code is StatusCode.AUTH_FAILED
        assert peer.counts().metrics.rejected("unknown_peer") == 1
    finally:
        peer.close()
