"""Typed configuration of a transfer engine (one frozen object per engine)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields

from transfer import envs
from transfer.addresses import valid_host
from transfer.faults import FaultPlan
from transfer.kv_codec import check_codec

#: Frames one connection may have waiting on our sockets (the listening ROUTER, each link we
#: dial) before ZMQ stops reading it: TCP then pushes back on the sender, and no frame is
#: lost, so a peer that floods while the I/O thread is busy piles nothing up here.
RECEIVE_HWM = 64


class Role(enum.Enum):
    """What a worker does; informational (either role may push or pull)."""

    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"  # colocated: prefill and decode in one worker


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Bounded exponential backoff: delay ``min(base * 2**attempt, max)``, ``attempts`` tries."""

    attempts: int = 5
    base_delay_s: float = 0.01
    max_delay_s: float = 0.5

    def delay(self, attempt: int) -> float:
        """Backoff before retry number ``attempt`` (1-based)."""
        return float(min(self.base_delay_s * (2 ** max(attempt - 1, 0)), self.max_delay_s))


@dataclass(frozen=True, slots=True)
class TransferConfig:
    """Settings of one :class:`~transfer.engine.TransferEngine`.

    Deadlines are in seconds. ``secret`` is the secret every peer shares: peers prove they
    know it when linking (HMAC challenge both ways); an empty secret disables the check and
    must only be used on a trusted loopback. With ``per_peer_secrets`` each peer proves
    instead the secret given for its own id (:meth:`TransferEngine.trust
    <transfer.engine.TransferEngine.trust>`), and ``secret`` must be empty.
    """

    host: str = "127.0.0.1"
    port: int = 0
    #: The host name or address peers reach this engine by, advertised for both the link
    #: and the data channel (a pod's DNS name when ``host`` is 0.0.0.0). Empty: ``host``;
    #: when that is a wildcard, peers use the host they dialled to reach our link.
    advertise_host: str = ""
    secret: bytes = b""
    #: Link only with peers whose own secret this engine was given (``TransferEngine.trust``,
    #: by engine id: the serving layer's pair keys, handed out by the router), each proven
    #: under its own; any other id is refused at its HELLO (AUTH_FAILED, counted
    #: ``unknown_peer``), so a process holding one peer's secret cannot link as another.
    per_peer_secrets: bool = False
    #: What makes this engine's KV interchangeable with a peer's (opaque; the serving layer
    #: puts in its model's weights + tokenizer fingerprint). Exchanged after authentication:
    #: a link between two engines that both set one and differ is refused (PARAM_INVALID,
    #: naming both). Empty: not checked.
    fingerprint: str = ""
    #: Deadline of one link handshake.
    link_timeout_s: float = 5.0
    #: Default deadline of a whole transfer, all retries included (LLM-DataDist sync_kv_timeout).
    timeout_s: float = 30.0
    #: How long the sender holds its source blocks waiting for the ACK.
    lease_s: float = 60.0
    #: How long one attempt waits for the peer's answer before re-linking and retrying.
    ack_timeout_s: float = 5.0
    #: Longest a direct (shared-memory) write grant stays valid.
    grant_s: float = 10.0
    #: A peer's renewals keep one of our reservations or offers alive at most this long past
    #: its making, so a peer that renews for ever cannot pin our blocks.
    max_renewed_s: float = 600.0
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    #: Stream (TCP) chunks travel on a plain TCP data channel read straight into the
    #: destination blocks (False: as ZMQ frames on the link, one more copy on the receiver).
    data_channel: bool = True
    #: Port of the data listener (0: any free port); advertised to peers when linking.
    data_port: int = 0
    #: KV chunks on the stream (TCP) wire sealed with AES-256-GCM (:mod:`transfer.aead`):
    #: "auto" between hosts, "on" always, "off" never (both ends must allow what they agree).
    encrypt: str = "auto"
    #: Target payload bytes per data frame over TCP.
    chunk_bytes: int = 4 << 20
    #: Largest frame accepted from the network; larger ones are rejected and counted.
    max_frame_bytes: int = 64 << 20
    #: Checksums per chunk on every transport, verified by the receiver before it commits.
    checksum: bool = True
    #: Per-kind overrides of ``checksum`` (None: follow it): stream (TCP) and direct writes
    #: (local, shm).
    checksum_stream: bool | None = None
    checksum_direct: bool | None = None
    #: Checksum algorithm: "xxh3", "crc32" or "auto" (xxh3).
    checksum_algo: str = "auto"
    #: How KV travels on the stream (TCP) wire: "none" (raw) or "int8" (a scale per token and
    #: head; :mod:`transfer.kv_codec`). Direct writes (local, shm) always move raw KV. As a
    #: receiver this engine accepts "none" and its own codec, and refuses any other.
    kv_codec: str = "none"
    #: Transports this engine may choose from, best first.
    transports: tuple[str, ...] = ("local", "cuda_ipc", "shm", "tcp")
    #: Committed transfer ids remembered for duplicate detection.
    dedup_capacity: int = 65536
    #: Faults injected into this engine's outgoing frames (tests only).
    faults: FaultPlan | None = None
    #: The engine refuses to start with an empty ``secret`` unless ``host`` is loopback-only
    #: (:func:`transfer.auth.check_secret`; checked by ``TransferEngine``, not here, so a
    #: config serialised without its secret still loads). Met by ``per_peer_secrets``.
    require_secret: bool = False

    def checksums_on(self, direct: bool) -> bool:
        """Whether transfers of this kind carry checksums by default."""
        override = self.checksum_direct if direct else self.checksum_stream
        return self.checksum if override is None else override

    def __post_init__(self) -> None:
        if self.chunk_bytes <= 0 or self.max_frame_bytes < self.chunk_bytes:
            raise ValueError("TransferConfig: need 0 < chunk_bytes <= max_frame_bytes")
        if self.encrypt not in ("auto", "on", "off"):
            raise ValueError(
                f"TransferConfig.encrypt must be auto, on or off, got {self.encrypt!r}"
            )
        for name in ("link_timeout_s", "timeout_s", "lease_s", "ack_timeout_s", "max_renewed_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"TransferConfig.{name} must be > 0")
        if self.advertise_host and not valid_host(self.advertise_host):
            raise ValueError(
                f"TransferConfig.advertise_host {self.advertise_host!r}: a host name or "
                "address without a port"
            )
        if self.per_peer_secrets and self.secret:
            raise ValueError(
                "TransferConfig: per_peer_secrets takes each peer's secret from "
                "TransferEngine.trust; leave secret empty"
            )
        check_codec(self.kv_codec, "TransferConfig.kv_codec")
        unknown = set(self.transports) - {"local", "cuda_ipc", "shm", "tcp"}
        if unknown:
            raise ValueError(f"TransferConfig.transports: unknown transport(s) {sorted(unknown)}")

    @classmethod
    def from_env(cls, **overrides: object) -> TransferConfig:
        """Build a config from ``HETERO_PD_TRANSFER_*`` environment variables plus overrides.

        Reads ``HETERO_PD_TRANSFER_SECRET`` (the shared secret),
        ``HETERO_PD_TRANSFER_HOST`` and ``HETERO_PD_TRANSFER_ADVERTISE_HOST``; other settings
        come from ``overrides``.
        """
        names = {f.name for f in fields(cls)}
        bad = set(overrides) - names
        if bad:
            raise ValueError(f"TransferConfig: unknown key(s) {sorted(bad)}")
        values = envs.transfer_settings()
        values.update(overrides)
        return cls(**values)  # type: ignore[arg-type]
