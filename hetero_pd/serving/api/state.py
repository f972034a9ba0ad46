"""What the API's handlers share: the router, the tokenizer and its thread, the limits, and
how a router error becomes an OpenAI error response."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from hetero_pd.serving.api import errors
from hetero_pd.serving.api.body_process import BodyDecoder
from hetero_pd.serving.api.body_reads import ReadBudget
from hetero_pd.serving.api.tools import DEFAULT_TOOLS, ToolSettings
from hetero_pd.serving.router.router import Router, RouterError


@dataclass(slots=True)
class ApiState:
    router: Router
    tokenizer: Any
    model_names: list[str]
    max_model_len: int
    vocab_size: int
    api_keys: tuple[str, ...] = ()
    #: The API keys whose requests may set `priority` (each one of api_keys).
    priority_keys: tuple[str, ...] = ()
    #: The keys of /admin/* (router.admin_keys); a client's API key is not one.
    admin_keys: tuple[str, ...] = ()
    #: The deployment's tool-call format and whether tool_choice "auto" is served.
    tools: ToolSettings = DEFAULT_TOOLS
    #: The model folder (edge sessions in prompt_only mode check the device's split with it).
    model_dir: Path | None = None
    #: A streaming client that has not taken a chunk for this long is cut off (its request
    #: aborted, its slot freed).
    write_timeout_s: float = 30.0
    #: Kernel send buffer of a streaming response: what a client that stops reading can
    #: leave queued before the write timeout starts counting.
    stream_sndbuf_bytes: int = 64 * 1024
    created: int = field(default_factory=lambda: int(time.time()))
    #: Parsing, chat templates and tokenization run here, off the event loop, one at a time
    #: (a tokenizer object is not safe to share between threads).
    tokenize_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="hetero-pd-tokenize")
    )
    #: Decodes the bodies too large to decode on the tokenizer thread without holding the
    #: GIL long (`body_process`); `create_app` closes it with the app.
    bodies: BodyDecoder = field(default_factory=BodyDecoder)
    #: Bounds the bytes of every body in reading at once (`body_reads`).
    reads: ReadBudget = field(default_factory=ReadBudget)
    #: Characters a prompt may have before it cannot fit in max_model_len tokens whatever
    #: the text (set from the tokenizer's longest token); 0 = not known.
    max_prompt_chars: int = 0
    #: Restarts a worker (its id) or every worker in turn (None), within a timeout: the
    #: launcher's on one box, None where workers run elsewhere (admin.py).
    restart: Callable[[str | None, float], Awaitable[Any]] | None = None
    #: Removes a drained worker for good (scale-down): the launcher's, or None.
    remove: Callable[[str, float], Awaitable[Any]] | None = None
    #: Where edge sessions are served over TLS (`edge.tls`): the API's own port then
    #: refuses them, naming this URL. Empty: they are served on the API's port.
    edge_tls_url: str = ""

    def __post_init__(self) -> None:
        if not self.max_prompt_chars:
            vocab: dict[str, int] = getattr(self.tokenizer, "get_vocab", dict)()
            longest = max((len(t) for t in vocab), default=0)
            self.max_prompt_chars = self.max_model_len * longest if longest else 0


STATE = web.AppKey("state", ApiState)


def state_of(request: web.Request) -> ApiState:
    return request.app[STATE]


def error_response(err: errors.APIError, retry_after: float | None = None) -> web.Response:
    headers = {"Retry-After": str(max(1, round(retry_after)))} if retry_after else None
    return web.json_response(err.to_json(), status=err.status, headers=headers)


def api_error(e: RouterError) -> errors.APIError:
    if e.status == 429:
        return errors.too_many_requests(e.message)
    if e.status == 400:
        return errors.bad_request(e.message, code=e.code)
    return errors.APIError(e.status, e.message, "server_error", None, e.code)
