"""Mutual shared-secret authentication at link time (HMAC-SHA256 challenge/response).

::

    client (link)                                   server (listening engine)
      HELLO  {eid, nonce_c, regions}          ──>
                                              <──   CHALLENGE {eid, nonce_s,
                                                      proof_s = H(k, "S"|nonce_c|nonce_s|ids)}
      checks proof_s
      AUTH   {proof_c = H(k, "C"|nonce_s|nonce_c|ids)} ──>
                                              <──   WELCOME {token}   (or ERROR AUTH_FAILED)

Every later frame carries the session token, bound to the ZMQ connection it was issued on.
Neither side ever sends the secret. An empty secret still runs the exchange (so both sides
must agree on it) but offers no protection; use it on a trusted loopback only.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

NONCE_BYTES = 16


def new_nonce() -> bytes:
    """A fresh random nonce (also used for session tokens)."""
    return secrets.token_bytes(NONCE_BYTES)


def server_proof(secret: bytes, nonce_c: bytes, nonce_s: bytes, client: str, server: str) -> bytes:
    """What the listening side sends to prove it knows the secret."""
    return _mac(secret, b"S", nonce_c, nonce_s, client, server)


def client_proof(secret: bytes, nonce_c: bytes, nonce_s: bytes, client: str, server: str) -> bytes:
    """What the linking side sends to prove it knows the secret."""
    return _mac(secret, b"C", nonce_s, nonce_c, client, server)


def verify(expected: bytes, got: bytes) -> bool:
    """Constant-time comparison."""
    return hmac.compare_digest(expected, got)


def _mac(secret: bytes, tag: bytes, first: bytes, second: bytes, client: str, server: str) -> bytes:
    msg = b"|".join((tag, first, second, client.encode(), server.encode()))
    return hmac.new(secret, msg, hashlib.sha256).digest()
