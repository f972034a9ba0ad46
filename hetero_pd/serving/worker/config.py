"""A worker's configuration: its engine's and its transfer engine's configs as they are."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import msgspec

from hetero_pd.config import EngineConfig
from hetero_pd.engine.scheduler import Role
from transfer import FaultPlan, TransferConfig


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """One worker: its engine's and its transfer engine's configs as they are, plus where
    it listens. Serialised without a transfer secret (a worker's transfer engine links only
    under the pair keys the router sends it: `transfer_config`)."""

    worker_id: str
    role: Role
    engine: EngineConfig
    transfer: TransferConfig = field(default_factory=TransferConfig)
    host: str = "127.0.0.1"
    #: Fixed control port (Kubernetes: derived from kubernetes.base_port); 0 = any free port.
    port: int = 0
    #: The name peers reach this worker by when it binds 0.0.0.0 (its pod's DNS name).
    advertise_host: str = ""
    heartbeat_s: float = 0.5
    layerwise: bool = False  # push each layer's KV as soon as it is computed
    remote_kv_timeout_s: float = 60.0
    cpus: tuple[int, ...] = ()
    #: The file through which this host's unpinned workers share its CPUs, and this
    #: worker's slot in it (hetero_pd/deploy/cpu_board.py; "": none).
    cpu_board: str = ""
    cpu_board_slot: int = 0
    #: Touched on every heartbeat of the main loop (Kubernetes exec probes read its age).
    alive_file: str = ""
    #: The launcher's pid: a worker whose launcher is gone stops instead of living on.
    parent_pid: int = 0
    #: For tests and fault drills only: delays of its engine steps (the "step" rules of the
    #: deployment's transfer.faults; transfer/faults.py, step_faults.py).
    step_faults: FaultPlan | None = None

    def to_json(self) -> bytes:
        return msgspec.json.encode(replace(self, transfer=replace(self.transfer, secret=b"")))

    @classmethod
    def from_json(cls, data: bytes | str) -> WorkerConfig:
        return msgspec.json.decode(data, type=cls)


def transfer_config(cfg: WorkerConfig, fingerprint: str = "") -> TransferConfig:
    """The transfer engine's config as deployed: it links only with the peers whose pair
    key the router gave it (`per_peer_secrets`; PeerKeys), never under anything the
    worker's credential derives (every worker holds the same), the worker's advertised host
    for its link and data channel unless the transfer section names its own, and the
    model's fingerprint (weights + tokenizer: a worker of another model is refused at link
    time)."""
    t = cfg.transfer
    return replace(
        t,
        secret=b"",
        per_peer_secrets=True,
        require_secret=True,
        advertise_host=t.advertise_host or cfg.advertise_host,
        fingerprint=fingerprint or t.fingerprint,
    )
