"""Control-plane messages between the router and workers: msgpack maps with a version and
a type, each validated against an explicit schema before use (never pickle).

    frame = msgpack({"v": 1, "t": <type>, ...fields})
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack

from hetero_pd.sampling_params import SamplingParams

VERSION = 1
MAX_FRAME_BYTES = 64 * 2**20


class MessageError(ValueError):
    """A frame that is not a valid control message."""


_INT = (int,)
_NUM = (int, float)
_STR = (str,)
_OPT_STR = (str, type(None))
_BOOL = (bool,)
_LIST = (list,)
_DICT = (dict,)
_ANY_SCALAR = (str, int, type(None))

# type -> {field: allowed python types}; every field is required.
SCHEMAS: dict[str, dict[str, tuple[type, ...]]] = {
    # router -> worker
    "hello": {},
    "generate": {"rid": _STR, "prompt_ids": _LIST, "params": _DICT, "priority": _INT},
    "reserve": {"rid": _STR, "prompt_ids": _LIST, "params": _DICT, "priority": _INT},
    "prefill": {
        "rid": _STR,
        "prompt_ids": _LIST,
        "params": _DICT,
        "priority": _INT,
        "dest_worker": _STR,
        "dest_address": _STR,
        "dest_blocks": _DICT,
    },
    "hidden": {"rid": _STR, "frame": _DICT},  # split: layer k's input for the newest token
    "kv_ready": {"rid": _STR, "first_token": _INT},
    "kv_failed": {"rid": _STR},
    "abort": {"rid": _STR},
    "check": {},
    "shutdown": {"drain": _BOOL},
    "switch_role": {"role": _STR},
    # worker -> router
    "ready": {"worker": _STR, "role": _STR, "info": _DICT},
    "heartbeat": {"worker": _STR, "load": _DICT},
    "output": {
        "rid": _STR,
        "text": _STR,
        "token_ids": _LIST,
        "finish_reason": _OPT_STR,
        "stop_reason": _ANY_SCALAR,
        "prompt_tokens": _INT,
        "completion_tokens": _INT,
        "cached_tokens": _INT,
    },
    "reserved": {"rid": _STR, "blocks": _DICT, "cached_tokens": _INT},
    "kv_fallback": {"rid": _STR},  # the KV did not arrive whole: computing the prompt here
    "prefill_done": {"rid": _STR, "first_token": _INT, "transfer": _DICT},
    "error": {"rid": _STR, "code": _STR, "message": _STR, "recoverable": _BOOL},
    "integrity": {"ok": _BOOL, "used_blocks": _INT, "message": _STR},
    "bye": {"worker": _STR},
}


# type -> {field: allowed python types} of fields that may be absent. A split (edge) request
# carries its prompt as a hidden-state frame (`hetero_pd.hidden_codec`) and no prompt ids;
# in "prompt only" mode also the KV of the device's layers [0, early_layers) as a frame of
# [early_layers * 2 * num_tokens, kv_heads * head_dim] rows (layer, K/V, position).
OPTIONAL: dict[str, dict[str, tuple[type, ...]]] = {
    "generate": {"hidden": _DICT, "early_kv": _DICT, "early_layers": _INT},
    "reserve": {"hidden": _DICT, "early_kv": _DICT, "early_layers": _INT},
    "prefill": {"hidden": _DICT, "early_kv": _DICT, "early_layers": _INT},
}


def encode(msg_type: str, **fields: Any) -> bytes:
    if msg_type not in SCHEMAS:
        raise MessageError(f"unknown message type {msg_type!r}")
    return msgpack.packb({"v": VERSION, "t": msg_type, **fields}, use_bin_type=True)


def unpack_bounded(data: bytes, limit: int, what: str, error: type[ValueError]) -> Any:
    """msgpack from the network, at most `limit` bytes (never pickle); raises `error`."""
    if len(data) > limit:
        raise error(f"{what} of {len(data)} bytes exceeds {limit}")
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=True)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        raise error(f"not a msgpack {what}: {e}") from e


def decode(frame: bytes) -> dict[str, Any]:
    """Parses and validates one frame; raises MessageError naming what is wrong."""
    msg = unpack_bounded(frame, MAX_FRAME_BYTES, "frame", MessageError)
    if not isinstance(msg, dict):
        raise MessageError("a message must be a map")
    if msg.get("v") != VERSION:
        raise MessageError(f"unsupported message version {msg.get('v')!r} (want {VERSION})")
    schema = SCHEMAS.get(msg.get("t"))  # type: ignore[arg-type]
    if schema is None:
        raise MessageError(f"unknown message type {msg.get('t')!r}")
    for name, types in schema.items():
        if name not in msg:
            raise MessageError(f"{msg['t']}: missing field {name!r}")
        value = msg[name]
        if not isinstance(value, types) or (types is _INT and isinstance(value, bool)):
            raise MessageError(f"{msg['t']}: field {name!r} has type {type(value).__name__}")
    for name, types in OPTIONAL.get(msg["t"], {}).items():
        if name in msg and (
            not isinstance(msg[name], types) or (types is _INT and isinstance(msg[name], bool))
        ):
            raise MessageError(f"{msg['t']}: field {name!r} has type {type(msg[name]).__name__}")
    for name in ("prompt_ids", "token_ids"):
        if name in msg and not all(
            isinstance(t, int) and not isinstance(t, bool) for t in msg[name]
        ):
            raise MessageError(f"{msg['t']}: {name} must be a list of integers")
    return msg


def params_to_wire(params: SamplingParams) -> dict[str, Any]:
    return {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}


def params_from_wire(raw: dict[str, Any]) -> SamplingParams:
    """SamplingParams from a message; unknown or invalid fields raise ValueError."""
    names = {f.name for f in dataclasses.fields(SamplingParams)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ValueError(f"unknown sampling parameter(s) {unknown}")
    return SamplingParams(**raw)
