"""``hetero-pd bench hostile``: how long /health waits while hostile bodies arrive, with the
router in a process of its own.

The router (``hetero-pd serve MODEL --colocated``, started here, or every ``--url`` given)
runs alone in its process; this process sends the hostile bodies, one at a time, and a
third process probes ``GET /health`` back to back (a new connection each time, as a load
balancer's probe does), so neither the client nor the prober shares the router's GIL. The
bodies are the ones the hostile-API tests send (`shapes`): 16 MiB of integers on five
routes, a 20,000-message chat, megabyte and 16 MiB text prompts, a stop-string flood, 16 MiB
of one key repeated, JSON nested 200,000 deep, and four 16 MiB bodies at once; and edge
sessions' first messages (`edge_start`): one and four at once at the 16 MiB bound, and one
of 64 MiB (the bound before issue 27's third round), refused by its announced length.

Each round sends every shape to every server in turn (servers and shapes taking turns, so a
load that changes during the run weighs on all of them), with an idle window first. Per
server and shape it prints the probes that overlapped the body's send-to-answer window, their
p99 and worst latency (ms), the median of each round's worst, and the answers the body got.
The last stdout line is one JSON object with the machine and the load.

    hetero-pd bench hostile [--model smollm2-135m-instruct] [--rounds 5]
    hetero-pd bench hostile --url old=http://127.0.0.1:8001 --url new=http://127.0.0.1:8002
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import multiprocessing
import os
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import msgspec

from hetero_pd.bench.health_probe import probe
from hetero_pd.bench.machine import cpu_info
from hetero_pd.models.fetch import DEFAULT_MODEL
from hetero_pd.serving.api.edge_protocol import MAX_MESSAGE_BYTES as EDGE_MESSAGE_BYTES
from hetero_pd.serving.api.edge_protocol import PATH as EDGE_PATH

#: The API's largest body (aiohttp's client_max_size) less what the rest of a request needs.
SIXTEEN_MIB_OF_INTS = b"[" + b"1," * (8 * 2**20 - 256) + b"1]"
#: What the bar is: /health answered within this while any of these bodies arrives.
BAR_MS = 100.0
IDLE_S = 1.0


@dataclass(frozen=True, slots=True)
class Shape:
    """One hostile request (or several sent at once): route and body each."""

    name: str
    posts: tuple[tuple[str, bytes], ...]


def shapes(model: str) -> list[Shape]:
    m = json.dumps(model).encode()
    ints = SIXTEEN_MIB_OF_INTS
    many = json.dumps([{"role": "user", "content": ""}] * 20_000).encode()
    chat = b'{"model": %s, "messages": %s, "max_tokens": 1}' % (m, many)
    text = json.dumps("hello world " * 150_000).encode()
    big_text = json.dumps("hello world " * (16 * 2**20 // 12 - 64)).encode()
    stops = json.dumps(["x" * 16384] * 1000).encode()
    depth = 200_000
    four = (
        ("/v1/completions", b'{"model": %s, "prompt": %s}' % (m, ints)),
        ("/tokenize", b'{"prompt": %s}' % ints),
        ("/tokenize", b'{"prompt": "hi", "unknown": %s}' % ints),
        ("/detokenize", b'{"tokens": %s}' % ints),
    )
    return [
        Shape("completions-16MiB-ints", four[:1]),
        Shape("tokenize-16MiB-ints", four[1:2]),
        Shape("tokenize-unknown-16MiB", four[2:3]),
        Shape("detokenize-16MiB-ints", four[3:]),
        Shape("four-16MiB-at-once", four),
        Shape(
            "embeddings-16MiB-ints",
            (("/v1/embeddings", b'{"model": %s, "input": %s}' % (m, ints)),),
        ),
        Shape("chat-20000-messages", (("/v1/chat/completions", chat),)),
        Shape("tokenize-chat-20000", (("/tokenize", chat),)),
        Shape("completions-1.8MB-text", (("/v1/completions", _prompt(m, text)),)),
        Shape("completions-16MiB-text", (("/v1/completions", _prompt(m, big_text)),)),
        Shape(
            "completions-16MB-stops",
            (("/v1/completions", b'{"model": %s, "prompt": "hi", "stop": %s}' % (m, stops)),),
        ),
        Shape(
            "completions-16MiB-one-key",
            (("/v1/completions", _prompt(m, b'"hi"' + b', "n": 1' * (16 * 2**20 // 8 - 64))),),
        ),
        Shape(
            "completions-nested-200k",
            (("/v1/completions", _prompt(m, b"[" * depth + b"]" * depth)),),
        ),
        *_edge_shapes(),
    ]


def edge_start(size: int) -> bytes:
    """An edge session's `start` message of about `size` bytes of hidden states, for a model
    the router does not serve (it is answered `model_not_found` once decoded); encoded
    directly, as a device that skips `edge_protocol.pack`'s bound would."""
    width = 576
    rows = (size - 4096) // (2 * width)
    frame = {"version": 1, "dtype": "float16", "shape": [rows, width], "scale": b""}
    frame |= {"data": b"\1" * (2 * width * rows), "outliers": 0}
    frame |= {"outlier_index": b"", "outlier_value": b""}
    fields = {"model": "not-served", "split_layer": 2, "fingerprint": "f", "params": {}}
    return msgspec.msgpack.encode({"t": "start", "v": 1, **fields, "prompt": frame})


