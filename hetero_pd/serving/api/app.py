"""The OpenAI-compatible REST API (aiohttp) in front of the router.

POST /v1/completions, POST /v1/chat/completions (streaming or not), POST /v1/embeddings
(`embeddings`), GET /v1/models,
GET /health, GET /metrics, vLLM's GET /version, POST /tokenize and POST /detokenize (the
last two, which spend tokenizer time, behind the API key when keys are set), and the edge
sessions' WebSocket (GET /v1/edge/session, see `hetero_pd.serving.api.edge_session`; with
`edge.tls`, on a TLS listener of its own: `create_edge_app`, `edge_tls`). Errors
use OpenAI's JSON shape and status codes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from aiohttp import web

from hetero_pd import __version__
from hetero_pd.serving.api import admin, embeddings, errors, generate, responses
from hetero_pd.serving.api import tokens as openai_tokenize
from hetero_pd.serving.api.bodies import Body, fields_of, too_deep
from hetero_pd.serving.api.body_reads import MAX_BODY_BYTES
from hetero_pd.serving.api.edge_protocol import PATH as EDGE_PATH
from hetero_pd.serving.api.edge_session import EdgeSettings, serve_session
from hetero_pd.serving.api.state import STATE, ApiState, api_error, error_response, state_of
from hetero_pd.serving.router.router import RouterError

log = logging.getLogger("hetero_pd.api")
#: aiohttp inflates a compressed request body as it arrives, on the event loop (16 KiB of
#: gzip on the wire became 16 MiB): every runner of these apps turns that off, and
#: `_errors` answers such a request 415.
AUTO_DECOMPRESS = False
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def create_edge_app(state: ApiState) -> web.Application:
    """The edge listener's app (served over TLS, `edge_tls`): edge sessions only."""
    app = web.Application(middlewares=[_errors], client_max_size=MAX_BODY_BYTES)
    app[STATE] = state
    app.router.add_get(EDGE_PATH, _edge_session)
    return app


def create_app(state: ApiState) -> web.Application:
    app = web.Application(middlewares=[_errors], client_max_size=MAX_BODY_BYTES)
    app[STATE] = state
    app.router.add_post("/v1/completions", generate.completions)
    app.router.add_post("/v1/chat/completions", generate.chat)
    app.router.add_post("/v1/embeddings", embeddings.embeddings)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/version", _version)
    app.router.add_post("/tokenize", _tokenize_route)
    app.router.add_post("/detokenize", _detokenize_route)
    app.router.add_get(EDGE_PATH, _edge_session_here)
    admin.add_routes(app)
    app.on_cleanup.append(_close_bodies)
    return app


async def _close_bodies(app: web.Application) -> None:
    app[STATE].bodies.close()


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    encoding = request.headers.get("Content-Encoding", "").strip()
    if encoding and encoding.lower() != "identity":  # never inflated: AppRunner(AUTO_DECOMPRESS)
        message = (
            f"request bodies are taken as sent, never compressed (Content-Encoding: {encoding})"
        )
        return error_response(errors.APIError(415, message, code="compressed_body"))
    try:
        return await handler(request)
    except errors.APIError as e:
        return error_response(e, e.retry_after)
    except RouterError as e:
        return error_response(api_error(e), e.retry_after)
    except RecursionError:  # a value as deep as JSON decodes, walked (or repr'd) by a parser
        return error_response(too_deep())
    except web.HTTPException as e:
        if e.status < 400:
            raise
        # aiohttp's own answers (unknown route, wrong method) in OpenAI's shape too.
        kind = "not_found_error" if e.status == 404 else "invalid_request_error"
        err = errors.APIError(e.status, f"{request.method} {request.path}: {e.reason}", kind)
        return web.json_response(err.to_json(), status=e.status, headers=_allow(e))


def _allow(e: web.HTTPException) -> dict[str, str] | None:
    allow = e.headers.get("Allow")
    return {"Allow": allow} if allow else None


