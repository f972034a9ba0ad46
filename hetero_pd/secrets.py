"""The deployment secret: one per deployment, the root of every key inside it.

The router's processes get it from the environment (`HETERO_PD_SECRET`), never from a
command line (argv is world-readable in /proc) nor a ConfigMap. On one box `hetero-pd serve`
generates a random one when none is set; on a cluster `hetero-pd render k8s` puts it in a
Secret. Workers never see it: they get a worker credential (`HETERO_PD_WORKER_KEY`), from
which the router's key cannot be derived, so a compromised worker cannot act as the router.

    secret ─┬─ "control/router" ─> the router's CURVE key pair       (router only)
            ├─ "transfer/pairs" ─> the pair root                      (router only)
            │     └─ "transfer/pair/<A>/<B>" ─> the link key of        (A and B only: the
            │          workers A and B (A < B)                          router sends it)
            └─ "worker" ─> worker material                            (HETERO_PD_WORKER_KEY:
                  ├─ "control/worker" ─> the workers' CURVE key pair    every worker's, with
                  └─ "kv-disk"        ─> MACs of the SSD KV tier's files  the router's public key)

Each step is HMAC-SHA256 (`derive`), so a key of one purpose never serves another and no
key reveals the one it came from. Every worker holds the same worker material (on
Kubernetes all worker pods mount one Secret), so nothing that derives from it can tell
workers apart; a worker's transfer identity rests on the pair keys instead: the router
sends worker A the key of (A, B) over the CurveZMQ control channel before it asks A to
move KV with B (`PeerKeys`), and A's transfer engine links with B only under it. Holding
A's material and every key A was given, a process still cannot link as B to anyone.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets
from dataclasses import dataclass

import zmq
from zmq.utils import z85

from hetero_pd import envs

ENV = "HETERO_PD_SECRET"
WORKER_ENV = "HETERO_PD_WORKER_KEY"
#: Fewer bytes than this is not a secret anyone should rely on.
MIN_BYTES = 16
_CREDENTIAL_TAG = "hpdw1"
#: What a worker derives from its material. Transfer links are not among them: their keys
#: are per pair of workers (`pair_key`), from the router.
WORKER_PURPOSES = ("control/worker", "kv-disk")


class SecretError(ValueError):
    """No usable deployment secret or worker credential."""


def generate() -> str:
    """A fresh random secret (256 bits, URL-safe text)."""
    return secrets.token_urlsafe(32)


def from_env(required: bool = True) -> bytes:
    """The deployment secret from `HETERO_PD_SECRET`; raises SecretError when it is missing
    (and `required`) or too short."""
    value = envs.deployment_secret()
    if not value:
        if required:
            raise SecretError(
                f"{ENV} is not set: the router needs the deployment secret (`hetero-pd "
                "serve` makes one on a single box; on Kubernetes `hetero-pd render k8s` "
                "puts it in a Secret)"
            )
        return b""
    return check(value.encode())


def check(secret: bytes) -> bytes:
    if len(secret) < MIN_BYTES:
        raise SecretError(f"the deployment secret must be at least {MIN_BYTES} bytes")
    return secret


def derive(secret: bytes, purpose: str) -> bytes:
    """The 32-byte key for `purpose`, derived from the deployment secret."""
    return hmac.new(secret, b"hetero-pd/v1/" + purpose.encode(), hashlib.sha256).digest()


def curve_keypair(key: bytes) -> tuple[bytes, bytes]:
    """The CURVE key pair (public, secret; Z85 text as libzmq takes them) made from `key`."""
    if not zmq.has("curve"):
        raise RuntimeError("this libzmq has no CURVE support; the control plane needs it")
    secret = z85.encode(key)
    return zmq.curve_public(secret), secret


def pair_root(secret: bytes) -> bytes:
    """The root of the workers' pair keys: only a holder of the deployment secret has it."""
    return derive(check(secret), "transfer/pairs")


def pair_key(root: bytes, a: str, b: str) -> bytes:
    """The transfer link key of workers `a` and `b` (either order; `root`: `pair_root`).
    The first id's length is part of the purpose, so no two pairs of ids share a key."""
    lo, hi = sorted((a, b))
    return derive(root, f"transfer/pair/{len(lo)}:{lo}/{hi}")


def router_keypair(secret: bytes) -> tuple[bytes, bytes]:
    """The router's CURVE key pair: only a holder of the deployment secret has it."""
    return curve_keypair(derive(check(secret), "control/router"))


@dataclass(frozen=True, slots=True)
class WorkerCredential:
    """All a worker holds: its material (the root of the workers' own keys) and the router's
    public key (the one control client a worker admits)."""

    material: bytes
    router_public: bytes  # Z85

    @classmethod
    def of(cls, secret: bytes) -> WorkerCredential:
        return cls(derive(check(secret), "worker"), router_keypair(secret)[0])

    def key(self, purpose: str) -> bytes:
        """A worker key: "control/worker" or "kv-disk" (no other: every worker holds the
        same material, so a key from it can never say which worker holds it)."""
        if purpose not in WORKER_PURPOSES:
            raise SecretError(f"no worker key for {purpose!r}: only {WORKER_PURPOSES}")
        return derive(self.material, purpose)

    def text(self) -> str:
        """The form `HETERO_PD_WORKER_KEY` carries."""
        parts = (self.material, z85.decode(self.router_public))
        return ".".join([_CREDENTIAL_TAG, *(base64.urlsafe_b64encode(p).decode() for p in parts)])

    @classmethod
    def parse(cls, text: str) -> WorkerCredential:
        tag, _, rest = text.strip().partition(".")
        try:
            material, router = (base64.urlsafe_b64decode(p) for p in rest.split("."))
        except (ValueError, binascii.Error):
            material = router = b""
        if tag != _CREDENTIAL_TAG or len(material) != 32 or len(router) != 32:
            raise SecretError(
                f"{WORKER_ENV} is not a worker credential (`hetero-pd serve` and `hetero-pd "
                "render k8s` make one from the deployment secret)"
            )
        return cls(material, z85.encode(router))


def worker_credential_from_env() -> WorkerCredential:
    """A worker's credential from `HETERO_PD_WORKER_KEY`; raises SecretError when absent."""
    value = envs.worker_key()
    if not value:
        raise SecretError(
            f"{WORKER_ENV} is not set: a worker needs its credential (`hetero-pd serve` "
            "sets it for the workers it starts; on Kubernetes it comes from the Secret's "
            "worker-key)"
        )
    return WorkerCredential.parse(value)


def worker_environment(environ: dict[str, str], secret: bytes) -> dict[str, str]:
    """`environ` for a worker process: its credential in, the deployment secret out."""
    env = {k: v for k, v in environ.items() if k != ENV}
    env[WORKER_ENV] = WorkerCredential.of(secret).text()
    return env


if __name__ == "__main__":  # `python -m hetero_pd.secrets`: an operator's own Secret's worker-key
    print(WorkerCredential.of(from_env()).text())
