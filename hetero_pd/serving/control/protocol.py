"""The control protocol between the router and its workers: every message a declared type.

    router --(Hello | Generate | Reserve | Prefill | Hidden | KvReady | KvFailed | Abort
              | Check | Shutdown | SwitchRole | OfferPrefix)--> worker
    worker --(Ready | Heartbeat | Output | Reserved | KvFallback | PrefillDone | Error
              | Integrity | Bye | PrefixOffered)--> router

A frame is one msgpack map `{"v": 2, "t": <tag>, ...fields}`, decoded by `Codec` into
exactly one of these `msgspec.Struct`s: unknown fields, wrong types, out-of-range numbers,
over-long strings and lists are refused with a `MessageError` naming the field, before any
object is built from it, so a frame can never grow the receiver's memory past a bound of
its own size (no `Any`, no free-form maps). Never pickle.

Errors travel as an `ErrorCode` (a wire number; recoverable or not), with the transfer
engine's `StatusCode` number beside it when a KV transfer failed.
"""

from __future__ import annotations

import enum
import sys
from array import array
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from hetero_pd.serving.control.sampling import (
    MAX_STOP_CHARS,
    MAX_TOKENS,
    Position,
    Positions,
    PromptPositions,
    TokenId,
    TokenIds,
    WireParams,
)

VERSION: Literal[2] = 2
#: Largest control frame; a prompt's hidden states (edge) are the big ones.
MAX_FRAME_BYTES = 64 * 2**20

Rid = Annotated[str, Meta(min_length=1, max_length=256)]
Name = Annotated[str, Meta(max_length=256)]
Text = Annotated[str, Meta(max_length=16 * 2**20)]
Message = Annotated[str, Meta(max_length=16384)]
Count = Annotated[int, Meta(ge=0, le=2**63 - 1)]
#: A number of a prompt's tokens.
PromptCount = Annotated[int, Meta(ge=0, le=MAX_TOKENS)]
Blob = Annotated[bytes, Meta(max_length=MAX_FRAME_BYTES)]
#: Most block hashes one heartbeat reports: bounds the router's index per worker.
MAX_REPORTED_BLOCKS = 16384
Role = Literal["prefill", "decode", "both"]


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