async def _models(request: web.Request) -> web.Response:
    state = state_of(request)
    errors.check_api_key(request.headers, state.api_keys)
    return web.json_response(responses.models_response(state.model_names, state.created))


async def _health(request: web.Request) -> web.Response:
    """Readiness: 200 while a decode-capable worker is live, else 503; with the API key
    (when keys are set) the answer also lists every worker (role, device, pid, liveness,
    load, supervisor state). `?live=1` is liveness: 200 whenever this process answers
    (Kubernetes must not restart a router that is only waiting for its workers)."""
    state = state_of(request)
    router = state.router
    if request.query.get("live"):
        return web.json_response({"status": "alive"})
    ok = bool(router.live("decode", "both"))
    body: dict[str, Any] = {"status": "ok" if ok else "unavailable"}
    if _authorized(request, state):
        body["workers"] = {
            w.worker_id: {
                "role": w.role,
                "device": w.info.device,
                "dtype": {"name": w.info.dtype, "reason": w.info.dtype_reason},
                "pid": w.info.pid,
                "alive": w.alive,
                "load": {
                    k: v for k, v in msgspec.structs.asdict(w.load).items() if k != "transfer"
                },
                **router.supervision_of(w.worker_id),
            }
            for w in router.workers.values()
        }
    return web.json_response(body, status=200 if ok else 503)


def _authorized(request: web.Request, state: ApiState) -> bool:
    try:
        errors.check_api_key(request.headers, state.api_keys)
    except errors.APIError:
        return False
    return True


async def _metrics(request: web.Request) -> web.Response:
    state = state_of(request)
    errors.check_api_key(request.headers, state.api_keys)
    router = state.router
    router.refresh_metrics()
    body, content_type = router.metrics.render()
    return web.Response(body=body, headers={"Content-Type": content_type})


async def _version(request: web.Request) -> web.Response:
    return web.json_response({"version": __version__})


async def _tokenize_route(request: web.Request) -> web.Response:
    state = state_of(request)
    errors.check_api_key(request.headers, state.api_keys)
    raw = await state.reads.read(request)
    body = await state.bodies.prepare(raw, "tokenize", state.max_model_len)
    answer = await asyncio.get_running_loop().run_in_executor(
        state.tokenize_pool, _tokenize, state, body
    )
    return web.json_response(answer)


async def _detokenize_route(request: web.Request) -> web.Response:
    state = state_of(request)
    errors.check_api_key(request.headers, state.api_keys)
    raw = await state.reads.read(request)
    body = await state.bodies.prepare(raw, "detokenize", state.max_model_len)
    answer = await asyncio.get_running_loop().run_in_executor(
        state.tokenize_pool, _detokenize, state, body
    )
    return web.json_response(answer)


# A small body is decoded on the tokenizer thread too, bounded as for completions (`bodies`).
def _tokenize(state: ApiState, body: Body) -> dict[str, Any]:
    b = fields_of(body, "tokenize", state.max_model_len)
    return openai_tokenize.tokenize(
        state.tokenizer, b, state.model_names, state.max_model_len, state.max_prompt_chars
    )


def _detokenize(state: ApiState, body: Body) -> dict[str, str]:
    b = fields_of(body, "detokenize", state.max_model_len)
    return openai_tokenize.detokenize(state.tokenizer, b, state.model_names, state.max_model_len)


async def _edge_session_here(request: web.Request) -> web.StreamResponse:
    """An edge session on the API's port: refused while the edge listener serves them."""
    url = state_of(request).edge_tls_url
    if url:
        raise errors.APIError(
            403,
            f"edge sessions are served over TLS at {url}{EDGE_PATH} (edge.tls): this port "
            "is plain HTTP, where hidden states would travel in clear",
            "permission_error",
        )
    return await _edge_session(request)


async def _edge_session(request: web.Request) -> web.StreamResponse:
    state = state_of(request)
    cfg = EdgeSettings(
        state.model_names, state.max_model_len, state.vocab_size, state.api_keys, state.model_dir
    )
    return await serve_session(request, state.router, cfg)
