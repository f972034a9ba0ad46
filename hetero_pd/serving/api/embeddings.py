"""``POST /v1/embeddings`` in OpenAI's shape, behind the API key like the generation routes.

    {"model", "input": str | [str] | [ids] | [[ids]], "encoding_format": "float" | "base64",
     "dimensions"?, "user"?}
    -> {"object": "list", "data": [{"object": "embedding", "index", "embedding"}], "model",
        "usage": {"prompt_tokens", "total_tokens"}}

Each input is one vector: the last token's final hidden state, L2-normalised
(hetero_pd/engine/pooling.py says why), computed by a prefill (else colocated) worker in one
forward pass that keeps no KV. ``base64`` is the vector's float32 bytes, little-endian (what
the openai client asks for by default and decodes). ``dimensions`` is refused unless it is
the model's own width: a generative model's vectors are not trained to be cut shorter
(Matryoshka). Bad input is a 400 naming the field. Admission counts each input as one
completion (router/admission.py; a batch holds at most its key's whole share), so a client
over its share, or any client while the server is full, gets the same 429 with Retry-After.
"""

from __future__ import annotations

import asyncio
import base64
import uuid
from typing import Any

import numpy as np
from aiohttp import web

from hetero_pd.serving.api import errors
from hetero_pd.serving.api.bodies import Body, fields_of, too_long_input
from hetero_pd.serving.api.errors import bad_request
from hetero_pd.serving.api.fields import show
from hetero_pd.serving.api.state import ApiState, state_of
from hetero_pd.serving.api.tokens import check_model
from hetero_pd.serving.control.sampling import MAX_EMBED_INPUTS

FORMATS = ("float", "base64")


async def embeddings(request: web.Request) -> web.Response:
    state = state_of(request)
    key = errors.check_api_key(request.headers, state.api_keys)
    raw = await state.reads.read(request)
    prepared = await state.bodies.prepare(raw, "embedding", state.max_model_len)
    loop = asyncio.get_running_loop()
    body, items = await loop.run_in_executor(state.tokenize_pool, parse, state, prepared)
    # Admitted like completions, before the tokenizer spends time on it: each input holds a
    # slot, a large batch at most its key's whole share (it then runs alone for that key).
    admission = state.router.admission
    slots = admission.admit(key, min(len(items), admission.largest))
    try:
        inputs = await loop.run_in_executor(state.tokenize_pool, token_ids, state, items)
        dim, blob = await state.router.embed(f"embd-{uuid.uuid4().hex}", inputs)
    finally:
        slots.release()
    if body.get("dimensions") is not None and body["dimensions"] != dim:
        raise bad_request(
            f"'dimensions' {show(body['dimensions'])} is not supported: this model's embeddings "
            f"have {dim} dimensions and cannot be shortened (not a Matryoshka model)",
            "dimensions",
        )
    vectors = np.frombuffer(blob, dtype="<f4").reshape(len(inputs), dim)
    as_base64 = body.get("encoding_format") == "base64"
    data = [
        {
            "object": "embedding",
            "index": i,
            "embedding": base64.b64encode(v.tobytes()).decode() if as_base64 else v.tolist(),
        }
        for i, v in enumerate(vectors)
    ]
    tokens = sum(map(len, inputs))
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    model = body.get("model") or state.model_names[0]
    return web.json_response({"object": "list", "data": data, "model": model, "usage": usage})


def parse(state: ApiState, prepared: Body) -> tuple[dict[str, Any], list[Any]]:
    """The body's fields and its inputs, checked but not tokenized (tokenizer thread)."""
    body = fields_of(prepared, "embedding", state.max_model_len)
    check_model(body, state.model_names)
    fmt = body.get("encoding_format")
    if fmt is not None and fmt not in FORMATS:
        raise bad_request(
            f"'encoding_format' must be one of {list(FORMATS)}, got {show(fmt)}", "encoding_format"
        )
    dims = body.get("dimensions")
    if dims is not None and (not isinstance(dims, int) or isinstance(dims, bool) or dims < 1):
        raise bad_request(
            f"'dimensions' must be a positive integer, got {show(dims)}", "dimensions"
        )
    return body, _items(body.get("input"))


def token_ids(state: ApiState, items: list[Any]) -> list[list[int]]:
    """Each input as token ids, each checked against the context (tokenizer thread)."""
    return [_ids(state, item, i) for i, item in enumerate(items)]


def _items(value: Any) -> list[Any]:
    """The inputs: one string or id list, or a list of them (all strings or all id lists)."""
    what = "a string, a list of strings, a list of token ids or a list of token id lists"
    if isinstance(value, str) or (
        isinstance(value, list) and value and all(isinstance(t, int) for t in value)
    ):
        return [value]
    if not isinstance(value, list) or not value:
        raise bad_request(f"'input' must be {what} (not empty), got {show(value)}", "input")
    if len(value) > MAX_EMBED_INPUTS:
        raise bad_request(f"'input' holds {len(value)} items, at most {MAX_EMBED_INPUTS}", "input")
    if not (all(isinstance(v, str) for v in value) or all(isinstance(v, list) for v in value)):
        raise bad_request(f"'input' must be {what}, got {show(value)}", "input")
    return value


def _ids(state: ApiState, item: str | list[Any], i: int) -> list[int]:
    where = f"input[{i}]"
    if isinstance(item, str):
        if not item:
            raise bad_request(f"'{where}' is an empty string: there is nothing to embed", where)
        if state.max_prompt_chars and len(item) > state.max_prompt_chars:
            raise too_long_input(where, f"{len(item)} characters", state.max_model_len)
        ids = list(state.tokenizer.encode(item))
    else:
        size = len(state.tokenizer)
        bad = [t for t in item if not isinstance(t, int) or isinstance(t, bool)
               or not 0 <= t < size]  # fmt: skip
        if not item or bad:
            raise bad_request(
                f"'{where}' must be a non-empty list of token ids in [0, {size}), got "
                f"{show(bad[:5] if bad else item)}",
                where,
            )
        ids = item
    if len(ids) > state.max_model_len:
        raise too_long_input(where, f"{len(ids)} tokens", state.max_model_len)
    return ids
