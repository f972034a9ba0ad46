"""Values carried inside control messages, the bounds every field is checked against, and
the error codes (see protocol.py for the messages themselves)."""

from __future__ import annotations

import enum
import sys
from array import array
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from hetero_pd.engine.spec.config import MAX_SPECULATIVE_TOKENS
from hetero_pd.serving.control.sampling import (
    MAX_TOKENS,
)
from transfer import RemoteBlocks, TransportMetrics

#: Largest control frame; a prompt's hidden states (edge) are the big ones.
MAX_FRAME_BYTES = 64 * 2**20

Rid = Annotated[str, Meta(min_length=1, max_length=256)]
Name = Annotated[str, Meta(max_length=256)]
Text = Annotated[str, Meta(max_length=16 * 2**20)]
Message = Annotated[str, Meta(max_length=16384)]
Count = Annotated[int, Meta(ge=0, le=2**63 - 1)]
#: The longest duration a worker reports (a step's cost): an hour.
MAX_SECONDS = 3600.0
Seconds = Annotated[float, Meta(ge=0.0, le=MAX_SECONDS)]
#: A number of a prompt's tokens.
PromptCount = Annotated[int, Meta(ge=0, le=MAX_TOKENS)]
Blob = Annotated[bytes, Meta(max_length=MAX_FRAME_BYTES)]
#: Most block hashes one heartbeat reports: bounds the router's index per worker.
MAX_REPORTED_BLOCKS = 16384


class MessageError(ValueError):
    """A frame that is not a valid control message."""


class ErrorCode(enum.IntEnum):
    """Why a worker refused or ended a request; the value is the wire number."""

    BAD_REQUEST = 1  # the request itself is invalid: fails the same anywhere
    NO_FREE_BLOCKS = 2  # decode cannot hold the prompt now: back off and ask again
    KV_FENCED = 3  # the previous attempt's blocks are still fenced: ask again shortly
    DRAINING = 4  # the worker is stopping or switching roles
    TRANSFER_FAILED = 5  # a KV transfer failed (`transfer_status` says how)
    REQUEST_FAILED = 6  # the engine could not run this request (the batch went on)
    UNKNOWN_REQUEST = 7  # no such request on the worker
    OVERLOADED = 8  # the worker's outbound queue to this router is full
    INTERNAL = 9  # a bug; the message names where

    @property
    def recoverable(self) -> bool:
        """Whether asking again (or elsewhere) may succeed."""
        return self in _RECOVERABLE


_RECOVERABLE = frozenset(
    {ErrorCode.NO_FREE_BLOCKS, ErrorCode.KV_FENCED, ErrorCode.DRAINING, ErrorCode.OVERLOADED}
)


