"""How the ranks of a tensor-parallel engine find each other, and why no other process can
take a rank's place.

::

    rank 0                                   rank r (its child)
    secret = 32 random bytes  ---- stdin --> (never argv, never the environment)
    FileStore in a fresh 0700 folder <-----> joined/<r>, gloo's addresses (no TCP store port)
    gloo pairs on 127.0.0.1 only  <--------> (GLOO_SOCKET_IFNAME = loopback)
    prove: nonce (broadcast) ------------->  each rank sends each peer, over their own pair,
           all_to_all of tags <----------->  HMAC(secret, nonce | from | to); a wrong tag
                                             stops the group, naming the rank

torch's TCPStore would listen on every interface (whatever host it is given) and answers
anyone who connects, listing and rewriting every key (gloo's addresses among them); a file
store in a folder only this user can enter offers no port at all. The proof runs over each
group's own connections, so a process that won a race to one of gloo's listening sockets
cannot pass for the rank it displaced.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
import shutil
import struct
import sys
import tempfile
from collections.abc import Iterator

import torch
import torch.distributed as dist

SECRET_BYTES = 32
_TAG = hashlib.sha256().digest_size
#: gloo binds the interface named here: loopback, never the host's outward address.
LOOPBACK = "lo0" if sys.platform == "darwin" else "lo"
LOOPBACK_ENV = {"GLOO_SOCKET_IFNAME": LOOPBACK}


def new_secret() -> bytes:
    """A fresh secret for one group's life."""
    return secrets.token_bytes(SECRET_BYTES)


def private_folder() -> str:
    """A new folder only this user may enter (mode 0700), for the group's file store."""
    return tempfile.mkdtemp(prefix="hetero-pd-tp-")


def remove_folder(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def open_store(folder: str, world: int) -> dist.FileStore:
    """The group's store: a file in `folder` (from private_folder), shared by `world` ranks."""
    return dist.FileStore(os.path.join(folder, "store"), world)


@contextlib.contextmanager
def loopback_gloo() -> Iterator[None]:
    """gloo groups created inside listen and connect on loopback only."""
    saved = {k: os.environ.get(k) for k in LOOPBACK_ENV}
    os.environ.update(LOOPBACK_ENV)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _tag(secret: bytes, nonce: bytes, sender: int, receiver: int) -> bytes:
    msg = b"hetero-pd tp rank" + nonce + struct.pack("<II", sender, receiver)
    return hmac.new(secret, msg, hashlib.sha256).digest()


def prove(
    secret: bytes, rank: int, world: int, group: dist.ProcessGroup | None, device: torch.device
) -> list[int]:
    """Every rank of `group` proves `secret` to every other over their own connection;
    returns the ranks whose proof to this one failed (empty: all proved it). Each rank
    checks for itself, so a rank never trusts another's verdict."""
    nonce = torch.empty(SECRET_BYTES, dtype=torch.uint8, device=device)
    if rank == 0:
        nonce.copy_(
            torch.frombuffer(bytearray(secrets.token_bytes(SECRET_BYTES)), dtype=torch.uint8)
        )
    dist.broadcast(nonce, 0, group=group)
    drawn = bytes(nonce.cpu().tolist())
    mine = b"".join(_tag(secret, drawn, rank, peer) for peer in range(world))
    sent = torch.frombuffer(bytearray(mine), dtype=torch.uint8).to(device)
    got = torch.empty(world * _TAG, dtype=torch.uint8, device=device)
    dist.all_to_all_single(got, sent, group=group)
    received = bytes(got.cpu().tolist())
    return [
        peer
        for peer in range(world)
        if peer != rank
        and not hmac.compare_digest(
            received[peer * _TAG : (peer + 1) * _TAG], _tag(secret, drawn, peer, rank)
        )
    ]


def refusal(failed: list[int], rank: int) -> str:
    """The error for ranks whose proof failed at `rank`."""
    who = ", ".join(f"rank {r}" for r in failed)
    return (
        f"tensor-parallel {who} did not prove the group's secret to rank {rank}: a process "
        "other than the rank this engine started holds its place, so the group is refused"
    )
