"""What the link handshake exchanges and checks, apart from the session tables it fills.

The :class:`~transfer.linker.Linker` runs the handshake (HMAC proofs both ways first,
:mod:`transfer.auth`)::

    dialler                                   listener
      HELLO {id, role, nonce}           ──>
                                        <──   CHALLENGE {id, role, nonce, proof}
      AUTH {proof, about}               ──>   peer_facts, fingerprint_mismatch -> new_session
                                        <──   WELCOME {token, about}
      peer_facts, fingerprint_mismatch -> new_session

Only after the peer proved the secret does either side say ``about`` itself (:func:`about`);
this module builds that, reads the peer's (:func:`peer_facts`), refuses a peer holding
another model (:func:`fingerprint_mismatch`) and makes the :class:`Session` from both halves.
"""

from __future__ import annotations

from transfer import wire
from transfer.addresses import reachable
from transfer.config import TransferConfig
from transfer.messages import About, Challenge, Hello, RegionInfo
from transfer.session import Identity, Link, Session


def about(me: Identity, regions: list[RegionInfo], fingerprint: str) -> About:
    """What an authenticated peer learns about us: host, pid, data address, regions,
    KV fingerprint."""
    return About(
        host=me.host,
        pid=me.pid,
        data_address=me.data_address,
        regions=regions,
        fingerprint=fingerprint,
    )


def peer_facts(theirs: About, seen_host: str) -> tuple[str, str]:
    """The peer's data address (its wildcard host replaced by ``seen_host``, where we saw or
    dialled it) and KV fingerprint; raises :class:`wire.FrameError` for malformed ones."""
    data_address = reachable(wire.data_address(theirs.data_address), seen_host)
    return data_address, wire.fingerprint(theirs.fingerprint)


def fingerprint_mismatch(
    my_id: str, config: TransferConfig, peer: Hello | Challenge, theirs: str
) -> str | None:
    """Why a peer whose KV fingerprint is ``theirs`` may not link with us, or None."""
    ours = config.fingerprint
    if not ours or not theirs or ours == theirs:
        return None
    return (
        f"KV fingerprints differ: {my_id!r} has {ours}, {peer.engine_id!r} has {theirs}; "
        "the two hold different models (weights or tokenizer), so their KV is not "
        "interchangeable: deploy the same model folder on both"
    )


def new_session(
    hello: Hello | Challenge,
    about: About,
    token: bytes,
    data_address: str,
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
    )