def _edge_shapes() -> list[Shape]:
    start, past = edge_start(EDGE_MESSAGE_BYTES), edge_start(4 * EDGE_MESSAGE_BYTES)
    return [
        Shape("edge-16MiB-start", ((EDGE_PATH, start),)),
        Shape("four-edge-16MiB-at-once", ((EDGE_PATH, start),) * 4),
        Shape("edge-64MiB-start", ((EDGE_PATH, past),)),
    ]


def _prompt(model: bytes, prompt: bytes) -> bytes:
    return b'{"model": %s, "prompt": %s, "max_tokens": 1}' % (model, prompt)


def send(url: str, posts: tuple[tuple[str, bytes], ...]) -> list[int]:
    """Sends each body (all but their last bytes first, then the last bytes together, as the
    tests do), reads every answer; their statuses. Edge messages go each over a session of
    its own, all at once (`send_edge`)."""
    if all(path == EDGE_PATH for path, _ in posts):
        return asyncio.run(send_edge(url, [body for _, body in posts]))
    conns = start_posts(url, posts, timeout_s=300)
    try:
        for conn, (_, body) in zip(conns, posts, strict=True):
            conn.send(body[-1:])
        statuses = []
        for conn in conns:
            resp = conn.getresponse()
            resp.read()
            statuses.append(resp.status)
        return statuses
    finally:
        for conn in conns:
            conn.close()


def start_posts(
    url: str, posts: tuple[tuple[str, bytes], ...] | list[tuple[str, bytes]], timeout_s: float
) -> list[http.client.HTTPConnection]:
    """A connection per (path, body) to `url`, each POST sent but its body's last byte: the
    bodies then arrive together when the caller sends those bytes."""
    parts = urlsplit(url)
    conns = []
    try:
        for path, body in posts:
            conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=timeout_s)
            conns.append(conn)
            conn.putrequest("POST", path)
            conn.putheader("Content-Type", "application/json")
            conn.putheader("Content-Length", str(len(body)))
            conn.endheaders()
            conn.send(body[:-1])
    except BaseException:
        for conn in conns:
            conn.close()
        raise
    return conns


async def send_edge(url: str, messages: list[bytes]) -> list[int]:
    """Sends each message as the first of an edge session (API key "unused": a router with
    keys refuses it before the upgrade); per session, 101 when the router answered it over
    the session, else the WebSocket close code (1009: refused by its size, unread)."""
    import aiohttp

    async def one(session: aiohttp.ClientSession, message: bytes) -> int:
        headers = {"Authorization": "Bearer unused"}
        async with session.ws_connect(url + EDGE_PATH, headers=headers, max_msg_size=0) as ws:
            with contextlib.suppress(ConnectionError):  # refused while it is sent
                await ws.send_bytes(message)
            answer = await ws.receive(timeout=300)
            return 101 if answer.type == aiohttp.WSMsgType.BINARY else int(ws.close_code or 0)

    async with aiohttp.ClientSession() as session:
        return list(await asyncio.gather(*(one(session, m) for m in messages)))


@dataclass(slots=True)
class Result:
    """One server's probes during one shape's windows, over the rounds."""

    latencies_ms: list[float] = field(default_factory=list)
    round_worst_ms: list[float] = field(default_factory=list)
    answers: set[int] = field(default_factory=set)
    bad_probes: int = 0

    def summary(self) -> dict[str, Any]:
        lat = sorted(self.latencies_ms)
        p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else float("nan")
        return {
            "probes": len(lat),
            "p99_ms": round(p99, 1),
            "worst_ms": round(max(lat, default=float("nan")), 1),
            "median_round_worst_ms": round(statistics.median(self.round_worst_ms), 1)
            if self.round_worst_ms
            else float("nan"),
            "over_bar": sum(x > BAR_MS for x in lat),
            "answers": sorted(self.answers),
            "failed_probes": self.bad_probes,
        }


