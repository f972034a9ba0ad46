"""KV bytes between hosts: each chunk sealed with AES-256-GCM under keys of its session.

::

    handshake (transfer.auth): secret + both nonces + both ids ──> c2s key, s2c key
    DATA frame body:  nonce 12 B | ciphertext of the chunk | tag 16 B
                      AAD: the frame's header (data channel) or its msgpack DATA message
                      (link), and the digest of the transfer's BEGIN (:func:`begin_digest`),
                      so a chunk cannot be moved to another place, block or transfer

A session is sealed when both ends agree (:func:`agree`): ``encrypt: auto`` seals links
between hosts and leaves peers on one host in clear (they use shared memory anyway);
``on`` always, ``off`` never, and one end's ``on`` against the other's ``off`` refuses the
link. Each direction has its own key and a counter for nonces, so a nonce is never used
twice under one key; a frame whose tag does not verify is dropped and counted
(``bad_mac``), and its chunk is resent like any chunk that did not arrive whole. The
receiver takes each nonce once (:class:`transfer.replay.Window`): a sealed chunk sent
again, byte for byte, is refused (``replay``). BEGIN, END and ACK carry block ids and
counts, not KV: they travel in clear with a MAC under the session's control keys
(:mod:`transfer.wire`), so one rewritten on the way is dropped.
"""

from __future__ import annotations

import hashlib
import itertools
import sys
import threading

import msgspec
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from transfer import wire
from transfer.messages import Begin
from transfer.replay import Window

NONCE_BYTES = 12
TAG_BYTES = 16
#: Bytes a sealed body has beyond its plaintext.
OVERHEAD = NONCE_BYTES + TAG_BYTES
POLICIES = ("auto", "on", "off")
_encoder = msgspec.msgpack.Encoder()
#: ``sys.getrefcount`` of a pooled buffer nothing else holds: the pool's list, the loop's
#: name for it and the call's argument.
_POOL_ONLY = 3


def begin_digest(begin: Begin) -> bytes:
    """What a chunk is sealed under besides its header: its BEGIN (which blocks it lands
    in), as each end holds it. BEGIN itself travels in clear; one rewritten on the way makes
    every chunk of it fail its tag, never land elsewhere."""
    return hashlib.sha256(_encoder.encode(begin)).digest()


def agree(mine: str, theirs: str, same_host: bool) -> bool:
    """Whether a session between ends with these ``encrypt`` policies is sealed; the same
    answer on both ends (one's "on" against the other's "off" never links:
    :func:`transfer.handshake.mismatch`)."""
    if "on" in (mine, theirs):
        return True
    return "off" not in (mine, theirs) and not same_host


#: Sealed bodies kept for reuse per session: a transfer's window of chunks in flight, and some.
POOL_BUFFERS = 8


class Sealer:
    """One session's keys: ``seal`` with ours, ``open_into`` with the peer's; both from any
    thread (AES-GCM releases the GIL: chunks are sealed ahead on the hashing threads)."""

    def __init__(self, send_key: bytes, receive_key: bytes) -> None:
        self._send, self._receive = AESGCM(send_key), AESGCM(receive_key)
        self._count = itertools.count(1)  # nonces: next() is atomic under the GIL
        self._opened = Window()  # the peer's nonces taken (a counter: transfer.replay)
        self._opening: set[int] = set()  # claimed, not taken yet (set ops are atomic)
        self._pool: list[bytearray] = []
        self._pool_lock = threading.Lock()

    def seal(self, aad: bytes, plaintext: bytes | memoryview) -> memoryview:
        """``plaintext`` sealed: a fresh nonce, the ciphertext and the tag, in a buffer of
        the session's pool (the view keeps it from reuse until every view of it is gone)."""
        nonce = next(self._count).to_bytes(NONCE_BYTES, "big")
        size = NONCE_BYTES + len(plaintext) + TAG_BYTES
        with self._pool_lock:  # taken and viewed at once: no other thread takes it too
            out = memoryview(self._buffer(size))[:size]
        out[:NONCE_BYTES] = nonce
        self._send.encrypt_into(nonce, plaintext, aad, out[NONCE_BYTES:])
        return out

    def _buffer(self, size: int) -> bytearray:
        """A pooled buffer of at least ``size`` bytes that nothing references any more: a
        fresh 4 MiB bytearray costs the kernel ~0.5 ms of page faults and zeroing, a third
        of sealing it. A buffer is free when only the pool holds it (a view of it queued on
        a socket, or held by ZMQ until sent, holds a reference)."""
        for i in range(len(self._pool)):  # no enumerate: its tuple would hold a reference
            buf = self._pool[i]
            if sys.getrefcount(buf) > _POOL_ONLY:
                continue  # still on its way out
            if len(buf) >= size:
                return buf
            if len(self._pool) >= POOL_BUFFERS:
                self._pool[i] = buf = bytearray(size)  # too small: a larger one instead
                return buf
        buf = bytearray(size)
        if len(self._pool) < POOL_BUFFERS:
            self._pool.append(buf)
        return buf

    def fresh(self, sealed: memoryview) -> bool:
        """Whether ``sealed``'s nonce was neither taken nor claimed yet (a replay is refused
        before the work of opening it)."""
        number = int.from_bytes(sealed[:NONCE_BYTES], "big")
        return number not in self._opening and self._opened.fresh(number)

    def claim(self, sealed: memoryview) -> None:
        """Marks ``sealed``'s nonce as being opened (on another thread): until
        :meth:`open_into` has taken it, a copy is not :meth:`fresh` either."""
        self._opening.add(int.from_bytes(sealed[:NONCE_BYTES], "big"))

    def open_into(self, aad: bytes, sealed: memoryview, out: memoryview) -> None:
        """Decrypts ``sealed`` into ``out`` (``len(sealed) - OVERHEAD`` bytes); a
        :class:`wire.FrameError`: "bad_mac" when it was not sealed by the peer for ``aad``,
        "replay" when its nonce was taken before (a frame sent again)."""
        if sealed.nbytes != out.nbytes + OVERHEAD:
            raise wire.FrameError("bad_mac", "sealed body of the wrong length")
        nonce = bytes(sealed[:NONCE_BYTES])
        number = int.from_bytes(nonce, "big")
        try:
            if not self._opened.fresh(number):
                raise wire.FrameError("replay", "a sealed chunk received before")
            try:
                self._receive.decrypt_into(nonce, sealed[NONCE_BYTES:], aad, out)
            except InvalidTag:
                raise wire.FrameError("bad_mac", "a sealed chunk failed its tag") from None
            if not self._opened.take(number):  # the same chunk opened twice at once
                raise wire.FrameError("replay", "a sealed chunk received before")
        finally:
            self._opening.discard(number)  # taken now, or refused

    def open(self, aad: bytes, sealed: memoryview) -> memoryview:
        """The plaintext of ``sealed`` (a new buffer); see :meth:`open_into`."""
        out = memoryview(bytearray(max(sealed.nbytes - OVERHEAD, 0)))
        self.open_into(aad, sealed, out)
        return out
