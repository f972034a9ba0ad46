"""The transfer plane's messages: one tagged, bounded ``msgspec.Struct`` per frame type.

A frame header is a :class:`Header` ``{"v": VERSION, "sid": token, "m": message, "n":
number}`` whose ``m`` is exactly one of the messages below, told apart by its tag ``t``
(``n``: :mod:`transfer.replay`). The decoder (:mod:`transfer.wire`) checks every type, bound
and length in C before any code reads a field: unknown fields, wrong types (a bool is never
an int), negative block ids, over-long strings and lists are refused as frames, never seen
by a handler. What needs context to check (a region exists, block ids are in range, a chunk
is where the plan puts it) is checked by the handlers, which can answer the peer with a
status code.

Python names are long; the names on the wire stay as short as they always were::

    link  ──HELLO {eid, role, nonce}──>          (see transfer.auth for the exchange)
          <─CHALLENGE {eid, role, nonce, proof}─
          ──AUTH {proof, about}──>  <─WELCOME {token, about}─  (or ERROR)
    push  ──BEGIN──>  <─GRANT (direct)─  ──DATA* / LANDED*──>  ──END──>  <─ACK / ERROR─
    pull  ──PULL──>   (then a push the other way)        renew ──RENEW──>
    any   REGIONS (a region registered later), PING, BYE
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta, field

from transfer.errors import StatusCode, TransferError

VERSION: Literal[6] = 6

#: Engine ids and region names.
Name = Annotated[str, Meta(max_length=256)]
#: Request ids and transfer ids (a transfer id embeds an engine id and a request id).
Key = Annotated[str, Meta(max_length=1024)]
#: Error texts.
MAX_TEXT = 4096
Text = Annotated[str, Meta(max_length=MAX_TEXT)]
#: dtype, device, checksum, codec and layout names.
Word = Annotated[str, Meta(max_length=32)]
#: Nonces, proofs and session tokens (16 or 32 bytes).
Secret = Annotated[bytes, Meta(max_length=64)]
#: Block ids, block and chunk counts, chunk numbers, shape sizes, layer numbers.
Index = Annotated[int, Meta(ge=0, lt=2**31)]
#: Epochs (``counter << 31 | random31``) and grant numbers.
Epoch = Annotated[int, Meta(ge=0, le=2**63 - 1)]
#: A checksum value: up to 64 bits (msgpack integers stop below 2**64).
Digest = Annotated[int, Meta(ge=0)]
#: Seconds: a grant's length or a pull's deadline (never NaN or infinite).
Seconds = Annotated[float, Meta(ge=0.0, le=1e6)]
#: A point on the receiver's monotonic clock (direct writers share its host).
Instant = Annotated[float, Meta(ge=0.0, le=1e12)]
#: Most block ids (or chunk numbers, or digests) in one list.
MAX_LIST = 1 << 20
#: Block ids or chunk numbers.
Indices = Annotated[list[Index], Meta(max_length=MAX_LIST)]
Digests = Annotated[list[Digest], Meta(max_length=MAX_LIST)]
#: A block's shape ``[block_size, *inner]``: 1 to 8 dimensions.
Shape = Annotated[list[Index], Meta(min_length=1, max_length=8)]
#: Most regions one engine describes.
MAX_REGIONS = 64
Transport = Literal["tcp", "local", "shm", "cuda_ipc"]
#: Mirrors :data:`transfer.kv_layouts.LAYOUTS` (a test keeps them equal).
Layout = Literal["nd", "fractal_nz"]
RoleName = Literal["prefill", "decode", "both"]


class _Struct(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """A value inside a message."""


class Message(_Struct, tag_field="t", frozen=True, kw_only=True):
    """A transfer-plane message (its tag is its frame type)."""


class RegionInfo(_Struct, frozen=True, kw_only=True):
    """A region as peers see it (:meth:`KVRegion.describe`); never a file path."""

    name: Name
    num_layers: Annotated[int, Meta(ge=1, lt=2**31)] = field(name="nl")
    tensors_per_layer: Annotated[int, Meta(ge=1, lt=2**31)] = field(name="tpl")
    num_blocks: Annotated[int, Meta(ge=1, lt=2**31)] = field(name="nb")
    #: One block's shape ``[block_size, *inner]``.
    block_shape: Shape = field(name="shape")
    dtype: Word = field(name="dt")
    device: Word = field(name="dev")
    #: The random part of its /dev/shm directory (None: not in shared memory).
    shm: Annotated[str, Meta(max_length=64)] | None = None
    layout: Layout = field(name="fmt")


RegionList = Annotated[list[RegionInfo], Meta(max_length=MAX_REGIONS)]


class About(_Struct, frozen=True, kw_only=True):
    """What an authenticated peer learns about an engine (AUTH, WELCOME)."""

    host: Annotated[str, Meta(max_length=1024)]
    pid: Annotated[int, Meta(ge=0, lt=2**31)]
    #: Its data listener ``host:port`` ("" without one); :func:`wire.data_address` parses it.
    data_address: Annotated[str, Meta(max_length=1024)] = field(name="da")
    regions: RegionList
    #: KV fingerprint; :func:`wire.fingerprint` checks its characters (and answers).
    fingerprint: Annotated[str, Meta(max_length=1024)] = field(name="fp")
    #: Its ``TransferConfig.encrypt`` policy (:func:`transfer.aead.agree`).
    encrypt: Literal["auto", "on", "off"] = field(name="enc", default="auto")


class RemoteBlocks(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Destination blocks reserved by a receiver, as the sender must name them.

    A decode worker gets this from :meth:`TransferEngine.reserve` and hands it (through the
    router or the control plane, which carry this very type) to the prefill worker, which
    passes it to ``push_blocks``. The receiver refuses any write whose ``epoch`` is not the
    blocks' current one.
    """

    request_id: Annotated[str, Meta(min_length=1, max_length=1024)] = field(name="rid")
    epoch: Epoch = field(name="ep")
    block_ids: Annotated[tuple[Index, ...], Meta(max_length=MAX_LIST)] = field(name="ids")
    region: Name = field(name="reg", default="kv")

    def to_wire(self) -> dict[str, object]:
        """Plain values (msgpack / JSON friendly), under the wire's short names."""
        out: dict[str, object] = msgspec.to_builtins(self)
        return out

    @classmethod
    def from_wire(cls, obj: object) -> RemoteBlocks:
        """Inverse of :meth:`to_wire`, checking every type and bound."""
        try:
            return msgspec.convert(obj, cls)
        except msgspec.ValidationError as e:
            raise TransferError(StatusCode.PARAM_INVALID, f"bad RemoteBlocks: {e}") from None