def run(targets: dict[str, str], shape_list: list[Shape], rounds: int) -> dict[str, Any]:
    windows: list[tuple[str, str, float, float]] = []  # (server, shape, start, end)
    answers: dict[tuple[str, str], set[int]] = {}
    ctx = multiprocessing.get_context("spawn")
    probes: dict[str, list[tuple[float, float, int]]] = {}
    with contextlib.ExitStack() as stack:
        stops, pipes, procs = {}, {}, {}
        ready = {name: ctx.Event() for name in targets}
        for name, url in targets.items():
            stops[name] = ctx.Event()
            pipes[name], child = ctx.Pipe(duplex=False)
            args = (url, ready[name], stops[name], child)
            procs[name] = ctx.Process(target=probe, args=args, daemon=True)
            procs[name].start()
            stack.callback(procs[name].join, 30)
            stack.callback(stops[name].set)
        for name in targets:  # every prober answered before the first window
            if not ready[name].wait(120):
                raise RuntimeError(f"the /health prober of {name} got no answer in 120 s")
        for r in range(rounds):
            for name, url in targets.items():
                start = time.monotonic()
                time.sleep(IDLE_S)
                windows.append((name, "idle", start, time.monotonic()))
                for shape in shape_list:
                    start = time.monotonic()
                    got = send(url, shape.posts)
                    windows.append((name, shape.name, start, time.monotonic()))
                    answers.setdefault((name, shape.name), set()).update(got)
            print(f"round {r + 1}/{rounds} done", file=sys.stderr)
        for name in targets:
            stops[name].set()
            probes[name] = pipes[name].recv()
    results: dict[tuple[str, str], Result] = {}
    for server, shape_name, start, end in windows:
        res = results.setdefault((server, shape_name), Result())
        res.answers |= answers.get((server, shape_name), set())
        during = [(lat, st) for s, lat, st in probes[server] if s < end and s + lat > start]
        res.latencies_ms += [lat * 1e3 for lat, _ in during]
        res.bad_probes += sum(st != 200 for _, st in during)
        if during:
            res.round_worst_ms.append(max(lat for lat, _ in during) * 1e3)
    return {f"{server}/{shape}": res.summary() for (server, shape), res in results.items()}


@contextlib.contextmanager
def served(model: str, argv: list[str]) -> Iterator[str]:
    from hetero_pd.deploy.testing import serve_process

    args = [model, "--colocated", "--port", "0", "--no-calibrate", *argv]
    with serve_process(args, 600.0, fork=False) as (proc, url):  # measured: as users start it
        try:
            yield url
        finally:
            proc.terminate()
            proc.wait(60)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hetero-pd bench hostile", description=__doc__)
    ap.add_argument(
        "--url",
        action="append",
        default=[],
        metavar="[NAME=]URL",
        help="a running server to probe (repeatable); default: serve --model here",
    )
    ap.add_argument("--model", default=DEFAULT_MODEL, help="served (or sent, with --url)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--shapes", help="comma-separated shape names (default: all)")
    args = ap.parse_args(argv)
    shape_list = shapes(args.model)
    if args.shapes:
        wanted = args.shapes.split(",")
        unknown = set(wanted) - {s.name for s in shape_list}
        if unknown:
            ap.error(f"unknown shapes {sorted(unknown)}; known: {[s.name for s in shape_list]}")
        shape_list = [s for s in shape_list if s.name in wanted]
    load = [os.getloadavg()]
    with contextlib.ExitStack() as stack:
        if args.url:
            targets = dict(u.split("=", 1) if "=" in u else (u, u) for u in args.url)
        else:
            targets = {"router": stack.enter_context(served(args.model, []))}
        out = run(targets, shape_list, args.rounds)
    load.append(os.getloadavg())
    print(f"{'server/shape':<44} {'probes':>6} {'p99':>8} {'worst':>8} {'med.worst':>9} "
          f"{'>100ms':>6}  answers")  # fmt: skip
    for key, s in out.items():
        print(
            f"{key:<44} {s['probes']:>6} {s['p99_ms']:>8} {s['worst_ms']:>8} "
            f"{s['median_round_worst_ms']:>9} {s['over_bar']:>6}  {s['answers']}"
        )
    loads = [" ".join(f"{x:.2f}" for x in la) for la in load]
    print(f"load average before: {loads[0]}; after: {loads[1]}")
    print(json.dumps({"machine": cpu_info(), "load": loads, "rounds": args.rounds, "results": out}))
    return 0
