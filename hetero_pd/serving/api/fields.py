"""Typed readers for OpenAI request fields, and the prompt and messages parsers.

Each reader treats a missing field and ``null`` alike (not given) and raises a 400
:class:`APIError` whose ``param`` names the field; ``show`` keeps echoed values short.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from hetero_pd.serving.api.errors import bad_request

#: Chat roles accepted in ``messages``; "developer" is OpenAI's newer name for "system".
ROLES = ("system", "developer", "user", "assistant", "tool")


#: Most prompts one /v1/completions request may batch.
MAX_PROMPTS = 256
#: Most messages one chat may hold (OpenAI's limit): each costs chat-template time whatever
#: its length, so the count is capped as well as the characters.
MAX_MESSAGES = 2048
#: Most content parts one message may hold.
MAX_CONTENT_PARTS = 256


def parse_prompts(value: Any) -> list[tuple[str | None, list[int] | None]]:
    """A completion ``prompt``: one prompt or a batch of them (a list of strings or of
    token-id lists), each ``(text, None)`` or ``(None, token_ids)``."""
    if isinstance(value, list) and value and isinstance(value[0], (str, list)):
        if len(value) > MAX_PROMPTS:
            raise bad_request(
                f"'prompt' batches {len(value)} prompts, at most {MAX_PROMPTS}", "prompt"
            )
        return [parse_prompt(v, f"prompt[{i}]") for i, v in enumerate(value)]
    return [parse_prompt(value)]


def parse_prompt(value: Any, where: str = "prompt") -> tuple[str | None, list[int] | None]:
    """One completion prompt: ``(text, None)`` or ``(None, token_ids)``."""
    if isinstance(value, str):
        if not value:
            raise bad_request(f"'{where}' must not be empty", "prompt")
        return value, None
    if isinstance(value, list):
        if not value:
            raise bad_request(f"'{where}' must not be empty", "prompt")
        for token in value:
            if not _is_int(token) or token < 0:
                raise bad_request(
                    f"'{where}' token ids must be integers >= 0, got {show(token)}", "prompt"
                )
        return None, list(value)
    if value is None:
        raise bad_request("'prompt' is required", "prompt")
    raise bad_request(
        f"'{where}' must be a string or a list of token ids, got {show(value)}", "prompt"
    )


def parse_messages(value: Any) -> list[dict[str, str]]:
    """Chat ``messages`` as ``{"role", "content"}`` dicts with plain-text content."""
    if not isinstance(value, list) or not value:
        raise bad_request("'messages' is required and must be a non-empty list", "messages")
    if len(value) > MAX_MESSAGES:
        raise bad_request(
            f"'messages' holds {len(value)} messages; at most {MAX_MESSAGES} are accepted",
            "messages",
        )
    out = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad_request(f"'{where}' must be an object with 'role' and 'content'", where)
        role = message.get("role")
        if role not in ROLES:
            raise bad_request(
                f"'{where}.role' must be one of {', '.join(ROLES)}; got {show(role)}",
                f"{where}.role",
            )
        content = _content(message.get("content"), f"{where}.content", role == "assistant")
        if message.get("tool_calls"):
            calls = _tool_calls_text(message["tool_calls"], f"{where}.tool_calls", role)
            content = f"{content}\n{calls}" if content else calls
        # Chat templates know "system"; OpenAI's "developer" role is its newer name.
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


def _content(value: Any, where: str, optional: bool) -> str:
    if isinstance(value, str):
        return value
    if value is None and optional:
        return ""
    if not isinstance(value, list):
        raise bad_request(f"'{where}' must be a string or a list of text parts", where)
    if len(value) > MAX_CONTENT_PARTS:
        raise bad_request(
            f"'{where}' holds {len(value)} content parts; at most {MAX_CONTENT_PARTS} are accepted",
            where,
        )
    texts = []
    for j, part in enumerate(value):
        if not isinstance(part, dict) or part.get("type") != "text":
            got = part.get("type") if isinstance(part, dict) else part
            raise bad_request(
                f"'{where}[{j}]': only text content parts are supported, got {show(got)}",
                f"{where}[{j}].type",
            )
        if not isinstance(part.get("text"), str):
            raise bad_request(f"'{where}[{j}].text' must be a string", f"{where}[{j}].text")
        texts.append(part["text"])
    return "\n".join(texts)  # as vLLM joins text parts


def json_object(body: Any) -> dict[str, Any]:
    """The request body, which must be a JSON object."""
    if not isinstance(body, dict):
        raise bad_request(f"The request body must be a JSON object, got {type(body).__name__}")
    return body


def opt_int(b: Mapping[str, Any], name: str, *, minimum: int | None = None) -> int | None:
    """An integer field (integral floats like ``16.0`` count), at least ``minimum``."""
    value = b.get(name)
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # 16.0 is 16, as pydantic-based servers accept it
    if value is None:
        return None
    if not _is_int(value):
        raise bad_request(f"'{name}' must be an integer, got {show(value)}", name)
    if minimum is not None and value < minimum:
        raise bad_request(f"'{name}' must be >= {minimum}, got {value}", name)
    return int(value)


def opt_number(b: Mapping[str, Any], name: str) -> float | None:
    """A finite number field."""
    value = b.get(name)
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise bad_request(f"'{name}' must be a finite number, got {show(value)}", name)
    return float(value)


def opt_bool(b: Mapping[str, Any], name: str, param: str | None = None) -> bool | None:
    """A boolean field; ``param`` names it in errors when nested."""
    value = b.get(name)
    if value is not None and not isinstance(value, bool):
        param = param or name
        raise bad_request(f"'{param}' must be true or false, got {show(value)}", param)
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def same_json(value: Any, neutral: Any) -> bool:
    """Equal and of the same JSON kind (``true`` is not ``1``, ``0`` is not ``false``)."""
    return isinstance(value, bool) == isinstance(neutral, bool) and value == neutral


def show(value: Any) -> str:
    """A short rendering of a client-sent value for error messages."""
    text = json.dumps(value) if isinstance(value, (str, int, float, bool)) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _tool_calls_text(value: Any, where: str, role: Any) -> str:
    """An assistant message's earlier ``tool_calls`` as the model wrote them (Hermes'
    ``<tool_call>`` blocks, hetero_pd.serving.api.tools), for the prompt."""
    if role != "assistant" or not isinstance(value, list) or len(value) > MAX_MESSAGES:
        raise bad_request(
            f"'{where}' must be an assistant message's list of calls", where, "invalid_value"
        )
    blocks = []
    for k, call in enumerate(value):
        fn = call.get("function") if isinstance(call, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        args = fn.get("arguments") if isinstance(fn, dict) else None
        try:
            parsed = json.loads(args) if isinstance(args, str) else None
        except ValueError:
            parsed = None
        if not isinstance(name, str) or parsed is None:
            raise bad_request(
                f'\'{where}[{k}]\' must be {{"function": {{"name": str, "arguments": '
                "a JSON string}}",
                f"{where}[{k}]",
            )
        body = json.dumps({"name": name, "arguments": parsed})
        blocks.append(f"<tool_call>\n{body}\n</tool_call>")
    return "\n".join(blocks)