# ---- handshake (before authentication nothing but ids and nonces) ---------------------
class Hello(Message, tag="hello", frozen=True, kw_only=True):
    """Who links, and its nonce."""

    engine_id: Name = field(name="eid")
    role: RoleName
    nonce: Secret


class Challenge(Message, tag="challenge", frozen=True, kw_only=True):
    """Who listens, its nonce, and its proof of the secret."""

    engine_id: Name = field(name="eid")
    role: RoleName
    nonce: Secret
    proof: Secret


class Auth(Message, tag="auth", frozen=True, kw_only=True):
    """The linking side's proof, then (only now) what it is."""

    proof: Secret
    about: About


class Welcome(Message, tag="welcome", frozen=True, kw_only=True):
    """The session token, and what the listening side is."""

    token: Secret
    about: About


class Regions(Message, tag="regions", frozen=True, kw_only=True):
    """Our regions again (one was registered after the link)."""

    regions: RegionList


class Bye(Message, tag="bye", frozen=True, kw_only=True):
    """The session ends."""


class Ping(Message, tag="ping", frozen=True, kw_only=True):
    """Proves the session is known (a restarted peer answers NOT_LINKED)."""


# ---- transfers ------------------------------------------------------------------------
class Begin(Message, tag="begin", frozen=True, kw_only=True):
    """A push's plan: what is sent, from which layout, into which reservation."""

    transfer_id: Key = field(name="x")
    request_id: Key = field(name="rid")
    epoch: Epoch = field(name="ep")
    region: Name = field(name="reg")
    dst: Indices
    num_src: Index = field(name="nsrc")
    dtype: Word = field(name="dt")
    block_size: Index = field(name="bs")
    tensors_per_layer: Index = field(name="tpl")
    block_shape: Shape = field(name="shape")
    layers: tuple[Index, Index] = field(name="lay")
    num_tokens: Index = field(name="ntok")
    num_chunks: Index = field(name="nf")
    blocks_per_chunk: Index = field(name="bpc")
    checksum: Word | None = field(name="ck")
    mode: Transport
    codec: Word = field(name="kc")
    layout: Word = field(name="fmt")