class _Struct(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """A nested value of a message."""


class _Msg(_Struct, tag_field="t", frozen=True, kw_only=True):
    """A top-level message: a versioned, tagged map."""

    v: Literal[2] = VERSION


# -- values carried inside messages ------------------------------------------
class HiddenFrame(_Struct, kw_only=True, frozen=True):
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


class EdgePrompt(_Struct, kw_only=True, frozen=True):
    """A prompt from an edge device: layer `layer`'s input as hidden states; in
    "prompt only" mode also the KV of the device's layers [0, layer) (`early_kv`)."""

    hidden: HiddenFrame
    early_kv: HiddenFrame | None = None
    layer: Annotated[int, Meta(ge=0, lt=4096)] = 0


class Blocks(_Struct, kw_only=True, frozen=True):
    """Reserved destination blocks (`transfer.RemoteBlocks` on the wire)."""

    rid: Rid
    ep: Count
    ids: Annotated[list[Annotated[int, Meta(ge=0, lt=2**31)]], Meta(max_length=MAX_TOKENS)]
    reg: Name


class WorkerInfo(_Struct, kw_only=True, frozen=True):
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


class TransportCounters(_Struct, kw_only=True, frozen=True):
    """One transport's counters of a worker's transfer engine (see transfer/README.md)."""

    bytes_sent_total: Count = 0
    bytes_received_total: Count = 0
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
    def of(cls, counters: dict[str, Any]) -> TransportCounters:
        return cls(**{name: int(counters.get(name, 0)) for name in cls.__struct_fields__})


class WorkerLoad(_Struct, kw_only=True, frozen=True):
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
    #: Faults the transfer engine injected into its frames (tests and drills only).
    transfer_faults_injected: Count = 0
    #: The transfer engine's counters by transport (local, shm, tcp, ...).
    transfer: Annotated[dict[Name, TransportCounters], Meta(max_length=16)] = {}
    #: Prompt tokens this worker's engine computed (not served by its prefix cache), total.
    prompt_tokens_computed: Count = 0
    #: Prefix pulls from other workers: finished whole, their tokens, and failed ones
    #: (whose prompts were computed here instead).
    prefix_pulls: Count = 0
    prefix_pulled_tokens: Count = 0
    prefix_pull_failures: Count = 0


class CachedBlocks(_Struct, kw_only=True, frozen=True):
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


class PrefixSource(_Struct, kw_only=True, frozen=True):
    """Where the KV of a prompt's first `tokens` tokens (whole blocks) can be pulled from:
    worker `peer` (transfer engine at `address`) offered `blocks` to the receiving worker,
    which pulls them within `timeout_s` or computes them itself."""

    peer: Annotated[str, Meta(min_length=1, max_length=256)]
    address: Name
    blocks: Blocks
    tokens: PromptCount
    timeout_s: Annotated[float, Meta(gt=0.0, le=3600.0)] = 10.0


class TransferStats(_Struct, kw_only=True, frozen=True):
    bytes: Count = 0
    seconds: Annotated[float, Meta(ge=0.0)] = 0.0
    pushes: Count = 0


# -- router -> worker ------------------------------------------------------------------------
class Hello(_Msg, tag="hello", kw_only=True, frozen=True):
    pass


class Generate(_Msg, tag="generate", kw_only=True, frozen=True):
    rid: Rid
    prompt_ids: TokenIds
    params: WireParams
    priority: Annotated[int, Meta(ge=-(2**31), lt=2**31)] = 0
    edge: EdgePrompt | None = None
    #: Pull the prompt's prefix KV from another worker before computing the rest.
    pull: PrefixSource | None = None


class Reserve(_Msg, tag="reserve", kw_only=True, frozen=True):
    rid: Rid
    prompt_ids: TokenIds
    params: WireParams
    priority: Annotated[int, Meta(ge=-(2**31), lt=2**31)] = 0
    edge: EdgePrompt | None = None
    #: The prefill worker (its transfer engine id) that alone may write the reserved blocks;
    #: the router picks it before it reserves. Any other peer is refused with NOT_GRANTED.
    writer: Annotated[str, Meta(min_length=1, max_length=256)]
    #: Serve the prompt's prefix from the decode worker's own prefix cache and reserve blocks
    #: for the rest only (the router asks when both workers' KV blocks are the same size).
    reuse_prefix: bool = False


class Prefill(_Msg, tag="prefill", kw_only=True, frozen=True):
    rid: Rid
    prompt_ids: TokenIds
    params: WireParams
    priority: Annotated[int, Meta(ge=-(2**31), lt=2**31)] = 0
    edge: EdgePrompt | None = None
    dest_worker: Name
    dest_address: Name
    dest_blocks: Blocks
    #: The first prompt tokens whose KV the decode worker already holds (Reserved's
    #: cached_tokens): computed here but not pushed. A multiple of the block size, below the
    #: prompt's length (checked by the worker).
    skip_tokens: PromptCount = 0
    #: Pull the prompt's prefix KV from another worker before computing the rest.
    pull: PrefixSource | None = None


class Hidden(_Msg, tag="hidden", kw_only=True, frozen=True):
    """Split (edge) decoding: layer k's input for the request's newest token."""

    rid: Rid
    frame: HiddenFrame


class KvReady(_Msg, tag="kv_ready", kw_only=True, frozen=True):
    """The prompt's KV landed; the prefill worker's first token (and, when the request asks
    for them, that token's logprobs and the prompt's) go on from here."""

    rid: Rid
    first_token: TokenId
    first_logprobs: Position | None = None
    prompt_logprobs: PromptPositions | None = None


class KvFailed(_Msg, tag="kv_failed", kw_only=True, frozen=True):
    rid: Rid


class Abort(_Msg, tag="abort", kw_only=True, frozen=True):
    rid: Rid


class OfferPrefix(_Msg, tag="offer_prefix", kw_only=True, frozen=True):
    """Offer worker `reader` the KV of the longest run of `prompt_ids`' first blocks this
    worker's prefix cache holds, pinned until pulled or `lease_s` passes (PrefixOffered)."""

    rid: Rid
    prompt_ids: TokenIds
    reader: Annotated[str, Meta(min_length=1, max_length=256)]
    lease_s: Annotated[float, Meta(gt=0.0, le=3600.0)]


class Check(_Msg, tag="check", kw_only=True, frozen=True):
    pass


class Shutdown(_Msg, tag="shutdown", kw_only=True, frozen=True):
    drain: bool = True


class SwitchRole(_Msg, tag="switch_role", kw_only=True, frozen=True):
    role: Literal["prefill", "decode"]


# -- worker -> router ------------------------------------------------------------------------
class Ready(_Msg, tag="ready", kw_only=True, frozen=True):
    worker: Name
    role: Role
    info: WorkerInfo


class Heartbeat(_Msg, tag="heartbeat", kw_only=True, frozen=True):
    worker: Name
    load: WorkerLoad
    #: The worker's prefix cache, when it changed (or now and then); None: as last reported.
    cached: CachedBlocks | None = None


class Output(_Msg, tag="output", kw_only=True, frozen=True):
    """New tokens of completion `index` (of the request's `n`). `seq` counts a request's
    outputs from 0, over all its completions: a gap means a frame was lost, and the router
    fails the request instead of answering short. `logprobs`: one position per token of
    `token_ids` when the request asks for them; `prompt_logprobs` once, on completion 0's
    first output."""

    rid: Rid
    seq: Count
    index: Annotated[int, Meta(ge=0, lt=2**31)] = 0
    text: Text
    token_ids: TokenIds
    logprobs: Positions | None = None
    prompt_logprobs: PromptPositions | None = None
    finish_reason: Name | None = None
    stop_reason: Annotated[str, Meta(max_length=MAX_STOP_CHARS)] | int | None = None
    prompt_tokens: Count = 0
    completion_tokens: Count = 0
    cached_tokens: Count = 0


class Reserved(_Msg, tag="reserved", kw_only=True, frozen=True):
    """`blocks` hold the prompt's KV from token `cached_tokens` on; the tokens before it
    are served by the decode worker's prefix cache (0 unless Reserve asked to reuse it)."""

    rid: Rid
    blocks: Blocks
    cached_tokens: PromptCount = 0


class PrefixOffered(_Msg, tag="prefix_offered", kw_only=True, frozen=True):
    """The answer to OfferPrefix: the offer's ticket for the prompt's first `tokens` tokens
    (whole blocks), or `blocks` None and 0 tokens when nothing is held or offered."""

    rid: Rid
    blocks: Blocks | None = None
    tokens: PromptCount = 0


class KvFallback(_Msg, tag="kv_fallback", kw_only=True, frozen=True):
    """The reserved KV did not arrive whole: the decode worker computes the prompt."""

    rid: Rid


class PrefillDone(_Msg, tag="prefill_done", kw_only=True, frozen=True):
    rid: Rid
    first_token: TokenId
    transfer: TransferStats
    first_logprobs: Position | None = None
    prompt_logprobs: PromptPositions | None = None


class Error(_Msg, tag="error", kw_only=True, frozen=True):
    rid: Annotated[str, Meta(max_length=256)]
    code: ErrorCode
    message: Message
    #: `transfer.StatusCode.number` when `code` is TRANSFER_FAILED.
    transfer_status: Count | None = None

    @property
    def recoverable(self) -> bool:
        if self.code is ErrorCode.TRANSFER_FAILED and self.transfer_status is not None:
            from transfer import StatusCode

            return StatusCode.from_number(self.transfer_status).recoverable
        return self.code.recoverable


class Integrity(_Msg, tag="integrity", kw_only=True, frozen=True):
    ok: bool
    used_blocks: int
    message: Message


class Bye(_Msg, tag="bye", kw_only=True, frozen=True):
    worker: Name


ToWorker = (
    Hello
    | Generate
    | Reserve
    | Prefill
    | Hidden
    | KvReady
    | KvFailed
    | Abort
    | Check
    | Shutdown
    | SwitchRole
    | OfferPrefix
)
ToRouter = (
    Ready
    | Heartbeat
    | Output
    | Reserved
    | KvFallback
    | PrefillDone
    | Error
    | Integrity
    | Bye
    | PrefixOffered
)
#: Messages that start a request on a worker.
RequestStart = Generate | Reserve | Prefill


class Codec:
    """Encodes messages; decodes frames of one direction with all the bounds above."""

    def __init__(self, accepts: Any, max_bytes: int = MAX_FRAME_BYTES) -> None:
        self._decoder = msgspec.msgpack.Decoder(accepts)
        self._encoder = msgspec.msgpack.Encoder()
        self.max_bytes = max_bytes

    def encode(self, msg: msgspec.Struct) -> bytes:
        return self._encoder.encode(msg)

    def decode(self, frame: bytes | memoryview) -> Any:
        """One message from one frame; raises MessageError naming what is wrong."""
        if len(frame) > self.max_bytes:
            raise MessageError(f"frame of {len(frame)} bytes exceeds {self.max_bytes}")
        try:
            return self._decoder.decode(frame)
        except msgspec.ValidationError as e:
            raise MessageError(f"invalid message: {e}") from None
        except msgspec.DecodeError as e:
            raise MessageError(f"not a msgpack message: {e}") from None


def worker_codec() -> Codec:
    """The worker's codec: decodes what routers send."""
    return Codec(ToWorker)


def router_codec() -> Codec:
    """The router's codec: decodes what workers send."""
    return Codec(ToRouter)
