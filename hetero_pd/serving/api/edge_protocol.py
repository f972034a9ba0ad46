"""The edge session protocol: msgpack messages over one WebSocket (`/v1/edge/session`).

Default ("split") mode:

    edge                                        cloud (router -> split workers)
      |-- start {model, split_layer, fingerprint, params, prompt: frame} -->| P: layers [k, L)
      |<-- token {token_ids, text, finish_reason} ---------------------------| D: layers [k, L)
      |-- hidden {frame} (layers [0, k) of that token) --------------------->|
      |<-- token ... (until finish_reason) ----------------------------------|
      |<-- error {code, message} (at any time; the session ends) ------------|

"prompt_only" mode: `start` also carries `prompt_kv`, the KV of the device's layers [0, k)
for the prompt; whole-model workers run [k, L) on the prompt and then decode alone, so the
device sends nothing after `start` (and the cloud holds early-layer KV of the prompt).

A frame is `hetero_pd.hidden_codec.encode(...)` (`protocol.HiddenFrame`): neither the
prompt's text nor its token ids are ever sent. Every message is one declared type, decoded
with the same bounds as the control protocol (`hetero_pd.serving.control.protocol`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, UnsetType

from hetero_pd.serving.control.sampling import MAX_STOP_CHARS, MAX_STOP_STRINGS, TokenId, TokenIds
from hetero_pd.serving.control.values import HiddenFrame, Message, Name, Text

VERSION: Literal[1] = 1
#: The largest message either end accepts (the HTTP API's bound on a body). The router's event
#: loop assembles and decodes a message in one go, holding the GIL (aiohttp copies it three
#: times, msgspec once): ~4 ms per MiB on a shared 2-core EPYC, so 64 MiB held /health for
#: 240-670 ms (issue 27's bar is 100 ms). A larger message is refused by the length its frame
#: announces, before any of it is read.
MAX_MESSAGE_BYTES = 16 * 2**20
PATH = "/v1/edge/session"
MODES = ("split", "prompt_only")


class ProtocolError(ValueError):
    """A message that is not valid in the edge session protocol."""


class EdgeParams(
    msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True, omit_defaults=True
):
    """The sampling fields a session may set (as in /v1/completions); unset ones default."""

    max_tokens: Annotated[int, Meta(ge=1, lt=2**31)] | UnsetType = UNSET
    temperature: float | UnsetType = UNSET
    top_p: float | UnsetType = UNSET
    min_p: float | UnsetType = UNSET
    top_k: Annotated[int, Meta(ge=-1, lt=2**31)] | UnsetType = UNSET
    seed: int | UnsetType = UNSET
    min_tokens: Annotated[int, Meta(ge=0, lt=2**31)] | UnsetType = UNSET
    ignore_eos: bool | UnsetType = UNSET
    skip_special_tokens: bool | UnsetType = UNSET
    include_stop_str_in_output: bool | UnsetType = UNSET
    stop: (
        Annotated[
            list[Annotated[str, Meta(min_length=1, max_length=MAX_STOP_CHARS)]],
            Meta(max_length=MAX_STOP_STRINGS),
        ]
        | UnsetType
    ) = UNSET
    stop_token_ids: Annotated[list[TokenId], Meta(max_length=MAX_STOP_STRINGS)] | UnsetType = UNSET

    def given(self) -> dict[str, Any]:
        """The fields the device set."""
        return {k: v for k, v in msgspec.structs.asdict(self).items() if v is not UNSET}


class _EdgeMsg(
    msgspec.Struct,
    tag_field="t",
    forbid_unknown_fields=True,
    frozen=True,
    kw_only=True,
    omit_defaults=True,
):
    v: Literal[1]


class Start(_EdgeMsg, tag="start", frozen=True, kw_only=True):
    model: Annotated[str, Meta(max_length=4096)]
    split_layer: Annotated[int, Meta(ge=0, lt=4096)]
    fingerprint: Name
    params: EdgeParams
    prompt: HiddenFrame
    mode: Literal["split", "prompt_only"] = "split"
    prompt_kv: HiddenFrame | None = None

    def __post_init__(self) -> None:
        if (self.mode == "prompt_only") != (self.prompt_kv is not None):
            raise ValueError("prompt_kv is sent in prompt_only mode, and only then")


class HiddenMsg(_EdgeMsg, tag="hidden", frozen=True, kw_only=True):
    frame: HiddenFrame


class Token(_EdgeMsg, tag="token", frozen=True, kw_only=True):
    token_ids: TokenIds
    text: Text
    finish_reason: Name | None = None


class ErrorMsg(_EdgeMsg, tag="error", frozen=True, kw_only=True):
    code: Name
    message: Message


EdgeMessage = Start | HiddenMsg | Token | ErrorMsg
_TYPES: dict[str, type[msgspec.Struct]] = {
    "start": Start,
    "hidden": HiddenMsg,
    "token": Token,
    "error": ErrorMsg,
}
_decoder = msgspec.msgpack.Decoder(EdgeMessage)
_encoder = msgspec.msgpack.Encoder()


def pack(msg_type: str, **fields: Any) -> bytes:
    """One message of `msg_type`; nested values may be plain dicts (frames, params)."""
    cls = _TYPES.get(msg_type)
    if cls is None:
        raise ProtocolError(f"unknown message type {msg_type!r}")
    try:
        msg = msgspec.convert({"v": VERSION, **fields}, cls)
    except msgspec.ValidationError as e:
        raise ProtocolError(f"{msg_type}: {e}") from None
    data = _encoder.encode(msg)
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(
            f"a {msg_type} message of {len(data)} bytes exceeds the protocol's "
            f"{MAX_MESSAGE_BYTES}: send a shorter prompt, or a narrower codec (float16, int8)"
        )
    return data


def unpack(data: bytes) -> EdgeMessage:
    """Parses and validates one message; raises ProtocolError naming what is wrong."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        return _decoder.decode(data)
    except msgspec.ValidationError as e:
        raise ProtocolError(f"invalid message: {e}") from None
    except msgspec.DecodeError as e:
        raise ProtocolError(f"not a msgpack message: {e}") from None
