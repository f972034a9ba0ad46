"""OpenAI response bodies and Server-Sent Events framing (pure builders, returning dicts).

Shapes follow what OpenAI returns, so the official client's pydantic models and ``vllm
bench serve`` accept them. ``finish_reason`` is passed through: "stop" and "length" are
OpenAI's; an aborted request should end with an error rather than a finish reason.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    from hetero_pd.serving.api.request import GenerateRequest

SSE_DONE = b"data: [DONE]\n\n"
#: One per streamed token: msgspec's encoder, ~10x json.dumps per chunk (hetero-pd bench
#: per-token). Compact JSON in UTF-8 (json.dumps escaped non-ASCII as \uXXXX: the same JSON).
_JSON = msgspec.json.Encoder()


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """OpenAI's ``usage`` object."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_response(
    req: GenerateRequest,
    text: str,
    finish_reason: str,
    prompt_tokens: int,
    completion_tokens: int,
) -> dict[str, Any]:
    """The body of a non-streaming /v1/completions answer (object "text_completion")."""
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    body = _head(req, "text_completion", [choice])
    body["usage"] = usage(prompt_tokens, completion_tokens)
    return body


def chat_response(
    req: GenerateRequest,
    text: str,
    finish_reason: str,
    prompt_tokens: int,
    completion_tokens: int,
) -> dict[str, Any]:
    """The body of a non-streaming /v1/chat/completions answer (object "chat.completion")."""
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": text},
        "logprobs": None,
        "finish_reason": finish_reason,
    }
    body = _head(req, "chat.completion", [choice])
    body["usage"] = usage(prompt_tokens, completion_tokens)
    return body


def choices_body(
    req: GenerateRequest,
    choices: list[dict[str, Any]],
    prompt_tokens: int,
    completion_tokens: int,
) -> dict[str, Any]:
    """A non-streaming answer of several choices (``choices`` builds them)."""
    obj = "chat.completion" if req.kind == "chat" else "text_completion"
    body = _head(req, obj, choices)
    body["usage"] = usage(prompt_tokens, completion_tokens)
    return body


def completion_chunk(
    req: GenerateRequest,
    delta_text: str,
    finish_reason: str | None = None,
    index: int = 0,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One streamed /v1/completions event: a text delta, or the last one with its reason."""
    choice = {
        "index": index,
        "text": delta_text,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
    }
    return _chunk_head(req, [choice])


def chat_chunk(
    req: GenerateRequest,
    delta_text: str | None,
    role: str | None = None,
    finish_reason: str | None = None,
    index: int = 0,
    logprobs: dict[str, Any] | None = None,
    tool_calls: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """One streamed chat event (object "chat.completion.chunk").

    OpenAI's first chunk is ``chat_chunk(req, "", role="assistant")``; the last carries
    ``finish_reason`` and usually an empty delta (``delta_text=None``).
    """
    delta: dict[str, Any] = {}
    if role is not None:
        delta["role"] = role
    if delta_text is not None:
        delta["content"] = delta_text
    if tool_calls is not None:  # pieces of calls, each with its "index" among the choice's calls
        delta["tool_calls"] = tool_calls
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    return _chunk_head(req, [choice])


def usage_chunk(req: GenerateRequest, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """The extra event sent before ``[DONE]`` when ``stream_options.include_usage``:
    no choices, just the request's usage."""
    body = _head(req, _chunk_object(req), [])
    body["usage"] = usage(prompt_tokens, completion_tokens)
    return body


def models_response(
    model_names: list[str], created: int, owned_by: str = "hetero-pd"
) -> dict[str, Any]:
    """The body of GET /v1/models."""
    return {
        "object": "list",
        "data": [
            {"id": name, "object": "model", "created": created, "owned_by": owned_by}
            for name in model_names
        ],
    }


def sse(data: dict[str, Any] | str) -> bytes:
    """One Server-Sent Event, ``data: <compact JSON>\\n\\n``; a string is sent as is
    (one ``data:`` line per line, as the SSE format requires). Compact JSON holds no line
    break (one inside a string is escaped)."""
    if not isinstance(data, str):
        return b"data: " + _JSON.encode(data) + b"\n\n"
    return "".join(f"data: {line}\n" for line in data.split("\n")).encode() + b"\n"


def sse_done() -> bytes:
    """The event that ends every OpenAI stream."""
    return SSE_DONE


def _head(req: GenerateRequest, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "id": req.request_id,
        "object": obj,
        "created": req.created,
        "model": req.model,
        "system_fingerprint": None,
        "choices": choices,
    }


def _chunk_head(req: GenerateRequest, choices: list[dict[str, Any]]) -> dict[str, Any]:
    body = _head(req, _chunk_object(req), choices)
    if req.include_usage:
        body["usage"] = None  # OpenAI: every chunk has "usage": null, except the last one
    return body


def _chunk_object(req: GenerateRequest) -> str:
    return "chat.completion.chunk" if req.kind == "chat" else "text_completion"
