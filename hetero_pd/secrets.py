"""The deployment secret: one per deployment, the root of every key inside it.

The router's processes get it from the environment (`HETERO_PD_SECRET`), never from a
command line (argv is world-readable in /proc) nor a ConfigMap. On one box `hetero-pd serve`
generates a random one when none is set; on a cluster `hetero-pd render k8s` puts it in a
Secret. Workers never see it: each gets a worker credential (`HETERO_PD_WORKER_KEY`) for
itself alone, from which neither the router's key nor another worker's can be derived, so a
compromised worker can act neither as the router nor as another worker.

    secret ─┬─ "control/router" ─> the router's CURVE key pair       (router only)
            ├─ "transfer/pairs" ─> the pair root                      (router only)
            │     └─ "transfer/pair/<A>/<B>" ─> the link key of        (A and B only: the
            │          workers A and B (A < B)                          router sends it)
            └─ "workers" ─> the workers' root                         (router only)
                  └─ "group/<G>" ─> group G's material                 (Kubernetes: the pods
                        │                                               of StatefulSet G)
                        └─ "worker/<W>" ─> worker W's material         (one worker: W alone)
                              ├─ "control/worker" ─> W's CURVE key pair
                              └─ "kv-disk"        ─> MACs of W's SSD KV tier files

A worker's group is its id without the last "-<n>" (`prefill-0` and `prefill-1` are in
`prefill`). A credential (`WorkerCredential`) carries the material of one worker (what
`hetero-pd serve` and a bare-metal host give each worker process) or of one group (what a
Kubernetes StatefulSet's pods share, as they share one Secret key); a worker takes its own
material from it and refuses to start under an id the credential does not cover. The router
derives every worker's public key from the secret, so its CurveZMQ handshake with worker W
succeeds only against a process holding W's material (or W's group's): a process with
another worker's material that takes over W's address gets no frame, so none of W's
transfer pair keys. Each step is HMAC-SHA256 (`derive`), so a key of one purpose never
serves another and no key reveals the one it came from; lengths are part of each purpose, so
no two ids share a key.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets
import sys
from dataclasses import dataclass

import zmq
from zmq.utils import z85

from hetero_pd import envs

ENV = "HETERO_PD_SECRET"
WORKER_ENV = "HETERO_PD_WORKER_KEY"
#: Fewer bytes than this is not a secret anyone should rely on.
MIN_BYTES = 16
_CREDENTIAL_TAG = "hpdw2"
#: What a worker derives from its material. Transfer links are not among them: their keys
#: are per pair of workers (`pair_key`), from the router.
WORKER_PURPOSES = ("control/worker", "kv-disk")
#: Scopes of a credential: one worker's, or one group's (`group_of`).
WORKER_SCOPE, GROUP_SCOPE = "worker", "group"


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


def group_of(worker_id: str) -> str:
    """The group of `worker_id`: its id without a last "-<n>" (`decode-1` -> `decode`)."""
    head, dash, tail = worker_id.rpartition("-")
    return head if dash and head and tail.isdigit() else worker_id


def _labelled(kind: str, name: str) -> str:
    return f"{kind}/{len(name)}:{name}"


def workers_root(secret: bytes) -> bytes:
    """The root of every worker's material: only a holder of the deployment secret has it."""
    return derive(check(secret), "workers")


def group_material(root: bytes, group: str) -> bytes:
    """Group `group`'s material (`root`: `workers_root`)."""
    return derive(root, _labelled(GROUP_SCOPE, group))


def worker_material(group_key: bytes, worker_id: str) -> bytes:
    """Worker `worker_id`'s material from its group's (`group_material(.., group_of(id))`)."""
    return derive(group_key, _labelled(WORKER_SCOPE, worker_id))


def material_of(root: bytes, worker_id: str) -> bytes:
    """Worker `worker_id`'s material from the workers' root (`workers_root`), through its
    group's."""
    return worker_material(group_material(root, group_of(worker_id)), worker_id)


def worker_public_key(root: bytes, worker_id: str) -> bytes:
    """The CURVE public key worker `worker_id`'s control endpoint proves (Z85; `root`:
    `workers_root`)."""
    return curve_keypair(derive(material_of(root, worker_id), "control/worker"))[0]


