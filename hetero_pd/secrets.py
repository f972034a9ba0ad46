"""The deployment secret: one per deployment, the root of every key inside it.

Processes of a deployment get it from the environment (`HETERO_PD_SECRET`), never from a
command line (argv is world-readable in /proc) nor a ConfigMap. On one box `hetero-pd serve`
generates a random one when none is set and hands it to its workers by environment; on a
cluster `hetero-pd render k8s` puts it in a Secret.

Each use gets its own key, derived with HMAC-SHA256, so a key of one purpose never serves
another: `derive(secret, "control")` (router <-> worker control plane, CurveZMQ key pairs)
and `derive(secret, "transfer")` (transfer engine links).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets

ENV = "HETERO_PD_SECRET"
#: Fewer bytes than this is not a secret anyone should rely on.
MIN_BYTES = 16


class SecretError(ValueError):
    """No usable deployment secret."""


def generate() -> str:
    """A fresh random secret (256 bits, URL-safe text)."""
    return secrets.token_urlsafe(32)


def from_env(required: bool = True) -> bytes:
    """The deployment secret from `HETERO_PD_SECRET`; raises SecretError when it is missing
    (and `required`) or too short."""
    value = os.environ.get(ENV, "")
    if not value:
        if required:
            raise SecretError(
                f"{ENV} is not set: every process of a deployment needs the deployment "
                "secret (`hetero-pd serve` sets it for the workers it starts; on Kubernetes "
                "`hetero-pd render k8s` puts it in a Secret)"
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
