"""Operating a running deployment without ending a request, for operators only: with
router.admin_keys set, the request must carry one of them; with client API keys but no
admin keys, these routes are refused (a client could otherwise drain every decode worker);
with no keys at all (a local deployment, open like its API), anyone on its address may.

    POST /admin/drain    {"worker": "decode-0"}  move its decoding requests to the other
                                                 decode workers, keep new ones off it
    POST /admin/undrain  {"worker": "decode-0"}  back in rotation
    POST /admin/migrate  {"request_id": ..., "worker": optional destination}
    POST /admin/restart  {"worker": "decode-0"} | {"rolling": true}   drain, stop, start a
                                                 fresh process (one box: its launcher)
    POST /admin/remove   {"worker": "decode-1"}  scale-down: drain, then stop it for good

Answers say what moved: `moved`, `failed`, the longest pause and the KV bytes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from aiohttp import web

from hetero_pd.serving.api import errors
from hetero_pd.serving.api.state import state_of
from hetero_pd.serving.router.migration import summary

#: Restarts a worker (its id) or, with None, every worker in turn: the launcher's.
Restart = Callable[[str | None, float], Awaitable[Any]]
#: Removes a worker for good once drained (scale-down): the launcher's.
Remove = Callable[[str, float], Awaitable[Any]]
MAX_TIMEOUT_S = 3600.0
#: An admin body names a worker, a request and a timeout: far more is refused unread, as
#: decoding it would hold the event loop (16 MiB of one key repeated: ~170 ms of msgspec).
MAX_BODY_BYTES = 64 * 1024


class AdminBody(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    worker: str | None = None
    request_id: str | None = None
    rolling: bool = False
    timeout_s: float = 300.0


def add_routes(app: web.Application) -> None:
    app.router.add_post("/admin/drain", _drain)
    app.router.add_post("/admin/undrain", _undrain)
    app.router.add_post("/admin/migrate", _migrate)
    app.router.add_post("/admin/restart", _restart)
    app.router.add_post("/admin/remove", _remove)


def admin_refusal(
    given: str, api_keys: tuple[str, ...], admin_keys: tuple[str, ...]
) -> errors.APIError | None:
    """Why a request whose (checked) Bearer key is `given` may not use /admin/*; None: it may."""
    if given in admin_keys or not (api_keys or admin_keys):
        return None
    why = "this key is a client's" if admin_keys else "this deployment sets no admin keys"
    return errors.APIError(
        403, f"/admin/* takes an operator's key from router.admin_keys ({why})",
        "permission_error", None, "admin_key_required",
    )  # fmt: skip


async def _body(request: web.Request) -> AdminBody:
    state = state_of(request)
    given = errors.check_api_key(request.headers, (*state.admin_keys, *state.api_keys))
    refusal = admin_refusal(given, state.api_keys, state.admin_keys)
    if refusal is not None:
        raise refusal
    size = request.content_length  # refused before it is read, when the client says it
    raw = await state.reads.read(request) if size is None or size <= MAX_BODY_BYTES else b""
    if len(raw) > MAX_BODY_BYTES or (size or 0) > MAX_BODY_BYTES:
        raise errors.APIError(
            413, f"an /admin/* body is at most {MAX_BODY_BYTES} bytes, got {size or len(raw)}"
        )
    try:
        body = msgspec.json.decode(raw, type=AdminBody)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise errors.bad_request(f"invalid admin request: {e}") from None
    if not 0 < body.timeout_s <= MAX_TIMEOUT_S:
        raise errors.bad_request(f"timeout_s must be in (0, {MAX_TIMEOUT_S}]", "timeout_s")
    return body


def _worker(request: web.Request, body: AdminBody) -> str:
    workers = state_of(request).router.workers
    if body.worker is None:
        raise errors.bad_request('name the worker: {"worker": ID}', "worker")
    if body.worker not in workers:
        raise errors.bad_request(
            f"no worker {body.worker!r} (there are {sorted(workers)})", "worker"
        )
    return body.worker


async def _drain(request: web.Request) -> web.Response:
    body = await _body(request)
    worker = _worker(request, body)
    migrator = state_of(request).router.migrator
    moved = await migrator.drain(worker, body.timeout_s)
    left = len(migrator.on_worker(worker))
    return web.json_response({"worker": worker, **summary(moved), "left": left})


async def _undrain(request: web.Request) -> web.Response:
    body = await _body(request)
    worker = _worker(request, body)
    state_of(request).router.migrator.undrain(worker)
    return web.json_response({"worker": worker, "draining": False})


async def _migrate(request: web.Request) -> web.Response:
    body = await _body(request)
    if body.request_id is None:
        raise errors.bad_request('name the request: {"request_id": ID}', "request_id")
    dest = _worker(request, body) if body.worker is not None else None
    try:
        result = await state_of(request).router.migrator.migrate(body.request_id, dest)
    except ValueError as e:
        raise errors.bad_request(str(e), "request_id") from None
    return web.json_response(dataclasses.asdict(result))


async def _restart(request: web.Request) -> web.Response:
    body = await _body(request)
    restart = state_of(request).restart
    worker = None if body.rolling else _worker(request, body)
    done = await _by_launcher("restart", restart and restart(worker, body.timeout_s))
    return web.json_response({"restarted": done if isinstance(done, list) else [done]})


async def _remove(request: web.Request) -> web.Response:
    body = await _body(request)
    worker = _worker(request, body)
    remove = state_of(request).remove
    done = await _by_launcher("remove", remove and remove(worker, body.timeout_s))
    return web.json_response({"removed": done})


async def _by_launcher(what: str, op: Awaitable[Any] | None) -> Any:
    """Awaits the launcher's `op` (None: no launcher here, a 501); its refusals as 4xx/5xx."""
    if op is None:
        raise errors.APIError(
            501, f"{what} needs the deployment's launcher (one box: `hetero-pd serve`)",
            "server_error", None, "not_supported",
        )  # fmt: skip
    try:
        return await op
    except ValueError as e:
        raise errors.bad_request(str(e), "worker") from None
    except RuntimeError as e:
        raise errors.APIError(503, str(e), "server_error", None, f"{what}_failed") from None
