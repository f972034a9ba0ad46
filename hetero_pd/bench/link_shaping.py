"""A shaped link for benchmarks: a TCP proxy on loopback that adds bandwidth, delay and loss
between a client (the device) and a server (the router), both ways.

The kernel's own shaper (`tc qdisc ... netem` in a network namespace) is the first choice,
but a kernel without `sch_netem` refuses it (`netem_unavailable` says why); this proxy is
the fallback and what `hetero-pd bench edge --link` uses. Its model of a link, per
direction, shared by every connection through it::

    a chunk of n bytes enters when the link is free, occupies it n / bandwidth seconds,
    and arrives one-way delay (RTT / 2) after it has left; each MSS-sized segment is lost
    with probability `loss`, and a lost segment arrives a retransmission later
    (2 x RTT, Linux's tail-loss probe, at least 10 ms), holding back all behind it, as
    TCP delivers in order.

It runs in a thread with its own event loop; `with shaped_link(host, port, spec) as (h, p)`
yields the address to connect to instead of (host, port).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import random
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import urlsplit

MSS = 1448  # TCP payload per Ethernet segment with timestamps


@dataclass(frozen=True, slots=True)
class LinkSpec:
    """A link to emulate: bandwidth (bytes/s, each way), round-trip time, segment loss."""

    name: str
    bandwidth_bps: float
    rtt_s: float
    loss: float = 0.0

    def __post_init__(self) -> None:
        if self.bandwidth_bps <= 0 or self.rtt_s < 0 or not 0 <= self.loss < 1:
            raise ValueError(f"link {self.name!r}: bandwidth > 0, rtt >= 0, 0 <= loss < 1")

    def describe(self) -> str:
        mbit = self.bandwidth_bps * 8 / 1e6
        return f"{mbit:g} Mbit/s, {self.rtt_s * 1e3:g} ms RTT, {self.loss * 100:g}% loss"


LINKS = {
    "lan": LinkSpec("lan", 1e9 / 8, 0.5e-3),
    "50mbit-20ms": LinkSpec("50mbit-20ms", 50e6 / 8, 0.020),
    "10mbit-40ms-1pct": LinkSpec("10mbit-40ms-1pct", 10e6 / 8, 0.040, 0.01),
}


class LinkClock:
    """One direction's schedule: when each chunk arrives (pure arithmetic, seeded)."""

    def __init__(self, spec: LinkSpec, seed: int) -> None:
        self.spec = spec
        self.free_at = 0.0  # when the link finishes sending what it holds
        self.last_arrival = 0.0
        self.rng = random.Random(seed)
        self.lost_segments = 0

    def arrival(self, now: float, nbytes: int) -> float:
        s = self.spec
        self.free_at = max(now, self.free_at) + nbytes / s.bandwidth_bps
        lost = sum(self.rng.random() < s.loss for _ in range(math.ceil(nbytes / MSS)))
        self.lost_segments += lost
        retransmit = lost * max(2 * s.rtt_s, 0.010)
        arrive = self.free_at + s.rtt_s / 2 + retransmit
        self.last_arrival = max(arrive, self.last_arrival)  # in order, as TCP delivers
        return self.last_arrival


class ShapedLink:
    """The proxy; see the module docstring. `start()` then `address`; `close()` ends it."""

    def __init__(self, target: tuple[str, int], spec: LinkSpec, seed: int = 0) -> None:
        self.target, self.spec = target, spec
        self.up, self.down = LinkClock(spec, seed), LinkClock(spec, seed + 1)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="shaped-link")
        self.server: asyncio.base_events.Server | None = None
        self.tasks: set[asyncio.Task[None]] = set()
        self.address = ("127.0.0.1", 0)

    def start(self) -> tuple[str, int]:
        self.thread.start()
        fut = asyncio.run_coroutine_threadsafe(self._listen(), self.loop)
        self.address = fut.result(timeout=10)
        return self.address

    async def _listen(self) -> tuple[str, int]:
        self.server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        host, port = self.server.sockets[0].getsockname()[:2]
        return str(host), int(port)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        pumps = [
            asyncio.ensure_future(self._pump(reader, up_w, self.up)),
            asyncio.ensure_future(self._pump(up_r, writer, self.down)),
        ]
        self.tasks.update(pumps)
        await asyncio.wait(pumps)  # each ends at its side's EOF (passed on) or error
        self.tasks.difference_update(pumps)
        for w in (writer, up_w):
            w.close()

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, clock: LinkClock
    ) -> None:
        """Reads chunks as they come and writes each at its arrival time, in order."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                at, data = await queue.get()
                if not data:
                    return
                await asyncio.sleep(max(0.0, at - loop.time()))  # the emulated link's delay
                writer.write(data)
                await writer.drain()

        sender = asyncio.ensure_future(deliver())
        try:
            while data := await reader.read(65536):
                queue.put_nowait((clock.arrival(loop.time(), len(data)), data))
            queue.put_nowait((0.0, b""))
            await sender
            if writer.can_write_eof():
                writer.write_eof()  # a half-close travels on, after the data before it
        except OSError:
            writer.close()  # a reset on one side closes the other: its pump then ends too
        finally:
            sender.cancel()

    def close(self) -> None:
        if not self.thread.is_alive():
            return

        async def stop() -> None:
            if self.server is not None:
                self.server.close()
            for task in list(self.tasks):
                task.cancel()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


@contextlib.contextmanager
def shaped_link(host: str, port: int, spec: LinkSpec, seed: int = 0) -> Iterator[ShapedLink]:
    link = ShapedLink((host, port), spec, seed)
    link.start()
    try:
        yield link
    finally:
        link.close()


@contextlib.contextmanager
def via(url: str, spec: LinkSpec | None) -> Iterator[str]:
    """`url` (http://host:port) reached through a shaped link, or as is when spec is None."""
    if spec is None:
        yield url
        return
    parts = urlsplit(url)
    with shaped_link(parts.hostname or "127.0.0.1", parts.port or 80, spec) as link:
        host, port = link.address
        yield f"{parts.scheme}://{host}:{port}{parts.path}"


def netem_unavailable() -> str | None:
    """Why `tc qdisc add ... netem` cannot shape a link here (tried on a veth pair inside a
    namespace made and removed for the probe), or None when it can."""
    ns = f"hpd-{os.getpid()}-netem-probe"

    def run(*cmd: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=10)

    try:
        made = run("ip", "netns", "add", ns)
    except FileNotFoundError as e:
        return f"`{e.filename}` is not installed (iproute2)"
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    try:
        run("ip", "-n", ns, "link", "add", "a0", "type", "veth", "peer", "name", "b0")
        tc = run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "a0", "root", "netem",
                 "delay", "1ms")  # fmt: skip
        if tc.returncode != 0:
            return f"the kernel refuses netem: {tc.stderr.strip() or tc.stdout.strip()}"
        return None
    finally:
        run("ip", "netns", "del", ns)
