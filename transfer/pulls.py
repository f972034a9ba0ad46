"""Serving a peer's pull: validate the request, then push our blocks back as a transfer.

The puller (usually decode) reserved its destination blocks and names our source blocks;
we run an ordinary push for it (same ACK, retries, lease), whose handle surfaces in our
``progress()`` with ``kind == "serve_pull"``. Repeated pull requests for an id in flight are
ignored; a repeat after completion is answered as a duplicate by the puller's receiver.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from transfer import wire
from transfer.errors import StatusCode, TransferError
from transfer.handle import RemoteBlocks, TransferHandle
from transfer.movers import OutTransfer
from transfer.session import Session

if TYPE_CHECKING:
    from transfer.core import Core


def serve_pull(core: Core, session: Session, h: dict[str, Any]) -> None:
    """A peer asks us to push our blocks ``src`` into its reserved blocks."""
    xid = h["x"]
    if xid in core.sender.active:
        return  # the pull request was repeated; we are already serving it
    now = time.monotonic()
    try:
        region = core.regions.get(h["sreg"])
        if region is None:
            raise TransferError(StatusCode.KV_CACHE_NOT_EXIST, f"no region {h['sreg']!r}")
        src = wire.int_list(h["src"], "src")
        region.check_blocks(src, "source")
        lay = h["lay"] or [0, region.num_layers]
        if len(lay) != 2 or not all(type(v) is int for v in lay):
            raise TransferError(StatusCode.PARAM_INVALID, f"bad layer range {lay!r}")
        layers = (lay[0], lay[1])
        ntensors = len(region.tensor_range(layers))
        dst = RemoteBlocks(h["rid"], h["ep"], tuple(wire.int_list(h["dst"], "dst")), h["reg"])
    except (TransferError, wire.FrameError) as exc:
        err = (
            exc
            if isinstance(exc, TransferError)
            else TransferError(StatusCode.PARAM_INVALID, str(exc))
        )
        header = wire.encode("error", session.token, x=xid, code=err.code.number, msg=err.message)
        core.send(session, "error", header)
        return
    ttl = min(max(float(h["ttl"]), 0.0), core.config.lease_s)
    nbytes = len(src) * region.block_bytes * ntensors
    handle = TransferHandle(xid, "serve_pull", session.peer_id, dst.request_id, nbytes=nbytes)
    handle._cancel = core.sender.cancel
    ntok = h["ntok"] if h["ntok"] is not None else len(src) * region.block_size
    ot = OutTransfer(
        handle,
        region,
        torch.tensor(src, dtype=torch.long),
        dst,
        layers,
        ntok,
        None,
        None,
        now + ttl,
        now + ttl,
    )
    core.sender.start(ot)
