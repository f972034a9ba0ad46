"""KV transfer engine: move blocks of per-layer KV tensors between workers.

See ``transfer/README.md`` for the API, transports, state machine and error codes.
"""

from __future__ import annotations

from transfer.auth import check_secret
from transfer.config import RetryPolicy, Role, TransferConfig
from transfer.engine import TransferEngine
from transfer.errors import StatusCode, TransferError
from transfer.faults import FaultPlan, FaultRule
from transfer.handle import RemoteBlocks, TransferHandle, TransferState
from transfer.metrics import TransferHealth, TransferMetrics, TransportMetrics
from transfer.region import KVRegion

__all__ = [
    "FaultPlan",
    "FaultRule",
    "KVRegion",
    "RemoteBlocks",
    "RetryPolicy",
    "Role",
    "StatusCode",
    "TransferConfig",
    "TransferEngine",
    "TransferError",
    "TransferHandle",
    "TransferHealth",
    "TransferMetrics",
    "TransferState",
    "TransportMetrics",
    "check_secret",
]
