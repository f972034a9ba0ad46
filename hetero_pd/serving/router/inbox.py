"""A request's inbox on the router: the queue its workers' messages arrive in, as
(worker id, message), and the ways the router waits on it, always with a deadline."""

from __future__ import annotations

import asyncio
import time
from typing import Any, TypeVar

from hetero_pd.serving.router.errors import RouterError

T = TypeVar("T")
Inbox = asyncio.Queue[tuple[str, Any]]


async def get_within(queue: asyncio.Queue[T], timeout_s: float) -> T:
    """`queue.get()` with a deadline (TimeoutError). Not `asyncio.wait_for`: before Python
    3.12 it returns the item and swallows a cancellation that lands as the item arrives,
    so a client disconnect during a fast token stream could go unnoticed and the request
    would run to the end."""
    async with asyncio.timeout(timeout_s):
        return await queue.get()


async def next_message(queue: Inbox, timeout_s: float, rid: str) -> tuple[str, Any]:
    """The next message for request `rid`; a 504 RouterError when none comes in time."""
    try:
        return await get_within(queue, timeout_s)
    except TimeoutError:
        raise RouterError(504, f"request {rid}: no progress for {timeout_s}s", "timeout") from None


async def answer_from(queue: Inbox, worker_id: str, kind: type[T], timeout_s: float) -> T | None:
    """`worker_id`'s message of type `kind` within `timeout_s`, or None; the other
    messages that came meanwhile go back in the queue, in order."""
    deadline = time.monotonic() + timeout_s
    others: list[tuple[str, Any]] = []
    reply = None
    try:
        while reply is None and (left := deadline - time.monotonic()) > 0:
            try:
                sender, msg = await get_within(queue, left)
            except TimeoutError:
                break
            if sender == worker_id and isinstance(msg, kind):
                reply = msg
            else:
                others.append((sender, msg))
    finally:
        for item in others:
            queue.put_nowait(item)
    return reply