class Value(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """A nested value of a message."""


class Envelope(Value, tag_field="t", frozen=True, kw_only=True):
    """A top-level message: a versioned, tagged map (protocol.py and migration.py)."""

    v: Literal[2] = 2


# -- values carried inside messages ------------------------------------------
class HiddenFrame(Value, kw_only=True, frozen=True):
    """A `hetero_pd.hidden_codec` frame: hidden states (or early-layer KV) of some tokens."""

    version: int
    dtype: Name
    shape: Annotated[list[Count], Meta(min_length=2, max_length=2)]
    scale: Blob
    data: Blob
    outliers: Count
    outlier_index: Blob
    outlier_value: Blob

    def as_dict(self) -> dict[str, Any]:
        return msgspec.structs.asdict(self)

    @classmethod
    def of(cls, frame: dict[str, Any]) -> HiddenFrame:
        return msgspec.convert(frame, cls)


class EdgePrompt(Value, kw_only=True, frozen=True):
    """A prompt from an edge device: layer `layer`'s input as hidden states; in
    "prompt only" mode also the KV of the device's layers [0, layer) (`early_kv`)."""

    hidden: HiddenFrame
    early_kv: HiddenFrame | None = None
    layer: Annotated[int, Meta(ge=0, lt=4096)] = 0


class WorkerInfo(Value, kw_only=True, frozen=True):
    """What a worker is (sent in Ready); all empty until it has answered."""

    address: Name = ""
    transfer_address: Name = ""
    model: Annotated[str, Meta(max_length=4096)] = ""
    device: Name = ""
    max_model_len: Count = 0
    block_size: Count = 0
    num_blocks: Count = 0
    pid: Count = 0
    start_layer: Count = 0
    hidden_size: Count = 0
    vocab_size: Count = 0
    fingerprint: Name = ""
    dtype: Name = ""  # what the engine computes in ("auto" resolved), and why
    dtype_reason: Name = ""


class TransportCounters(Value, kw_only=True, frozen=True):
    """One transport's counters of a worker's transfer engine (see transfer/README.md)."""

    bytes_sent_total: Count = 0
    bytes_received_total: Count = 0
    chunks_sent_total: Count = 0
    transfers_started_total: Count = 0
    transfers_done_total: Count = 0
    transfers_failed_total: Count = 0
    transfers_timed_out_total: Count = 0
    transfers_received_total: Count = 0
    retries_total: Count = 0
    checksum_failures_total: Count = 0
    lease_expiries_total: Count = 0
    duplicates_total: Count = 0
    stale_epoch_rejections_total: Count = 0

    @classmethod
    def of(cls, counters: TransportMetrics) -> TransportCounters:
        return cls(**{name: int(getattr(counters, name)) for name in cls.__struct_fields__})


class SpecDecodeCounts(Value, kw_only=True, frozen=True):
    """A worker's speculative decoding totals (vLLM's spec_decode counters)."""

    drafts: Count = 0
    draft_tokens: Count = 0
    accepted_tokens: Count = 0
    #: accepted proposals by their position in the run
    accepted_per_pos: Annotated[list[Count], Meta(max_length=MAX_SPECULATIVE_TOKENS)] = []


class WorkerLoad(Value, kw_only=True, frozen=True):
    """A worker's load, as its heartbeat reports it (the router's one view of it)."""

    waiting: Count = 0
    running: Count = 0
    remote: Count = 0  # decode: reservations waiting for KV
    held: Count = 0  # prefill: finished prompts whose KV is being handed off
    waiting_tokens: Count = 0
    kv_usage: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0
    free_blocks: Count = 0
    draining: bool = False
    kv_fallbacks: Count = 0
    #: Control frames refused (failed authentication or not a valid message).
    frames_rejected: Count = 0
    #: The transfer engine's I/O thread is alive.
    transfer_healthy: bool = True
    #: Transfer links refused so far (failed proofs, peer ids without a pair key).
    transfer_auth_failures: Count = 0
    #: Faults the transfer engine injected into its frames (tests and drills only).
    transfer_faults_injected: Count = 0
    #: The transfer engine's counters by transport (local, shm, tcp, ...).
    transfer: Annotated[dict[Name, TransportCounters], Meta(max_length=16)] = {}
    #: Prompt tokens this worker's engine computed (not served by its prefix cache), total.
    prompt_tokens_computed: Count = 0
    #: Seconds of a decode-only step and per prompt token of a step, lately (0.0: not seen
    #: yet; hetero_pd/engine/step_costs.py): what elastic prefill weighs against a TPOT target.
    decode_step_s: Seconds = 0.0
    prompt_token_s: Seconds = 0.0
    #: Prefix pulls from other workers: finished whole, their tokens, and failed ones
    #: (whose prompts were computed here instead).
    prefix_pulls: Count = 0
    prefix_pulled_tokens: Count = 0
    prefix_pull_failures: Count = 0
    #: None: the worker does not speculate.
    spec_decode: SpecDecodeCounts | None = None


class CachedBlocks(Value, kw_only=True, frozen=True):
    """The chained hashes (`hetero_pd.engine.kv_cache_manager.chain_hash`, 64-bit) of the
    full blocks in a worker's device prefix cache, most recently used first (at most
    MAX_REPORTED_BLOCKS), as of the pool's `version`; packed little-endian, 8 bytes each."""

    version: Count
    packed: Annotated[bytes, Meta(max_length=8 * MAX_REPORTED_BLOCKS)]

    def __post_init__(self) -> None:
        if len(self.packed) % 8:
            raise ValueError(f"packed block hashes are 8 bytes each, got {len(self.packed)}")

    @classmethod
    def of(cls, version: int, hashes: list[int]) -> CachedBlocks:
        packed = array("Q", hashes)
        if sys.byteorder != "little":
            packed.byteswap()
        return cls(version=version, packed=packed.tobytes())

    @property
    def hashes(self) -> list[int]:
        unpacked = array("Q")
        unpacked.frombytes(self.packed)
        if sys.byteorder != "little":
            unpacked.byteswap()
        return unpacked.tolist()


class PrefixSource(Value, kw_only=True, frozen=True):
    """Where the KV of a prompt's first `tokens` tokens (whole blocks) can be pulled from:
    worker `peer` (transfer engine at `address`) offered `blocks` to the receiving worker,
    which pulls them within `timeout_s` or computes them itself."""

    peer: Annotated[str, Meta(min_length=1, max_length=256)]
    address: Name
    blocks: RemoteBlocks
    tokens: PromptCount
    timeout_s: Annotated[float, Meta(gt=0.0, le=3600.0)] = 10.0


class TransferStats(Value, kw_only=True, frozen=True):
    bytes: Count = 0
    seconds: Annotated[float, Meta(ge=0.0)] = 0.0
    pushes: Count = 0
