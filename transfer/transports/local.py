"""In-process transport: the peer engine lives in this process; copy device to device."""

from __future__ import annotations

import os
from typing import Any

import torch

from transfer.session import Session


def available(session: Session, desc: dict[str, Any]) -> bool:
    """True when the peer engine (and its region) is in this very process."""
    from transfer.core import LOCAL_ENGINES

    if session.pid != os.getpid():
        return False
    core = LOCAL_ENGINES.get(session.peer_id)
    return core is not None and desc["name"] in core.regions


def open_region(session: Session, desc: dict[str, Any]) -> list[torch.Tensor]:
    """The peer's region tensors themselves."""
    from transfer.core import LOCAL_ENGINES

    core = LOCAL_ENGINES[session.peer_id]
    return core.regions[desc["name"]].tensors
