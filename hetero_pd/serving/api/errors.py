"""OpenAI-shaped API errors, and the API key check.

Every error the router answers is an :class:`APIError`; its body is OpenAI's
``{"error": {"message", "type", "param", "code"}}`` so clients raise their usual exception
classes (``openai.BadRequestError``, ``AuthenticationError``, ``RateLimitError``, ...).
In a stream the router sends ``sse(err.to_json())`` and then ``sse_done()``.
"""

from __future__ import annotations

import hmac
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
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        #: Seconds the client should wait before it tries again (``Retry-After``), if any.
        self.retry_after = retry_after

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


def check_api_key(headers: Mapping[str, str], keys: Collection[str]) -> str:
    """Require ``Authorization: Bearer <key>`` with one of ``keys``; no keys, no check.
    Returns the key the client gave ("" when no keys are set): admission counts per key.

    Each key is compared in constant time, and all of them are compared, so timing tells
    neither the key nor which one matched. The given key is never echoed back.
    """
    if not keys:
        return ""
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
    matched = ""
    for key in keys:
        if hmac.compare_digest(given, key.encode()):
            matched = key
    if not matched:
        raise unauthorized("Incorrect API key provided")
    return matched


def _header(headers: Mapping[str, str], name: str) -> str | None:
    # aiohttp's headers are case-insensitive already; a plain dict is not.
    value = headers.get(name)
    if value is None:
        value = next((v for k, v in headers.items() if k.lower() == name), None)
    return value