@dataclass(frozen=True, slots=True)
class WorkerCredential:
    """What a worker holds: the material of one worker or one group (`scope`, `name`) and
    the router's public key (the one control client a worker admits)."""

    scope: str  # WORKER_SCOPE or GROUP_SCOPE
    name: str  # the worker's id, or the group's name
    material: bytes
    router_public: bytes  # Z85

    @classmethod
    def for_worker(cls, secret: bytes, worker_id: str) -> WorkerCredential:
        material = material_of(workers_root(secret), worker_id)
        return cls(WORKER_SCOPE, worker_id, material, router_keypair(secret)[0])

    @classmethod
    def for_group(cls, secret: bytes, group: str) -> WorkerCredential:
        material = group_material(workers_root(secret), group)
        return cls(GROUP_SCOPE, group, material, router_keypair(secret)[0])

    def covers(self, worker_id: str) -> bool:
        if self.scope == WORKER_SCOPE:
            return worker_id == self.name
        return group_of(worker_id) == self.name and worker_id != self.name

    def narrow(self, worker_id: str) -> WorkerCredential:
        """The credential of worker `worker_id` alone; raises SecretError when this one does
        not cover it."""
        if not self.covers(worker_id):
            raise SecretError(
                f"{WORKER_ENV} is {self.describe()}, not worker {worker_id!r}'s: a worker "
                "runs only under the id its credential was made for (`python -m "
                f"hetero_pd.secrets {worker_id}` prints its own from {ENV})"
            )
        if self.scope == WORKER_SCOPE:
            return self
        material = worker_material(self.material, worker_id)
        return WorkerCredential(WORKER_SCOPE, worker_id, material, self.router_public)

    def describe(self) -> str:
        if self.scope == WORKER_SCOPE:
            return f"worker {self.name!r}'s credential"
        return f"the credential of group {self.name!r} (workers {self.name}-<n>)"

    def key(self, purpose: str) -> bytes:
        """A key of this worker's: "control/worker" or "kv-disk" (a worker credential only:
        a group's is narrowed to one worker first)."""
        if purpose not in WORKER_PURPOSES:
            raise SecretError(f"no worker key for {purpose!r}: only {WORKER_PURPOSES}")
        if self.scope != WORKER_SCOPE:
            raise SecretError(f"{self.describe()} gives no key before it is narrowed to a worker")
        return derive(self.material, purpose)

    def text(self) -> str:
        """The form `HETERO_PD_WORKER_KEY` carries."""
        parts = (
            f"{self.scope}:{self.name}".encode(),
            self.material,
            z85.decode(self.router_public),
        )
        return ".".join([_CREDENTIAL_TAG, *(base64.urlsafe_b64encode(p).decode() for p in parts)])

    @classmethod
    def parse(cls, text: str) -> WorkerCredential:
        tag, _, rest = text.strip().partition(".")
        try:
            label, material, router = (base64.urlsafe_b64decode(p) for p in rest.split("."))
            scope, _, name = label.decode().partition(":")
        except (ValueError, binascii.Error):
            scope, name, material, router = "", "", b"", b""
        if tag == "hpdw1":
            raise SecretError(
                f"{WORKER_ENV} is a credential of an older release, which every worker shared: "
                f"each worker now has its own (`python -m hetero_pd.secrets WORKER_ID` prints "
                f"it from {ENV}; on Kubernetes render the Secret again)"
            )
        ok = scope in (WORKER_SCOPE, GROUP_SCOPE) and bool(name)
        if tag != _CREDENTIAL_TAG or not ok or len(material) != 32 or len(router) != 32:
            raise SecretError(
                f"{WORKER_ENV} is not a worker credential (`hetero-pd serve` and `hetero-pd "
                "render k8s` make them from the deployment secret)"
            )
        return cls(scope, name, material, z85.encode(router))


def parse_credentials(text: str) -> list[WorkerCredential]:
    """Credentials separated by commas (a host of several workers is given one each)."""
    return [WorkerCredential.parse(part) for part in text.split(",") if part.strip()]


def worker_credential_from_env(worker_id: str) -> WorkerCredential:
    """Worker `worker_id`'s credential from `HETERO_PD_WORKER_KEY` (the one entry there that
    covers it, narrowed to it); raises SecretError when absent or none covers it."""
    value = envs.worker_key()
    if not value:
        raise SecretError(
            f"{WORKER_ENV} is not set: a worker needs its credential (`hetero-pd serve` "
            "sets it for the workers it starts; on Kubernetes it comes from the Secret's "
            "worker-key-<group>)"
        )
    found = parse_credentials(value)
    for credential in found:
        if credential.covers(worker_id):
            return credential.narrow(worker_id)
    held = ", ".join(c.describe() for c in found) or "nothing"
    raise SecretError(
        f"{WORKER_ENV} holds {held}; none is worker {worker_id!r}'s (`python -m "
        f"hetero_pd.secrets {worker_id}` prints it from {ENV})"
    )


def worker_environment(
    environ: dict[str, str], secret: bytes, worker_ids: list[str]
) -> dict[str, str]:
    """`environ` for the process of workers `worker_ids`: their credentials in (one each),
    the deployment secret out."""
    env = {k: v for k, v in environ.items() if k != ENV}
    env[WORKER_ENV] = ",".join(WorkerCredential.for_worker(secret, w).text() for w in worker_ids)
    return env


def main(argv: list[str]) -> int:
    """`python -m hetero_pd.secrets NAME...`: credentials from $HETERO_PD_SECRET, one per
    NAME, comma-separated: a worker's id (`decode-0`) or a group with `--group`."""
    group = "--group" in argv
    names = [a for a in argv if a != "--group"]
    if not names:
        print(
            "usage: python -m hetero_pd.secrets [--group] NAME...  (the credentials of "
            "workers NAME, or of groups NAME with --group, from $HETERO_PD_SECRET)",
            file=sys.stderr,
        )
        return 2
    secret = from_env()
    make = WorkerCredential.for_group if group else WorkerCredential.for_worker
    print(",".join(make(secret, name).text() for name in names))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
