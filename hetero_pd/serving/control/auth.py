"""Authentication of the control plane: CurveZMQ, with the router's key pair apart from the
workers', and each worker's apart from every other's.

    router (DEALER, CURVE client)  ──CurveZMQ handshake──>  worker W (ROUTER, CURVE server)
    RouterKeys: its own key pair,                            WorkerKeys: W's own key pair,
    W's public key (derived for W)                           the router's public key;
                                                             ZAP: client key == the router's?
                                                             else refused

The router's key pair derives from the deployment secret, which only the router holds (as
do the root of the workers' transfer pair keys, `RouterKeys.link_key`, handed to each worker
in `PeerKeys`, and the root of the workers' own keys); worker W's from its credential
(`hetero_pd.secrets.WorkerCredential`), which gives neither the router's key nor another
worker's. So a process with a worker's key material (a compromised worker) can complete the
router's handshake neither with another worker (it cannot be the router) nor in another
worker's place (the router expects that worker's key): it is never sent another worker's
pair keys. A peer without keys (a bare DEALER, a CURVE client with another key, a replayed
capture) never gets a frame to the worker's code; each such attempt is counted.
CurveZMQ also encrypts and authenticates every frame after the handshake, with per-message
nonces, so frames can be neither read, altered nor replayed on the wire.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Any

import zmq
from zmq.utils import monitor, z85

from hetero_pd.secrets import (
    WorkerCredential,
    curve_keypair,
    pair_key,
    pair_root,
    router_keypair,
    worker_public_key,
    workers_root,
)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
DOMAIN = b"hetero-pd"
#: Largest frame a control socket accepts; a bigger one drops the connection.
MAX_MESSAGE_SIZE = 64 * 2**20 + 4096
_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


@dataclass(frozen=True, slots=True)
class WorkerKeys:
    """A worker's control keys (Z85 text, as libzmq takes them): its own server key pair
    and the only client key it admits, the router's."""

    server_public: bytes
    server_secret: bytes
    router_public: bytes

    @classmethod
    def of(cls, credential: WorkerCredential) -> WorkerKeys:
        """The keys of the one worker `credential` is for (a worker's, not a group's)."""
        public, secret = curve_keypair(credential.key("control/worker"))
        return cls(public, secret, credential.router_public)

    @classmethod
    def from_secret(cls, secret: bytes, worker_id: str) -> WorkerKeys:
        return cls.of(WorkerCredential.for_worker(secret, worker_id))


@dataclass(frozen=True, slots=True)
class RouterKeys:
    """The router's control keys (its own key pair, the root every worker's public key
    derives from) and the root of the workers' transfer pair keys, which it hands out
    (`link_key`)."""

    client_public: bytes
    client_secret: bytes
    workers_root: bytes
    pair_root: bytes

    @classmethod
    def from_secret(cls, secret: bytes) -> RouterKeys:
        public, private = router_keypair(secret)
        return cls(public, private, workers_root(secret), pair_root(secret))

    def worker_public(self, worker_id: str) -> bytes:
        """The key worker `worker_id`'s control endpoint must prove (Z85)."""
        return worker_public_key(self.workers_root, worker_id)

    def link_key(self, worker: str, peer: str) -> bytes:
        """The key `worker`'s transfer engine links with `peer`'s under (and only it)."""
        return pair_key(self.pair_root, worker, peer)


def limit(sock: Any) -> None:
    """Bounds every control socket: no lingering, no frame above MAX_MESSAGE_SIZE."""
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_SIZE)


def secure_server(sock: Any, keys: WorkerKeys) -> None:
    limit(sock)
    sock.curve_server = True
    sock.curve_secretkey = keys.server_secret
    sock.zap_domain = DOMAIN


def secure_client(sock: Any, keys: RouterKeys, worker_id: str) -> None:
    """A CURVE client that completes a handshake only with worker `worker_id`."""
    limit(sock)
    sock.curve_serverkey = keys.worker_public(worker_id)
    sock.curve_publickey = keys.client_public
    sock.curve_secretkey = keys.client_secret


class Gatekeeper:
    """The server side's ZAP handler and handshake monitor, polled from the owner's loop.

    `rejected` counts peers refused: a wrong or missing key, another mechanism (a plain
    DEALER), a malformed handshake."""

    def __init__(self, ctx: Any, server: Any, keys: WorkerKeys) -> None:
        self._client_key = z85.decode(keys.router_public)
        self.zap = ctx.socket(zmq.REP)
        self.zap.setsockopt(zmq.LINGER, 0)
        self.zap.bind(ZAP_ENDPOINT)
        self.monitor = server.get_monitor_socket(_FAILED)
        self.rejected = 0

    def sockets(self) -> list[Any]:
        return [self.zap, self.monitor]

    def handle(self) -> None:
        """Answers pending ZAP requests and counts failed handshakes (non-blocking)."""
        while True:
            try:
                request = self.zap.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            self.zap.send_multipart(self._answer(request))
        while True:
            try:
                event = monitor.recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                break
            if event["event"] & _FAILED:
                self.rejected += 1

    def _answer(self, request: list[bytes]) -> list[bytes]:
        if len(request) < 6:
            return [b"1.0", b"", b"400", b"malformed ZAP request", b"", b""]
        version, request_id, domain, _address, _identity, mechanism = request[:6]
        key = request[6] if len(request) > 6 else b""
        ok = (
            mechanism == b"CURVE"
            and domain == DOMAIN
            and hmac.compare_digest(key, self._client_key)
        )
        status = (b"200", b"OK") if ok else (b"400", b"not a member of this deployment")
        return [version, request_id, *status, b"router" if ok else b"", b""]

    def close(self) -> None:
        self.zap.close()
        self.monitor.close()
