"""The cloud end of an edge session (`GET /v1/edge/session`, a WebSocket; protocol in
`hetero_pd.serving.api.edge_protocol`).

The device sends the prompt as layer k's input (hidden states, never text or token ids); the
router runs it through the split workers (prefill layers [k, L) -> KV to decode, or prefill
on the decode worker for short prompts) and streams each sampled token back. Before the
decode worker can go on, the device runs its layers on that token and returns the hidden
state: one WebSocket round trip per generated token.

A session starts only when the device's model name, split layer and split fingerprint match
the workers'; anything malformed ends it with an `error` message naming the problem.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import uuid
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from aiohttp import WSMsgType, web

from hetero_pd import hidden_codec
from hetero_pd.models.config import ModelConfig
from hetero_pd.models.fingerprint import split_fingerprint
from hetero_pd.sampling_params import SamplingParams
from hetero_pd.serving.api import edge_protocol as E
from hetero_pd.serving.api import errors
from hetero_pd.serving.api import protocol as oai
from hetero_pd.serving.control import values as V
from hetero_pd.serving.router.router import EdgeRequest, Router, RouterError

log = logging.getLogger("hetero_pd.edge")
M = TypeVar("M", E.Start, E.HiddenMsg)


class SessionError(Exception):
    """Ends a session with an `error` message."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


@dataclass(frozen=True, slots=True)
class EdgeSettings:
    model_names: Collection[str]
    max_model_len: int
    vocab_size: int
    api_keys: Collection[str] = ()
    #: The model folder, for prompt_only sessions (whole-model workers report no split).
    model_dir: Path | None = None
    #: Longest wait for the device's next message (its layers on one token).
    receive_timeout_s: float = 60.0
    #: The session's API key (set once checked): its completions count against its share.
    key: str = ""


async def serve_session(
    request: web.Request, router: Router, cfg: EdgeSettings
) -> web.StreamResponse:
    """Runs one edge session to its end; errors go to the device as `error` messages."""
    key = errors.check_api_key(request.headers, cfg.api_keys)  # before the upgrade: a plain 401
    cfg = dataclasses.replace(cfg, key=key)
    # Uncompressed: permessage-deflate would let a few KiB on the wire inflate to a whole
    # message on the event loop, and hidden states hardly compress anyway.
    ws = web.WebSocketResponse(max_msg_size=E.MAX_MESSAGE_BYTES, compress=False)
    await ws.prepare(request)
    try:
        await _run(ws, router, cfg)
    except asyncio.CancelledError:  # the connection was lost: aiohttp cancels its handler
        log.info(
            "edge session ended: the connection was lost (the device went away, or TLS "
            "dropped it: a record that failed its integrity check, altered on the way)"
        )
        raise
    except SessionError as e:
        await _send_error(ws, e.code, e.message)
    except RouterError as e:
        await _send_error(ws, e.code, e.message)
    except errors.APIError as e:
        await _send_error(ws, e.code or e.type, e.message)
    finally:
        await ws.close()
    return ws


async def _run(ws: web.WebSocketResponse, router: Router, cfg: EdgeSettings) -> None:
    start = await _receive(ws, E.Start, cfg.receive_timeout_s)
    if start.model not in cfg.model_names:
        raise SessionError("model_not_found", f"the model {start.model!r} is not served here")
    split = router.split_info()
    if start.mode == "prompt_only":
        await _run_prompt_only(ws, router, cfg, start, split is not None)
        return
    if split is None:
        raise SessionError(
            "mode_unavailable",
            "this deployment runs whole-model workers: start the session in prompt_only mode, "
            "or deploy split workers (an edge: section)",
        )
    layer, fingerprint, hidden_size = split
    if start.split_layer != layer or start.fingerprint != fingerprint:
        raise SessionError(
            "fingerprint_mismatch",
            f"the device runs layers [0, {start.split_layer}) with split fingerprint "
            f"{start.fingerprint!r}; this deployment continues at layer {layer} with "
            f"{fingerprint!r}: the device and the cloud must hold the same model split at the "
            "same layer",
        )
    num_tokens = _rows(start.prompt, hidden_size, None)
    prompt = EdgeRequest(V.EdgePrompt(hidden=start.prompt, layer=layer), num_tokens)
    await _stream(ws, router, cfg, start, prompt, hidden_size)


