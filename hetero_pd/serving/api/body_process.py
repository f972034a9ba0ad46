"""Large request bodies decoded in a process of their own, so that the router's GIL is free.

msgspec holds the GIL while it decodes (`bodies`): one 16 MiB body is one C call of 40-80 ms
on a shared 2-core EPYC (of one key repeated, ~170 ms), longer when the OS preempts the
thread holding it, and bodies that arrive together decoded back to back, so the event loop
waited their sum (a /health probe up to 245 ms with four, ``hetero-pd bench hostile``,
docs/BENCHMARKS.md section 18) before it could answer /health, stream a token or read a
heartbeat. A body larger than ``INLINE_BYTES`` is therefore decoded
(`bodies.decode_body`, with every bound it checks) in a child process: the router's process
writes the bytes to a pipe (the GIL released while it writes) and reads back the decoded
fields or the 400. Smaller bodies, nearly all of them, are decoded on the tokenizer thread
with the rest of the request's parsing (well under a millisecond), with no round trip.

    request.read() ──> ≤ INLINE_BYTES: raw bytes ───────────────> tokenizer thread: decode_body
                   └─> larger: child process: decode_body ──fields──> tokenizer thread

The child runs `main` here (it imports `bodies` and msgspec: not torch, nor the script that
started the router), started with the first large body and reused. Frames on its stdin: a
header (head length, body length), the head ``[kind, max_ids]`` in msgpack, the body; on its
stdout: a length, then msgpack ``{"fields": ...}``, ``{"error": [status, message, type,
param, code]}`` or ``{"failed": text}`` (an integer past msgpack's 64 bits as an extension
holding its digits). One body at a time (a flood of them costs the host one core at most),
and at most ``MAX_WAITING_BYTES`` of them taken (a body past that is answered 503 with
Retry-After at once, not held in memory behind the others); a child that dies is replaced,
and the body it held decoded once more by its replacement; one that takes more than
``DEADLINE_S`` over a body (stopped, swapping) is killed and replaced, and that body
answered 503, so the bodies queued behind it wait at most that long for it. When the app
stops, the child is killed and every body not answered yet gets a 503.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import struct
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec

from hetero_pd.serving.api.bodies import Body, BodyKind, decode_body, too_deep
from hetero_pd.serving.api.body_reads import MAX_BODY_BYTES
from hetero_pd.serving.api.errors import APIError

log = logging.getLogger("hetero_pd.api")

#: Bodies up to this size are decoded on the tokenizer thread (about 1 ms of msgspec for a
#: body of integers this large); larger ones in the child process.
INLINE_BYTES = 256 * 1024
#: Bytes of large bodies the decoder may hold at once, the one in the child included
#: (`BodyDecoder.max_waiting_bytes`): eight at the API's 16 MiB bound. Past it a body is
#: answered 503 with Retry-After at once, rather than held in the router's memory behind a
#: slow or stalled child.
MAX_WAITING_BYTES = 8 * MAX_BODY_BYTES
#: Seconds a body refused for that is told to wait (``Retry-After``).
RETRY_AFTER_S = 1.0
#: The longest one body may take in the child (`BodyDecoder.deadline_s`): a 16 MiB body takes
#: well under a second, a child's start a second or two on a loaded host.
DEADLINE_S = 30.0
_REQUEST = struct.Struct("!II")  # head length, body length
_REPLY = struct.Struct("!I")  # reply length
#: The msgpack extension that carries an integer msgpack cannot (past 64 bits; JSON has no
#: bound on one): its decimal digits.
_WIDE_INT = 1
_ROOT = Path(__file__).resolve().parents[3]  # the folder holding the hetero_pd package


class ChildEnded(Exception):
    """The decoding process ended (killed, or out of memory) before it answered."""


class BodyDecoder:
    """Decodes the bodies larger than ``INLINE_BYTES`` in a child process; `close()` stops
    it. ``pid``: the child's, while one runs. ``deadline_s``: the longest one body may take
    there (a child's start included); past it the child is killed, the body answered 503
    and the next one gets a new child, so a stalled child never stalls the large bodies
    queued behind it. ``max_waiting_bytes``: the most the bodies taken and not yet decoded
    may hold (one whose client left counts until then); a body past it is refused at once
    (503, Retry-After)."""

    def __init__(
        self, deadline_s: float = DEADLINE_S, max_waiting_bytes: int = MAX_WAITING_BYTES
    ) -> None:
        self.deadline_s = deadline_s
        self.max_waiting_bytes = max_waiting_bytes
        self._waiting = 0  # bytes of the bodies taken, until their decode ends (`_held`)
        self._waiting_lock = threading.Lock()
        self._child: subprocess.Popen[bytes] | None = None
        self._closed = False
        self._busy = threading.Lock()  # held while a body is on the pipes
        # The pipe's blocking reads and writes, one body at a time.
        self._io = ThreadPoolExecutor(1, thread_name_prefix="hetero-pd-bodies")

    @property
    def pid(self) -> int | None:
        return self._child.pid if self._child is not None else None

    async def prepare(self, raw: bytes, kind: BodyKind, max_ids: int) -> Body:
        """``raw`` itself when it is small (the tokenizer thread decodes it, `bodies.fields_of`),
        else its decoded fields; a 400 (`APIError`) when the body is refused."""
        if len(raw) <= INLINE_BYTES:
            return raw
        self._hold(len(raw))
        try:
            work = self._io.submit(self._decode, raw, kind, max_ids)
        except BaseException:
            self._release(len(raw))
            raise
        work.add_done_callback(lambda _: self._release(len(raw)))
        # Shielded: a handler cancelled (its client gone) leaves the body to be decoded, still
        # counted, rather than waiting in the queue uncounted.
        return await asyncio.shield(asyncio.wrap_future(work))

    def _hold(self, size: int) -> None:
        with self._waiting_lock:
            if self._waiting + size > self.max_waiting_bytes:
                raise APIError(
                    503,
                    f"{self._waiting} bytes of large request bodies are waiting to be decoded, "
                    f"and this one's {size} would pass the {self.max_waiting_bytes} allowed: "
                    "retry shortly, or send a body of at most 256 KiB",
                    "server_error",
                    code="body_queue_full",
                    retry_after=RETRY_AFTER_S,
                )
            self._waiting += size

    def _release(self, size: int) -> None:  # on the decoding thread, or the loop's
        with self._waiting_lock:
            self._waiting -= size

    def _decode(self, raw: bytes, kind: BodyKind, max_ids: int) -> dict[str, Any]:
        try:
            reply = self._ask(raw, kind, max_ids)
        except ChildEnded as e:  # killed (an operator, the OOM killer): once more
            if not self._closed:
                log.error("%s; starting another", e)
            try:
                reply = self._ask(raw, kind, max_ids)
            except ChildEnded:
                raise APIError(
                    503,
                    "the process that decodes large request bodies ended twice while decoding "
                    "this one; retry, or send a smaller body",
                    "server_error",
                ) from None
        if "error" in reply:
            raise APIError(*reply["error"])
        if "failed" in reply:
            raise RuntimeError(f"decoding a request body failed: {reply['failed']}")
        fields: dict[str, Any] = reply["fields"]
        return fields

    def _ask(self, raw: bytes, kind: BodyKind, max_ids: int) -> dict[str, Any]:
        with self._busy:
            payload = self._exchange(raw, kind, max_ids)
        try:  # read whole: the next body's reply is the next one on the pipe, whatever this is
            reply: dict[str, Any] = msgspec.msgpack.decode(payload, ext_hook=_ext)
        except RecursionError:  # a field as deep as the child could encode, on a deeper stack
            raise too_deep() from None
        return reply

    def _exchange(self, raw: bytes, kind: BodyKind, max_ids: int) -> bytes:
        if self._closed:  # the app is stopping: start no child it would not stop
            raise APIError(503, "the API is stopping", "server_error")
        child = self._child or self._start()
        assert child.stdin is not None and child.stdout is not None
        stdin, stdout = child.stdin.fileno(), child.stdout.fileno()
        head = msgspec.msgpack.encode([kind, max_ids])
        late = threading.Event()

        def expire() -> None:  # the blocking read or write below then ends
            late.set()
            child.kill()

        timer = threading.Timer(self.deadline_s, expire)
        timer.daemon = True
        timer.start()
        try:
            _write(stdin, _REQUEST.pack(len(head), len(raw)) + head)
            _write(stdin, raw)
            (size,) = _REPLY.unpack(_read(stdout, _REPLY.size))
            payload = _read(stdout, size)
        except (OSError, EOFError):
            self._stop()
            if late.is_set():
                raise APIError(
                    503,
                    f"decoding this request body took more than {self.deadline_s:g}s; the "
                    "process doing it was replaced: retry, or send a smaller body",
                    "server_error",
                ) from None
            raise ChildEnded("the process decoding large request bodies ended") from None
        finally:
            timer.cancel()
        if late.is_set() or self._closed:  # killed as it answered, or the app stopped
            self._stop()
        return payload

    def _start(self) -> subprocess.Popen[bytes]:
        # This very package, wherever it was imported from (not what the environment's
        # path would find first).
        code = f"import sys; sys.path.insert(0, {str(_ROOT)!r}); import {__name__} as m; m.main()"
        self._child = subprocess.Popen(
            [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        return self._child

    def _stop(self) -> None:
        child, self._child = self._child, None
        if child is not None:
            child.kill()
            child.wait(10)
            for pipe in (child.stdin, child.stdout):
                if pipe is not None:
                    pipe.close()

    def close(self) -> None:
        self._closed = True
        self._io.shutdown(wait=False)  # those queued: 503 (`_exchange`)
        child = self._child
        if child is not None:
            child.kill()  # a body on the pipes ends (503), and its thread closes them
        if self._busy.acquire(blocking=False):  # else that thread closes them: never
            try:  # under it, whose descriptor numbers could name other files by then
                self._stop()
            finally:
                self._busy.release()


def _write(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _read(fd: int, n: int) -> bytes:
    parts, left = [], n
    while left:
        part = os.read(fd, min(left, 1 << 20))
        if not part:
            raise EOFError(f"the pipe ended {left} bytes short of {n}")
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


def main() -> None:
    """The child: decodes one framed body after another until its stdin ends (when the router
    stops it, or ends itself)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the router's whole group
    replies = os.dup(1)
    os.dup2(2, 1)  # anything printed goes to stderr, not into the replies
    while True:
        try:
            head_len, body_len = _REQUEST.unpack(_read(0, _REQUEST.size))
        except EOFError:
            return
        kind, max_ids = msgspec.msgpack.decode(_read(0, head_len))
        raw = _read(0, body_len)
        reply: dict[str, Any]
        try:
            reply = {"fields": decode_body(raw, kind, max_ids)}
        except APIError as e:
            reply = _refusal(e)
        except Exception as e:  # a bug: the router answers 500, as it would have here
            reply = {"failed": repr(e)}
        payload = _encode(reply)
        _write(replies, _REPLY.pack(len(payload)) + payload)


def _refusal(e: APIError) -> dict[str, Any]:
    return {"error": [e.status, e.message, e.type, e.param, e.code]}


def _encode(reply: dict[str, Any]) -> bytes:
    """``reply`` in msgpack, an integer past 64 bits as a `_WIDE_INT` extension (the fields'
    parsers then answer for it what they answer on the tokenizer thread); a 400 for a field
    nested too deep for msgpack (two levels below the field), as the parsers answer."""
    try:
        try:
            return msgspec.msgpack.encode(reply)
        except OverflowError:  # rare (a client's), so only then walked in Python
            return msgspec.msgpack.encode(_widened(reply))
    except RecursionError:
        return msgspec.msgpack.encode(_refusal(too_deep()))


def _widened(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _widened(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_widened(v) for v in value]
    if type(value) is int and not -(2**63) <= value < 2**64:
        return msgspec.msgpack.Ext(_WIDE_INT, str(value).encode())
    return value


def _ext(code: int, data: memoryview) -> int:
    if code != _WIDE_INT:
        raise msgspec.DecodeError(f"the body decoder sent an unknown extension {code}")
    return int(bytes(data))


if __name__ == "__main__":
    main()
