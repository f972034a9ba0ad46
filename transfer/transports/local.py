"""In-process transport: the peer engine lives in this process; copy device to device.

Engines publish their regions here by engine id (weakly: a closed engine disappears).
"""

from __future__ import annotations

import os
import weakref

import torch

from transfer.messages import RegionInfo
from transfer.region import KVRegion
from transfer.session import Session

NAME = "local"
SAME_HOST = True


class LocalEndpoint:
    """The regions one engine of this process exposes to its in-process peers."""

    def __init__(self, regions: dict[str, KVRegion]) -> None:
        self.regions = regions


_ENGINES: weakref.WeakValueDictionary[str, LocalEndpoint] = weakref.WeakValueDictionary()


def publish(engine_id: str, regions: dict[str, KVRegion]) -> LocalEndpoint:
    """Make ``regions`` reachable by in-process peers (keep the result alive meanwhile)."""
    endpoint = LocalEndpoint(regions)
    _ENGINES[engine_id] = endpoint
    return endpoint


def available(session: Session, src: KVRegion, desc: RegionInfo) -> bool:
    """True when the peer engine (and its region) is in this very process."""
    if session.pid != os.getpid():
        return False
    endpoint = _ENGINES.get(session.peer_id)
    return endpoint is not None and desc.name in endpoint.regions


def open_region(session: Session, desc: RegionInfo) -> list[torch.Tensor]:
    """The peer's region tensors themselves."""
    return _ENGINES[session.peer_id].regions[desc.name].tensors
