"""The control protocol between the router and its workers: every message a declared type.

    router --(Hello | PeerKeys | Generate | Reserve | Prefill | Hidden | KvReady | KvFailed
              | Abort | Check | Shutdown | SwitchRole | OfferPrefix | Embed | MigrateIn
              | MigrateOut | MigrateResume | MigrateCancel)--> worker
    worker --(Ready | Heartbeat | Output | Reserved | KvFallback | PrefillDone | Error
              | Integrity | Bye | PrefixOffered | Embedded | MigrateReady | MigrateState | Migrated
              | MigrateFailed)--> router

(The Migrate* messages, a live migration's, are declared in migration.py.)

A frame is one msgpack map `{"v": 2, "t": <tag>, ...fields}`, decoded by `Codec` into
exactly one of these `msgspec.Struct`s: unknown fields, wrong types, out-of-range numbers,
over-long strings and lists are refused with a `MessageError` naming the field, before any
object is built from it, so a frame can never grow the receiver's memory past a bound of
its own size (no `Any`, no free-form maps). Never pickle.

A message that asks a worker to move KV with other workers (`named_peers`) follows a
`PeerKeys` naming them, on the same socket: the keys its transfer engine links with each of
them under, which only the router can make (hetero_pd/secrets.py).

Errors travel as an `ErrorCode` (a wire number; recoverable or not), with the transfer
engine's `StatusCode` number beside it when a KV transfer failed.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from hetero_pd.engine.scheduler import Role
from hetero_pd.serving.control import migration as M
from hetero_pd.serving.control.sampling import (
    MAX_EMBED_INPUTS,
    MAX_STOP_CHARS,
    Position,
    Positions,
    PromptPositions,
    TokenId,
    TokenIds,
    WireParams,
)
from hetero_pd.serving.control.values import (
    MAX_FRAME_BYTES,
    Blob,
    CachedBlocks,
    Count,
    EdgePrompt,
    Envelope,
    ErrorCode,
    HiddenFrame,
    Message,
    MessageError,
    Name,
    PrefixSource,
    PromptCount,
    Rid,
    Text,
    TransferStats,
    Value,
    WorkerInfo,
    WorkerLoad,
)
from transfer import RemoteBlocks

VERSION: Literal[2] = 2


_Msg = Envelope


#: Most peers one PeerKeys names (a message names at most two).
MAX_PEER_KEYS = 64


# -- router -> worker ------------------------------------------------------------------------
class Hello(_Msg, tag="hello", kw_only=True, frozen=True):
    pass


class PeerKey(Value, kw_only=True, frozen=True):
    peer: Annotated[str, Meta(min_length=1, max_length=256)]
    #: `RouterKeys.link_key(worker, peer)`: HMAC-SHA256 from a root only the router holds.
    key: Annotated[bytes, Meta(min_length=32, max_length=32)]


class PeerKeys(_Msg, tag="peer_keys", kw_only=True, frozen=True):
    """The keys this worker's transfer engine links with each `peer` under (and with no
    one else: a peer id it was never given is refused at link time), sent ahead of every
    message that names those peers (`named_peers`), so a restarted worker has them too."""

    keys: Annotated[list[PeerKey], Meta(min_length=1, max_length=MAX_PEER_KEYS)]


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
    dest_worker_id: Name
    dest_address: Name
    dest_blocks: RemoteBlocks
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


class Embed(_Msg, tag="embed", kw_only=True, frozen=True):
    """Embeddings of ``inputs``: one forward pass over them, no KV kept (/v1/embeddings)."""

    rid: Rid
    inputs: Annotated[list[TokenIds], Meta(min_length=1, max_length=MAX_EMBED_INPUTS)]


# -- worker -> router ------------------------------------------------------------------------
class Embedded(_Msg, tag="embedded", kw_only=True, frozen=True):
    """An ``Embed``'s vectors: ``len(inputs)`` rows of ``dim`` float32, little-endian."""

    rid: Rid
    dim: Annotated[int, Meta(ge=1, le=2**20)]
    vectors: Blob


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
    blocks: RemoteBlocks
    cached_tokens: PromptCount = 0


class PrefixOffered(_Msg, tag="prefix_offered", kw_only=True, frozen=True):
    """The answer to OfferPrefix: the offer's ticket for the prompt's first `tokens` tokens
    (whole blocks), or `blocks` None and 0 tokens when nothing is held or offered."""

    rid: Rid
    blocks: RemoteBlocks | None = None
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
    | PeerKeys
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
    | Embed
    | M.MigrateIn
    | M.MigrateResume
    | M.MigrateOut
    | M.MigrateCancel
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
    | Embedded
    | M.MigrateReady
    | M.MigrateState
    | M.Migrated
    | M.MigrateFailed
)
#: Messages that start a request on a worker.
RequestStart = Generate | Reserve | Prefill


def named_peers(msg: msgspec.Struct) -> list[str]:
    """The workers (transfer engine ids) `msg` asks its worker to move KV with, or to let
    move KV with it: the ones whose keys a PeerKeys ahead of it carries."""
    peers: list[str] = []
    match msg:
        case Reserve() | M.MigrateIn():
            peers.append(msg.writer)
        case Prefill() | M.MigrateOut():
            peers.append(msg.dest_worker_id)
        case OfferPrefix():
            peers.append(msg.reader)
    if isinstance(msg, Generate | Prefill) and msg.pull is not None:
        peers.append(msg.pull.peer)
    return list(dict.fromkeys(peers))


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
