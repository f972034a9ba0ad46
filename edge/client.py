"""EdgeClient: stream a completion while the device runs the model's first k layers.

    from edge import EdgeClient
    client = EdgeClient("https://router:8443", model_dir, split_layer=4, ca_file="edge-cert.pem")
    async for text in client.stream("Tell me a story", max_tokens=64):
        print(text, end="")

The prompt is tokenized and run through layers [0, k) here; only encoded hidden states
leave the device. For every token the cloud samples, the device runs its layers on that
token and sends the hidden state back (one WebSocket round trip per token).

The link is TLS (an `https://` URL: the deployment's edge listener, `edge.tls`, or any TLS
front), the server's certificate checked against `ca_file` (the router's generated one, or
the CA that signed the deployment's) or the system's CAs. An `http://` URL sends hidden
states in clear and is refused unless `plaintext=True` says so.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import torch

from edge.codec import encode
from edge.noise import add_noise
from edge.privacy import check_split
from edge.runtime import EdgeRuntime
from hetero_pd.serving.api.edge_protocol import (
    MAX_MESSAGE_BYTES,
    MODES,
    PATH,
    EdgeParams,
    ErrorMsg,
    ProtocolError,
    Token,
    pack,
    unpack,
)

#: Text, chat messages (through the model's chat template) or token ids.
Prompt = str | list[dict[str, str]] | list[int]


def _prompt_ids(runtime: Any, prompt: Prompt) -> list[int]:
    if isinstance(prompt, str):
        return list(runtime.tokenize(prompt))
    if prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return [int(t) for t in prompt]  # type: ignore[arg-type]
    if prompt and all(isinstance(m, dict) for m in prompt):
        return list(runtime.tokenize_chat(prompt))
    raise TypeError("a prompt is a string, a list of chat messages or a list of token ids")


class EdgeError(RuntimeError):
    """The cloud refused or broke the session; `code` says why."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


class EdgeMismatchError(EdgeError):
    """The cloud runs another model or another split layer than this device."""


