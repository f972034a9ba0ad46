"""What the link handshake exchanges and checks, apart from the session tables it fills.

The :class:`~transfer.linker.Linker` runs the handshake (HMAC proofs both ways first,
:mod:`transfer.auth`)::

    dialler                                   listener
      HELLO {id, role, nonce}           ──>
                                        <──   CHALLENGE {id, role, nonce, proof}
      AUTH {proof, about}               ──>   peer_facts, mismatch, keys -> new_session
                                        <──   WELCOME {token, about}
      peer_facts, mismatch, keys -> new_session

Only after the peer proved the secret does either side say ``about`` itself (:func:`about`);
this module builds that, reads the peer's (:func:`peer_facts`), refuses a peer holding
another model or another encryption policy (:func:`mismatch`), agrees on sealing KV
and derives the session's keys (:func:`keys`) and makes the :class:`Session` from both
halves.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass

from transfer import aead, auth, wire
from transfer.addresses import reachable
from transfer.config import TransferConfig
from transfer.messages import About, Challenge, Hello, RegionInfo
from transfer.session import Identity, Link, Session


def about(me: Identity, regions: list[RegionInfo], config: TransferConfig) -> About:
    """What an authenticated peer learns about us: host, pid, data address, regions,
    KV fingerprint, encryption policy."""
    return About(
        host=me.host,
        pid=me.pid,
        data_address=me.data_address,
        regions=regions,
        fingerprint=config.fingerprint,
        encrypt=config.encrypt,  # type: ignore[arg-type]  # checked by TransferConfig
    )


@dataclass(frozen=True, slots=True)
class Keys:
    """A session's keys, all from the link's secret and both handshake nonces (never sent)."""

    #: Seals KV chunks when both ends agree to (:func:`aead.agree`), else None.
    sealer: aead.Sealer | None
    #: MACs the frames we send (:func:`wire.encode`) and those the peer sends.
    mac_send: bytes
    mac_receive: bytes


def keys(
    config: TransferConfig,
    secret: bytes,
    me: Identity,
    theirs: About,
    peer: Hello | Challenge,
    mine: bytes,
) -> Keys:
    """The session's keys, from the secret this peer's link was proven with. ``peer``: its
    HELLO (we listen) or CHALLENGE (we dialled); ``mine``: our nonce."""
    dialler = isinstance(peer, Challenge)
    nonce_c, nonce_s = (mine, peer.nonce) if dialler else (peer.nonce, mine)
    ids = (me.engine_id, peer.engine_id) if dialler else (peer.engine_id, me.engine_id)
    ours, theirs_mac = auth.control_keys(secret, nonce_c, nonce_s, *ids)
    sealer = None
    if aead.agree(config.encrypt, theirs.encrypt, theirs.host == me.host):
        c2s, s2c = auth.session_keys(secret, nonce_c, nonce_s, *ids)
        sealer = aead.Sealer(c2s, s2c) if dialler else aead.Sealer(s2c, c2s)
    if not dialler:
        ours, theirs_mac = theirs_mac, ours
    return Keys(sealer, ours, theirs_mac)


def peer_facts(theirs: About, seen_host: str) -> tuple[str, str]:
    """The peer's data address (its wildcard host replaced by ``seen_host``, where we saw or
    dialled it) and KV fingerprint; raises :class:`wire.FrameError` for malformed ones."""
    data_address = reachable(wire.data_address(theirs.data_address), seen_host)
    return data_address, wire.fingerprint(theirs.fingerprint)


def mismatch(
    my_id: str, config: TransferConfig, peer: Hello | Challenge, theirs: str, about: About
) -> tuple[str, str] | None:
    """Why a peer whose KV fingerprint is ``theirs`` may not link with us (a metric label
    and a message), or None: it holds another model, or one end requires sealed KV that the
    other refuses."""
    if {config.encrypt, about.encrypt} == {"on", "off"}:
        return "encrypt_mismatch", (
            f"transfer encrypt differs: {my_id!r} has {config.encrypt}, {peer.engine_id!r} "
            f"has {about.encrypt}; one requires sealed KV and the other refuses it: set the "
            "same policy on both, or auto"
        )
    ours = config.fingerprint
    if not ours or not theirs or ours == theirs:
        return None
    return "fingerprint_mismatch", (
        f"KV fingerprints differ: {my_id!r} has {ours}, {peer.engine_id!r} has {theirs}; "
        "the two hold different models (weights or tokenizer), so their KV is not "
        "interchangeable: deploy the same model folder on both"
    )


def new_session(
    hello: Hello | Challenge,
    about: About,
    token: bytes,
    data_address: str,
    keys: Keys,
    identity: bytes | None = None,
    link: Link | None = None,
) -> Session:
    """A session from the peer's HELLO / CHALLENGE (who) and AUTH / WELCOME (about it)."""
    return Session(
        hello.engine_id,
        hello.role,
        about.host,
        about.pid,
        wire.regions_by_name(about.regions),
        token,
        identity=identity,
        link=link,
        data_address=data_address,
        sealer=keys.sealer,
        mac_send=keys.mac_send,
        mac_receive=keys.mac_receive,
    )


#: HELLOs whose AUTH has not come yet, kept at most: in all, and from one source address.
MAX_PENDING_HELLOS = 256
MAX_PENDING_PER_ADDRESS = 64


class PendingHellos:
    """Half-done handshakes (HELLO answered, AUTH awaited), bounded so that a flood from
    one address evicts that address's own: past ``MAX_PENDING_PER_ADDRESS`` its oldest goes;
    past ``MAX_PENDING_HELLOS`` in all, the oldest of the address holding the most."""

    def __init__(self) -> None:
        self._by_identity: OrderedDict[bytes, tuple[Hello, bytes, str]] = OrderedDict()

    def add(self, identity: bytes, hello: Hello, nonce: bytes, address: str) -> None:
        self._by_identity.pop(identity, None)
        self._by_identity[identity] = (hello, nonce, address)
        counts = Counter(a for _, _, a in self._by_identity.values())
        if counts[address] > MAX_PENDING_PER_ADDRESS:
            self._evict(address)
        elif len(self._by_identity) > MAX_PENDING_HELLOS:
            self._evict(counts.most_common(1)[0][0])

    def _evict(self, address: str) -> None:
        oldest = next(i for i, (_, _, a) in self._by_identity.items() if a == address)
        del self._by_identity[oldest]

    def pop(self, identity: bytes) -> tuple[Hello, bytes] | None:
        """The HELLO and our nonce of ``identity``'s pending handshake (now done), or None."""
        entry = self._by_identity.pop(identity, None)
        return None if entry is None else entry[:2]