class Grant(Message, tag="grant", frozen=True, kw_only=True):
    """A direct writer may write until ``until`` (at most ``ttl`` from now), as grant ``g``."""

    transfer_id: Key = field(name="x")
    ttl: Seconds
    until: Instant
    grant: Epoch = field(name="g")


class Renew(Message, tag="renew", frozen=True, kw_only=True):
    """Keep the reservation (we write) or offer (we read) ``(rid, ep)`` alive."""

    request_id: Key = field(name="rid")
    epoch: Epoch = field(name="ep")


class Data(Message, tag="data", frozen=True, kw_only=True):
    """One chunk (the frame's payload): blocks ``[lo, hi)`` of tensor ``ti``."""

    transfer_id: Key = field(name="x")
    seq: Index = field(name="s")
    tensor: Index = field(name="ti")
    lo: Index
    hi: Index
    digest: Digest | None = field(name="d")


class Landed(Message, tag="landed", frozen=True, kw_only=True):
    """Direct-write chunks in place, with their digests (``wv``: the writer verified them)."""

    transfer_id: Key = field(name="x")
    seqs: Indices = field(name="s")
    digests: Digests = field(name="ds")
    writer_verified: bool = field(name="wv")
    grant: Epoch = field(name="g")


class End(Message, tag="end", frozen=True, kw_only=True):
    """Every chunk sent (direct writes: with every chunk's digest)."""

    transfer_id: Key = field(name="x")
    num_chunks: Index = field(name="nf")
    digests: Digests | None = field(name="ds")


class Ack(Message, tag="ack", frozen=True, kw_only=True):
    """The outcome of a transfer; ``bad``: chunks to send again."""

    transfer_id: Key = field(name="x")
    code: Annotated[int, Meta(ge=0, lt=2**16)]
    text: Text = field(name="msg")
    bad: Indices
    duplicate: bool = field(name="dup")

    @property
    def status(self) -> StatusCode:
        return StatusCode.from_number(self.code)


class Error(Message, tag="error", frozen=True, kw_only=True):
    """A refusal; about a transfer, or (``x`` empty) about the link or session."""

    transfer_id: Key = field(name="x")
    code: Annotated[int, Meta(ge=0, lt=2**16)]
    text: Text = field(name="msg")

    @classmethod
    def of(cls, transfer_id: str, err: TransferError) -> Error:
        """The refusal that tells a peer ``err`` (its message cut to what the wire takes)."""
        return cls(transfer_id=transfer_id, code=err.code.number, text=err.message[:MAX_TEXT])

    @property
    def status(self) -> StatusCode:
        return StatusCode.from_number(self.code)


class Pull(Message, tag="pull", frozen=True, kw_only=True):
    """Push offer ``(oreq, oep)``'s blocks ``src`` into our reservation ``(rid, ep)``."""

    transfer_id: Key = field(name="x")
    request_id: Key = field(name="rid")
    epoch: Epoch = field(name="ep")
    region: Name = field(name="reg")
    dst: Indices
    src_region: Name = field(name="sreg")
    src: Indices
    offer_request: Key = field(name="oreq")
    offer_epoch: Epoch = field(name="oep")
    layers: tuple[Index, Index] | None = field(name="lay")
    num_tokens: Index | None = field(name="ntok")
    ttl: Seconds


Handshake = Hello | Challenge | Auth | Welcome
AnyMessage = (
    Hello
    | Challenge
    | Auth
    | Welcome
    | Regions
    | Bye
    | Ping
    | Begin
    | Grant
    | Renew
    | Data
    | Landed
    | End
    | Ack
    | Error
    | Pull
)


class Header(_Struct, frozen=True, kw_only=True):
    """Every frame's header: the protocol version, the session token ("" while linking)
    and one message."""

    v: Literal[6]
    sid: Secret
    msg: AnyMessage = field(name="m")
    #: This frame's number in its session and direction (1, 2, ...; 0 while linking): the
    #: receiver takes each once (:mod:`transfer.replay`).
    n: Epoch = 0


def tag(msg: Message) -> str:
    """A message's frame type (``"begin"``, ...): what fault rules and logs name."""
    return str(type(msg).__struct_config__.tag)