@dataclass(slots=True)
class EdgeCompletion:
    """A finished session: the text, the generated token ids and why it stopped."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    #: Seconds from the call (tokenizing and the device's prefill included) to each token.
    token_times_s: list[float] = field(default_factory=list)

    @property
    def ttft_s(self) -> float:
        return self.token_times_s[0] if self.token_times_s else float("nan")

    @property
    def tpot_s(self) -> float:
        """Mean time per output token after the first (the device's round trip included)."""
        t = self.token_times_s
        return (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else float("nan")


class EdgeClient:
    def __init__(
        self,
        url: str,
        model_dir: str | Path,
        split_layer: int,
        *,
        model: str = "smollm2-135m-instruct",
        codec: str = "float16",
        api_key: str | None = None,
        timeout_s: float = 60.0,
        retries: int = 2,
        runtime: Any | None = None,
        tap: Callable[[bytes], None] | None = None,
        mode: str = "split",
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        noise_sigma: float = 0.0,
        max_recovery: float | None = None,
        privacy_profile: str | Path | None = None,
        ca_file: str | Path | None = None,
        plaintext: bool = False,
    ) -> None:
        """`runtime` (an EdgeRuntime or OnnxEdgeRuntime) defaults to torch on the CPU;
        `tap`, if given, sees every message this client sends (audits, benchmarks);
        `sleep` waits out the backoff between connection attempts (tests count its calls);
        `noise_sigma` > 0 adds Gaussian noise to every hidden state sent (`edge.noise`);
        `max_recovery` refuses (EdgeError "privacy_floor") a split whose measured top-1 token
        recovery, in `privacy_profile` (default: the stored one for `model`), is above it.

        `mode="split"` (default): the cloud runs layers [k, L) and this device runs its layers
        on every generated token. `mode="prompt_only"`: this device runs its layers on the
        prompt only and sends their KV with it; the cloud (whole-model workers) decodes
        alone. That KV is a linear map of the prompt's normalized embeddings at layer 0, so
        whoever runs the cloud can recover the prompt from it: prompt_only keeps raw text out
        of transit logs and request bodies, not away from the cloud operator.

        `ca_file`: the certificate (or CA) the cloud's TLS certificate must chain to (default:
        the system's CAs); `plaintext=True` allows an `http://` URL (hidden states in clear:
        a trusted network only)."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self.url = url.rstrip("/").removesuffix("/v1")
        self.model = model
        self.codec = codec
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.retries = retries
        self.runtime = runtime or EdgeRuntime(model_dir, split_layer)
        self.split_layer = split_layer
        self.sent_bytes = 0  # payload bytes this client put on the wire (for benchmarks)
        self.tap = tap
        self.sleep = sleep
        if noise_sigma < 0:
            raise ValueError(f"noise_sigma must be >= 0, got {noise_sigma}")
        self.noise_sigma = noise_sigma
        if max_recovery is not None:
            profile = Path(privacy_profile) if privacy_profile else None
            try:
                check_split(model, split_layer, max_recovery, profile)
            except ValueError as e:  # PrivacyFloorError, PrivacyProfileError
                raise EdgeError("privacy_floor", str(e)) from e
        self._ssl = _tls(self.url, ca_file, plaintext)

    async def stream(
        self,
        prompt: Prompt,
        *,
        max_tokens: int = 64,
        temperature: float = 0.0,
        **params: Any,
    ) -> AsyncIterator[str]:
        """Yields text deltas; a list of messages goes through the chat template."""
        async for msg in self._session(
            prompt, max_tokens=max_tokens, temperature=temperature, **params
        ):
            if msg.text:
                yield msg.text

    async def complete(self, prompt: Prompt, **params: Any) -> EdgeCompletion:
        """Runs a session to its end; the text, token ids and finish reason."""
        done = EdgeCompletion()
        start = time.perf_counter()
        async for msg in self._session(prompt, **params):
            done.token_times_s.extend([time.perf_counter() - start] * len(msg.token_ids))
            done.text += msg.text
            done.token_ids.extend(msg.token_ids)
            done.finish_reason = msg.finish_reason
        return done

    async def generate(self, prompt: Prompt, **params: Any) -> str:
        return (await self.complete(prompt, **params)).text

    async def _session(self, prompt: Prompt, **params: Any) -> AsyncIterator[Token]:
        """Yields the cloud's token messages; after each unfinished one, this device runs its
        layers on the sampled token and sends that hidden state back."""
        rt = self.runtime
        ids = _prompt_ids(rt, prompt)
        wire_params = {"max_tokens": 64, "temperature": 0.0, **params}
        unknown = sorted(set(wire_params) - set(EdgeParams.__struct_fields__))
        if unknown:
            allowed = sorted(EdgeParams.__struct_fields__)
            raise EdgeError(
                "bad_request", f"unknown sampling parameter(s) {unknown}; allowed: {allowed}"
            )
        ws, session = await self._connect()
        try:
            extra: dict[str, Any] = {}
            prompt_frame = encode(add_noise(rt.prefill(ids), self.noise_sigma), self.codec)
            if self.mode == "prompt_only":
                kv = torch.stack([rt.past_k, rt.past_v], dim=1)  # [k, 2, n, kv_heads, head_dim]
                flat = kv.reshape(-1, kv.shape[-2] * kv.shape[-1])
                extra = {"mode": "prompt_only", "prompt_kv": encode(flat, self.codec)}
            try:
                start = pack(
                    "start",
                    model=self.model,
                    split_layer=self.split_layer,
                    fingerprint=rt.fingerprint(),
                    params=wire_params,
                    prompt=prompt_frame,
                    **extra,
                )
            except ProtocolError as e:
                raise EdgeError("bad_request", str(e)) from e
            await self._send(ws, start)
            while True:
                msg = await self._receive(ws)
                if isinstance(msg, ErrorMsg):
                    cls = EdgeMismatchError if msg.code == "fingerprint_mismatch" else EdgeError
                    raise cls(msg.code, msg.message)
                if not isinstance(msg, Token):
                    name = type(msg).__struct_config__.tag
                    raise EdgeError("protocol", f"unexpected {name!r} message from the cloud")
                yield msg
                if msg.finish_reason is not None:
                    return
                if self.mode == "prompt_only":
                    continue  # the cloud decodes alone
                for token in msg.token_ids:
                    row = add_noise(rt.step(int(token)), self.noise_sigma)
                    await self._send(ws, pack("hidden", frame=encode(row, self.codec)))
        finally:
            await ws.close()
            await session.close()

    async def _connect(self) -> tuple[aiohttp.ClientWebSocketResponse, aiohttp.ClientSession]:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
        delay = 0.2
        for attempt in range(self.retries + 1):
            session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None, connect=self.timeout_s)
            )
            try:
                ws = await session.ws_connect(
                    self.url + PATH, headers=headers, max_msg_size=MAX_MESSAGE_BYTES, ssl=self._ssl
                )
                return ws, session
            except aiohttp.ClientSSLError as e:  # not retried: the next try fails alike
                await session.close()
                raise EdgeError(
                    "tls",
                    f"{self.url}: TLS failed ({e}); pass ca_file= the certificate the "
                    "deployment's router logs (edge.tls), or its CA",
                ) from e
            except aiohttp.WSServerHandshakeError as e:
                await session.close()
                if e.status in (401, 403, 404):
                    raise EdgeError("refused", f"{self.url}{PATH}: HTTP {e.status}") from e
                if attempt == self.retries:
                    raise EdgeError("unavailable", f"{self.url}{PATH}: HTTP {e.status}") from e
            except (aiohttp.ClientError, OSError) as e:
                await session.close()
                if attempt == self.retries:
                    raise EdgeError("unreachable", f"{self.url}: {e}") from e
            await self.sleep(delay)  # backoff before reconnecting (not a synchronisation)
            delay *= 2
        raise AssertionError("unreachable")

    async def _send(self, ws: aiohttp.ClientWebSocketResponse, data: bytes) -> None:
        self.sent_bytes += len(data)
        if self.tap is not None:
            self.tap(data)
        await ws.send_bytes(data)

    async def _receive(self, ws: aiohttp.ClientWebSocketResponse) -> Any:
        try:
            msg = await ws.receive(timeout=self.timeout_s)
        except TimeoutError:
            raise EdgeError("timeout", f"no answer from the cloud for {self.timeout_s}s") from None
        if msg.type != aiohttp.WSMsgType.BINARY:
            err = ws.exception()
            if isinstance(err, ssl.SSLError):
                raise EdgeError("tls", f"the link failed TLS's integrity check: {err}")
            if ws.close_code == 1006 and self._ssl:  # no close frame: the link was cut
                raise EdgeError(
                    "closed",
                    "the connection to the cloud was cut without a close frame (1006): the "
                    "router went away, or its TLS layer dropped a record that failed its "
                    "integrity check (altered on the way)",
                )
            raise EdgeError("closed", f"the cloud closed the session ({msg.type.name})")
        try:
            return unpack(msg.data)
        except ProtocolError as e:
            raise EdgeError("protocol", str(e)) from e


def _tls(url: str, ca_file: str | Path | None, plaintext: bool) -> ssl.SSLContext | bool:
    """The TLS context for `url` (https/wss); an EdgeError for a plain one unless allowed."""
    scheme = url.split("://", 1)[0].lower()
    if scheme in ("https", "wss"):
        ctx = ssl.create_default_context(cafile=str(ca_file) if ca_file else None)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        return ctx
    if scheme in ("http", "ws") and plaintext:
        return False
    if scheme in ("http", "ws"):
        raise EdgeError(
            "insecure",
            f"{url}: hidden states would travel in clear; use the deployment's https:// edge "
            "URL (edge.tls, with ca_file=), or pass plaintext=True on a trusted network",
        )
    raise EdgeError("bad_request", f"{url}: the URL must start with https:// (or http://)")
