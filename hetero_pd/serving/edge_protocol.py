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

A frame is `hetero_pd.hidden_codec.encode(...)`: neither the prompt's text nor its token ids
are ever sent. Every message is validated here before use.
"""

from __future__ import annotations

from typing import Any

import msgpack

from hetero_pd.serving.messages import unpack_bounded

VERSION = 1
MAX_MESSAGE_BYTES = 64 * 2**20
PATH = "/v1/edge/session"

_SCHEMAS: dict[str, dict[str, type | tuple[type, ...]]] = {
    "start": {
        "model": str,
        "split_layer": int,
        "fingerprint": str,
        "params": dict,
        "prompt": dict,
    },
    "hidden": {"frame": dict},
    "token": {"token_ids": list, "text": str, "finish_reason": (str, type(None))},
    "error": {"code": str, "message": str},
}
# Fields a message may carry. `mode`: "split" (default: the cloud runs layers [k, L) for every
# token, the device sends each token's hidden state) or "prompt_only" (the device sends the
# KV of its layers [0, k) for the prompt as `prompt_kv`, and the cloud decodes alone).
_OPTIONAL: dict[str, dict[str, type]] = {"start": {"mode": str, "prompt_kv": dict}}
MODES = ("split", "prompt_only")


class ProtocolError(ValueError):
    """A message that is not valid in the edge session protocol."""


def pack(msg_type: str, **fields: Any) -> bytes:
    if msg_type not in _SCHEMAS:
        raise ProtocolError(f"unknown message type {msg_type!r}")
    return msgpack.packb({"v": VERSION, "t": msg_type, **fields}, use_bin_type=True)


def unpack(data: bytes) -> dict[str, Any]:
    """Parses and validates one message; raises ProtocolError naming what is wrong."""
    msg = unpack_bounded(data, MAX_MESSAGE_BYTES, "message", ProtocolError)
    if not isinstance(msg, dict) or msg.get("v") != VERSION:
        raise ProtocolError(f"expected a version {VERSION} message map")
    schema = _SCHEMAS.get(msg.get("t"))  # type: ignore[arg-type]
    if schema is None:
        raise ProtocolError(f"unknown message type {msg.get('t')!r}")
    for name, types in schema.items():
        value = msg.get(name)
        if name not in msg or not isinstance(value, types) or isinstance(value, bool):
            raise ProtocolError(f"{msg['t']}: field {name!r} is missing or has the wrong type")
    optional = _OPTIONAL.get(msg["t"], {})
    for name, typ in optional.items():
        if name in msg and not isinstance(msg[name], typ):
            raise ProtocolError(f"{msg['t']}: field {name!r} has the wrong type")
    extra = sorted(map(str, set(msg) - set(schema) - set(optional) - {"v", "t"}))
    if extra:
        raise ProtocolError(f"{msg['t']}: unexpected field(s) {extra}")
    if msg["t"] == "token" and not all(
        isinstance(t, int) and not isinstance(t, bool) for t in msg["token_ids"]
    ):
        raise ProtocolError("token: token_ids must be a list of integers")
    if msg["t"] == "start":
        mode = msg.setdefault("mode", "split")
        if mode not in MODES:
            raise ProtocolError(f"start: mode {mode!r} is not one of {MODES}")
        if (mode == "prompt_only") != ("prompt_kv" in msg):
            raise ProtocolError("start: prompt_kv is sent in prompt_only mode, and only then")
    return msg