async def _run_prompt_only(
    ws: web.WebSocketResponse,
    router: Router,
    cfg: EdgeSettings,
    start: E.Start,
    split_deployment: bool,
) -> None:
    """The device sent its layers' KV with the prompt; whole-model workers decode alone."""
    if split_deployment or cfg.model_dir is None:
        raise SessionError(
            "mode_unavailable",
            "prompt_only sessions need whole-model workers; this deployment runs split workers",
        )
    mc = _model_config(cfg.model_dir)
    k = start.split_layer
    if not 1 <= k < mc.num_layers:
        raise SessionError("bad_request", f"split_layer {k} is not in [1, {mc.num_layers})")
    fingerprint = _fingerprint(cfg.model_dir, k)
    if start.fingerprint != fingerprint:
        raise SessionError(
            "fingerprint_mismatch",
            f"the device's split fingerprint {start.fingerprint!r} is not this model's "
            f"{fingerprint!r} at layer {k}: the device and the cloud hold different models",
        )
    assert start.prompt_kv is not None  # prompt_only mode carries it (checked on decode)
    n = _rows(start.prompt, mc.hidden_size, None)
    _rows(start.prompt_kv, mc.num_kv_heads * mc.head_dim, 2 * k * n)
    edge = V.EdgePrompt(hidden=start.prompt, early_kv=start.prompt_kv, layer=k)
    await _stream(ws, router, cfg, start, EdgeRequest(edge, n), mc.hidden_size)


async def _stream(
    ws: web.WebSocketResponse,
    router: Router,
    cfg: EdgeSettings,
    start: E.Start,
    prompt: EdgeRequest,
    hidden_size: int,
) -> None:
    """Streams the tokens to the device; in split mode, relays each token's hidden state
    (checked for shape and size here, decoded only by the worker)."""
    params = _params(start, prompt.num_tokens, cfg)
    rid = f"edge-{uuid.uuid4().hex}"
    slots = router.admission.admit(cfg.key, params.n)
    generate = router.generate(rid, [], params, 0, prompt, admitted=True)
    try:
        async with contextlib.aclosing(generate) as stream:
            async for out in stream:
                token = E.pack(
                    "token",
                    token_ids=out.token_ids,
                    text=out.text,
                    finish_reason=out.finish_reason,
                )
                await ws.send_bytes(token)
                if out.finish_reason is not None:
                    return
                if prompt.prompt.early_kv is not None:
                    continue  # prompt_only: the cloud decodes alone
                msg = await _receive(ws, E.HiddenMsg, cfg.receive_timeout_s)
                _rows(msg.frame, hidden_size, 1)
                router.supply_hidden(rid, msg.frame)
    finally:
        slots.release()


@functools.lru_cache(maxsize=8)
def _model_config(model_dir: Path) -> ModelConfig:
    return ModelConfig.from_dir(model_dir)


@functools.lru_cache(maxsize=64)
def _fingerprint(model_dir: Path, split_layer: int) -> str:
    return split_fingerprint(model_dir, split_layer)


async def _receive(ws: web.WebSocketResponse, kind: type[M], timeout_s: float) -> M:
    name = kind.__struct_config__.tag
    try:
        msg = await ws.receive(timeout=timeout_s)
    except TimeoutError:
        raise SessionError(
            "timeout", f"no {name} message from the device in {timeout_s}s"
        ) from None
    if msg.type in (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED, WSMsgType.ERROR):
        raise _Gone
    if msg.type != WSMsgType.BINARY:
        raise SessionError("protocol", f"expected a binary {name} message, got {msg.type.name}")
    try:
        parsed = E.unpack(msg.data)
    except E.ProtocolError as e:
        raise SessionError("protocol", str(e)) from e
    if not isinstance(parsed, kind):
        got = type(parsed).__struct_config__.tag
        raise SessionError("protocol", f"expected a {name} message, got {got!r}")
    return parsed


class _Gone(SessionError):
    """The device closed the session (nothing left to tell it)."""

    def __init__(self) -> None:
        super().__init__("closed", "the device closed the session")


def _rows(frame: V.HiddenFrame, width: int, rows: int | None) -> int:
    """The rows of a frame the router relays unread (the worker decodes and checks values)."""
    try:
        got = hidden_codec.frame_rows(frame.as_dict(), width)
    except hidden_codec.CodecError as e:
        raise SessionError("bad_hidden_state", str(e)) from e
    if rows is not None and got != rows:
        raise SessionError(
            "bad_hidden_state", f"expected {rows} rows of hidden state or KV, got {got}"
        )
    return got


def _params(start: E.Start, num_tokens: int, cfg: EdgeSettings) -> SamplingParams:
    """The session's sampling parameters, validated as /v1/completions validates them."""
    req = oai.parse_completion_request(
        {**start.params.given(), "model": start.model, "prompt": [0]}
    )
    oai.check_sampling_limits(req.params, cfg.vocab_size)
    req.params.max_tokens = oai.check_context_length(req, num_tokens, cfg.max_model_len)
    return req.params


async def _send_error(ws: web.WebSocketResponse, code: str, message: str) -> None:
    if code == "closed" or ws.closed:
        return
    log.info("edge session ended: %s: %s", code, message)
    with contextlib.suppress(ConnectionError, RuntimeError):
        await ws.send_bytes(E.pack("error", code=str(code), message=message[:16384]))
