"""Mutual shared-secret authentication at link time (HMAC-SHA256 challenge/response).

::

    client (link)                                   server (listening engine)
      HELLO  {eid, role, nonce_c}             ──>
                                              <──   CHALLENGE {eid, role, nonce_s,
                                                      proof_s = H(k, "S"|nonce_c|nonce_s|ids)}
      checks proof_s
      AUTH   {proof_c = H(k, "C"|nonce_s|nonce_c|ids),
              host, pid, data address, regions} ──>
                                              <──   WELCOME {token, host, pid, data address,
                                                      regions}   (or ERROR AUTH_FAILED)

Who a side is (host, pid, data address) and what it holds (region descriptions) travel only
to a peer that already proved the secret: the client's in AUTH, the server's in WELCOME.

Every later frame carries the session token, bound to the ZMQ connection it was issued on,
and a MAC under the session's control key of its direction (:func:`control_keys`): a frame
altered on the way, or made by anyone who did not take part in the handshake, is dropped.
Neither side ever sends the secret. An empty secret still runs the exchange (so both sides
must agree on it) but offers no protection; use it on a trusted loopback only.

Which secret a link is proven with is :class:`PeerSecrets`' answer for the peer's claimed
id (HELLO's, or the one we dial): the one shared secret (``TransferConfig.secret``), or with
``per_peer_secrets`` the secret given for that id alone (:meth:`TransferEngine.trust
<transfer.engine.TransferEngine.trust>`; the serving layer's pair keys, which only the two
ends and the router hold). An id with none is refused at once (AUTH_FAILED, counted
``unknown_peer``), so holding one peer's secret never lets a process link as another id.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets

from transfer.errors import StatusCode, TransferError

NONCE_BYTES = 16
#: The shortest per-peer secret :meth:`PeerSecrets.add` takes.
MIN_PEER_SECRET_BYTES = 16


def unknown_peer(peer_id: str) -> TransferError:
    """Why a link with ``peer_id`` is refused when we hold no secret for it."""
    return TransferError(
        StatusCode.AUTH_FAILED, f"no link secret for engine {peer_id!r}: it may not link here"
    )


class PeerSecrets:
    """The secret each peer's link is proven with.

    Shared (``per_peer`` False): ``shared`` for every peer id. Per peer: only the secret
    :meth:`add` gave for that id; an id with none links with nobody (:meth:`secret_for`
    None), whatever it presents. Written from any thread (a dict item is set atomically),
    read by the I/O thread.
    """

    def __init__(self, shared: bytes, per_peer: bool) -> None:
        self._shared, self.per_peer = shared, per_peer
        self._by_peer: dict[str, bytes] = {}

    def secret_for(self, peer_id: str) -> bytes | None:
        """The secret a link with ``peer_id`` is proven with, or None: refuse it."""
        if not self.per_peer:
            return self._shared
        return self._by_peer.get(peer_id)

    def add(self, peer_id: str, secret: bytes) -> None:
        """Link with ``peer_id`` under ``secret`` from now on (per-peer mode only)."""
        if not self.per_peer:
            raise TransferError(
                StatusCode.PARAM_INVALID,
                "a secret per peer needs TransferConfig.per_peer_secrets (this engine links "
                "with its one shared secret)",
            )
        if not peer_id or len(secret) < MIN_PEER_SECRET_BYTES:
            raise TransferError(
                StatusCode.PARAM_INVALID,
                f"a peer secret needs a peer id and at least {MIN_PEER_SECRET_BYTES} bytes",
            )
        self._by_peer[peer_id] = bytes(secret)

    def known(self) -> list[str]:
        """The peer ids this engine may link with (per-peer mode), sorted."""
        return sorted(self._by_peer)


def new_nonce() -> bytes:
    """A fresh random nonce (also used for session tokens)."""
    return secrets.token_bytes(NONCE_BYTES)


def server_proof(secret: bytes, nonce_c: bytes, nonce_s: bytes, client: str, server: str) -> bytes:
    """What the listening side sends to prove it knows the secret."""
    return _mac(secret, b"S", nonce_c, nonce_s, client, server)


def client_proof(secret: bytes, nonce_c: bytes, nonce_s: bytes, client: str, server: str) -> bytes:
    """What the linking side sends to prove it knows the secret."""
    return _mac(secret, b"C", nonce_s, nonce_c, client, server)


def data_proof(token: bytes, receiver: str) -> bytes:
    """What opens a data connection: binds it to a session *and* to the engine it is for, so
    a connection that reaches the wrong engine (say, our own listener) is refused."""
    return hmac.new(token, b"data|" + receiver.encode(), hashlib.sha256).digest()[:NONCE_BYTES]


def session_keys(
    secret: bytes, nonce_c: bytes, nonce_s: bytes, client: str, server: str
) -> tuple[bytes, bytes]:
    """The session's keys for sealed KV (:mod:`transfer.aead`): client-to-server and
    server-to-client. Both nonces travel in clear, the secret never does."""
    root = _mac(secret, b"K", nonce_c, nonce_s, client, server)
    return (
        hmac.new(root, b"client->server", hashlib.sha256).digest(),
        hmac.new(root, b"server->client", hashlib.sha256).digest(),
    )


def control_keys(
    secret: bytes, nonce_c: bytes, nonce_s: bytes, client: str, server: str
) -> tuple[bytes, bytes]:
    """The session's keys for the MAC on every frame after the handshake (:func:`wire.encode
    <transfer.wire.encode>`): client-to-server and server-to-client, apart from the KV keys."""
    root = _mac(secret, b"M", nonce_c, nonce_s, client, server)
    return (
        hmac.new(root, b"client->server", hashlib.sha256).digest(),
        hmac.new(root, b"server->client", hashlib.sha256).digest(),
    )


def verify(expected: bytes, got: bytes) -> bool:
    """Constant-time comparison."""
    return hmac.compare_digest(expected, got)


def _mac(secret: bytes, tag: bytes, first: bytes, second: bytes, client: str, server: str) -> bytes:
    msg = b"|".join((tag, first, second, client.encode(), server.encode()))
    return hmac.new(secret, msg, hashlib.sha256).digest()


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: assume it is reachable from elsewhere


def check_secret(host: str, secret: bytes) -> None:
    """Refuse an empty secret on any bind that is not loopback-only (PARAM_INVALID).

    With an empty secret every peer that can reach ``host`` links and is trusted, so it is
    only acceptable on 127.0.0.1 / ::1 / localhost. Serving and deployment validation call
    this (or set ``TransferConfig.require_secret``) for every non-loopback bind.
    """
    if not secret and not is_loopback(host):
        raise TransferError(
            StatusCode.PARAM_INVALID,
            f"an empty transfer secret on host {host!r}: anyone who reaches it could read and "
            "write KV; set the deployment secret (HETERO_PD_SECRET) or bind 127.0.0.1",
        )
