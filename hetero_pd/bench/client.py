"""One streaming OpenAI request, timed chunk by chunk.

The response is Server-Sent Events: ``data: {json}`` lines, ending with ``data: [DONE]``.
A *content chunk* is one whose ``choices[0]`` carries non-empty text (``text`` for
completions, ``delta.content`` or ``delta.reasoning_content`` for chat), so a chat stream's
role-only opening chunk does not count as the first token.  ``stream_options.include_usage``
asks the server for a final usage chunk; its ``completion_tokens`` is the output length,
else the number of content chunks is.
"""

from __future__ import annotations

import json
import time
from typing import Any, Literal

import aiohttp

from hetero_pd.bench.datasets import BenchRequest
from hetero_pd.bench.metrics import RequestResult

Endpoint = Literal["completions", "chat"]
PATHS: dict[str, str] = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


class SSEDecoder:
    """Turns a byte stream into the payloads of its ``data:`` lines, in order.

    Lines may be split across reads; comments (``:``) and other fields are dropped.  Each
    ``data:`` line is taken as one event: OpenAI-style servers send every JSON chunk on one
    line, and timing an event at its line (not at the blank line after it) is what we want.
    """

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, data: bytes) -> list[str]:
        self._buf += data
        *lines, self._buf = self._buf.split(b"\n")
        return [p for line in lines if (p := self._payload(line)) is not None]

    def flush(self) -> list[str]:
        """Payload of a last line the stream did not end with a newline."""
        line, self._buf = self._buf, b""
        p = self._payload(line)
        return [] if p is None else [p]

    @staticmethod
    def _payload(line: bytes) -> str | None:
        line = line.rstrip(b"\r")
        if not line.startswith(b"data:"):
            return None
        return line[5:].strip().decode("utf-8")


def base_url(url: str) -> str:
    """``http://host:port`` from a URL given with or without a trailing ``/v1``."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def build_payload(
    endpoint: Endpoint,
    model: str,
    req: BenchRequest,
    temperature: float = 0.0,
    ignore_eos: bool = False,
    extra_body: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The JSON body of a streaming request for ``req``."""
    body: dict[str, Any] = {"model": model, "max_tokens": req.max_tokens}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    body.update(temperature=temperature, stream=True, stream_options={"include_usage": True})
    if ignore_eos:
        body["ignore_eos"] = True
    body.update(extra_body or {})
    return body


def _chunk_text(endpoint: Endpoint, choice: Any) -> str:
    if not isinstance(choice, dict):
        raise ValueError(f"malformed stream chunk: choice is {type(choice).__name__}")
    if endpoint == "completions":
        text = choice.get("text")
    else:
        delta = choice.get("delta") or {}
        text = delta.get("content") or delta.get("reasoning_content")
    return text if isinstance(text, str) else ""


def _error_message(body: str) -> str:
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        return body[:300]
    err = data.get("error", data) if isinstance(data, dict) else data
    msg = err.get("message") if isinstance(err, dict) else None
    return str(msg if msg else err)[:300]


class StreamTimer:
    """Folds the stream's messages, as they arrive, into a RequestResult."""

    def __init__(self, endpoint: Endpoint, req: BenchRequest, start: float) -> None:
        self.endpoint = endpoint
        self.out = RequestResult(req.prompt_len, req.max_tokens, start_time=start)
        self._first: float | None = None
        self._last_token = self._last_choice = start
        self._chunks = 0
        self._text: list[str] = []

    def on_message(self, msg: str, now: float) -> bool:
        """Take one ``data:`` payload received at ``now``; False once the stream failed."""
        if msg == "[DONE]":
            return True
        chunk = json.loads(msg)
        if not isinstance(chunk, dict):
            raise ValueError(f"malformed stream chunk: {msg[:200]}")
        if "error" in chunk or chunk.get("object") == "error":
            self.out.error = f"stream error: {_error_message(msg)}"
            return False
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self.out.output_tokens = int(usage.get("completion_tokens") or 0)
            if isinstance(usage.get("prompt_tokens"), int):
                self.out.prompt_tokens = usage["prompt_tokens"]
        choices = chunk.get("choices")
        if not choices:
            return True
        self._last_choice = now
        piece = _chunk_text(self.endpoint, choices[0])
        if piece:
            if self._first is None:
                self._first = now
            else:
                self.out.itl.append(now - self._last_token)
            self._last_token = now
            self._chunks += 1
            self._text.append(piece)
        return True

    def finish(self) -> RequestResult:
        """The result once the stream has ended normally."""
        out = self.out
        if self._first is None:
            out.error = "the stream ended without any content chunk"
            return out
        out.success = True
        out.ttft = self._first - out.start_time
        out.latency = self._last_choice - out.start_time
        out.generated_text = "".join(self._text)
        if out.output_tokens <= 0:
            out.output_tokens = self._chunks
        return out


async def send_request(
    session: aiohttp.ClientSession,
    url: str,
    endpoint: Endpoint,
    payload: dict[str, Any],
    req: BenchRequest,
    headers: dict[str, str] | None = None,
) -> RequestResult:
    """POST ``payload`` to ``url`` (the full endpoint URL) and time its stream.

    Never raises for network or server trouble: the result says what went wrong.
    """
    timer = StreamTimer(endpoint, req, time.perf_counter())
    out = timer.out
    try:
        async with session.post(url, json=payload, headers=headers) as resp:
            out.status = resp.status
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {_error_message(await resp.text())}"
                return out
            decoder = SSEDecoder()
            async for data in resp.content.iter_any():
                now = time.perf_counter()
                for msg in decoder.feed(data):
                    if not timer.on_message(msg, now):
                        return out
            for msg in decoder.flush():
                if not timer.on_message(msg, time.perf_counter()):
                    return out
    except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as e:
        out.error = (f"{type(e).__name__}: {e}")[:300]
        return out
    return timer.finish()


async def first_model(session: aiohttp.ClientSession, url: str) -> str:
    """The id of the first model ``GET /v1/models`` lists."""
    async with session.get(base_url(url) + "/v1/models") as resp:
        if resp.status != 200:
            raise ValueError(f"GET /v1/models answered HTTP {resp.status}; pass --model")
        data = await resp.json()
    models = data.get("data") if isinstance(data, dict) else None
    if not models or not isinstance(models[0], dict) or "id" not in models[0]:
        raise ValueError("GET /v1/models listed no model; pass --model")
    return str(models[0]["id"])
