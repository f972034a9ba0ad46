"""OpenAI-shaped API errors, and the API key check.

Every error the router answers is an :class:`APIError`; its body is OpenAI's
``{"error": {"message", "type", "param", "code"}}`` so clients raise their usual exception
classes (``openai.BadRequestError``, ``AuthenticationError``, ``RateLimitError``, ...).
In a stream the router sends ``sse(err.to_json())`` and then ``sse_done()``.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Collection, Mapping
from typing import Any


class APIError(Exception):
    """An error answered to the client as ``{"error": {message, type, param, code}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def to_json(self) -> dict[str, Any]:
        """The response body, in OpenAI's error shape."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """400: the request is malformed or asks for something unsupported."""
    return APIError(400, message, "invalid_request_error", param, code)


def unauthorized(message: str) -> APIError:
    """401: missing or wrong API key."""
    return APIError(401, message, "authentication_error", None, "invalid_api_key")


def not_found(message: str, param: str | None = None) -> APIError:
    """404: unknown route or resource."""
    return APIError(404, message, "not_found_error", param, None)


def model_not_found(model: str) -> APIError:
    """404 for a ``model`` this server does not serve (OpenAI's wording and code)."""
    return APIError(
        404, f"The model `{model}` does not exist.", "not_found_error", "model", "model_not_found"
    )


def too_many_requests(message: str) -> APIError:
    """429: overloaded, rejected early; the client should retry later."""
    return APIError(429, message, "rate_limit_error", None, "rate_limit_exceeded")


def server_error(message: str, status: int = 500) -> APIError:
    """5xx: our failure (500), or no worker can take the request now (503)."""
    return APIError(status, message, "server_error", None, None)


#: Deepest nesting of arrays and objects accepted in a request body.
MAX_JSON_DEPTH = 32


def parse_json_body(raw: bytes) -> Any:
    """Decode a request body, answering 400 when it is not JSON (or holds an integer of more
    than the 4,300 digits Python converts), nests deeper than
    MAX_JSON_DEPTH, or holds a string that is not valid Unicode (a lone surrogate such as
    ``"\\ud800"``, which JSON escapes can spell but no tokenizer or encoder accepts)."""
    try:
        body = json.loads(raw)
    except (
        ValueError
    ) as e:  # not JSON, not UTF-8, or an integer of more digits than Python converts
        raise bad_request(f"The request body is not valid JSON: {e}") from None
    except RecursionError:
        raise bad_request(f"The request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    _check_json(body)
    return body


def _check_json(body: Any) -> None:
    stack: list[tuple[Any, int, str]] = [(body, 0, "")]
    while stack:
        value, depth, path = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                where = f" at {path}" if path else ""
                raise bad_request(
                    f"The request body holds a string that is not valid Unicode{where} "
                    "(a lone surrogate escape such as \\ud800)",
                    path.split(".", 1)[0].split("[", 1)[0] or None,
                ) from None
            continue
        if not isinstance(value, (list, dict)):
            continue
        if depth >= MAX_JSON_DEPTH:
            raise bad_request(f"The request body nests deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(value, dict):
            for key, item in value.items():
                stack.append((key, depth + 1, path))
                stack.append((item, depth + 1, f"{path}.{key}" if path else str(key)))
        else:
            stack.extend((item, depth + 1, f"{path}[{i}]") for i, item in enumerate(value))


def check_api_key(headers: Mapping[str, str], keys: Collection[str]) -> None:
    """Require ``Authorization: Bearer <key>`` with one of ``keys``; no keys, no check.

    Each key is compared in constant time, and all of them are compared, so timing tells
    neither the key nor which one matched. The given key is never echoed back.
    """
    if not keys:
        return
    value = _header(headers, "authorization")
    if value is None:
        raise unauthorized(
            "You didn't provide an API key: send it in the Authorization header "
            "(Authorization: Bearer YOUR_KEY)"
        )
    scheme, _, token = value.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise unauthorized("Malformed Authorization header: expected 'Bearer YOUR_KEY'")
    # aiohttp hands over header bytes that are not UTF-8 as surrogate escapes: compared as
    # those bytes, they match no key.
    given = token.encode("utf-8", "surrogateescape")
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(given, key.encode())
    if not matched:
        raise unauthorized("Incorrect API key provided")


def _header(headers: Mapping[str, str], name: str) -> str | None:
    # aiohttp's headers are case-insensitive already; a plain dict is not.
    value = headers.get(name)
    if value is None:
        value = next((v for k, v in headers.items() if k.lower() == name), None)
    return value
