"""The bench's shaped link: its schedule (bandwidth, delay, loss, order) as arithmetic, the
proxy carrying bytes intact both ways on loopback, and whether the kernel offers netem."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess

import pytest

from hetero_pd.bench.link_shaping import LINKS, MSS, LinkClock, LinkSpec, netem_unavailable, via


def test_clock_serializes_delays_and_keeps_order() -> None:
    clock = LinkClock(LinkSpec("t", bandwidth_bps=1e6, rtt_s=0.02), seed=0)
    assert clock.arrival(0.0, 1000) == pytest.approx(0.001 + 0.01)
    # Sent while the link is busy: it waits for the first chunk to leave.
    assert clock.arrival(0.0005, 2000) == pytest.approx(0.003 + 0.01)
    assert clock.arrival(1.0, 0) == pytest.approx(1.01)
    lossy = LinkClock(LinkSpec("l", bandwidth_bps=1e6, rtt_s=0.02, loss=0.999), seed=0)
    first = lossy.arrival(0.0, 3 * MSS)  # three segments, each lost once: 3 retransmissions
    assert first == pytest.approx(3 * MSS / 1e6 + 0.01 + 3 * 0.04)
    assert lossy.lost_segments == 3
    assert LinkClock(LinkSpec("l", 1e6, 0.02, 0.999), 0).arrival(0, 0) == pytest.approx(0.01)
    # A chunk sent later but not delayed by loss still arrives after the earlier one.
    mixed = LinkClock(LinkSpec("m", 1e9, 0.02, 0.5), seed=3)
    times = [mixed.arrival(i * 1e-4, MSS) for i in range(50)]
    assert times == sorted(times) and mixed.lost_segments > 0


def test_bad_specs_are_refused() -> None:
    with pytest.raises(ValueError, match="loss"):
        LinkSpec("x", 1e6, 0.01, loss=1.0)
    assert LINKS["10mbit-40ms-1pct"].describe() == "10 Mbit/s, 40 ms RTT, 1% loss"


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(65536):
        writer.write(data[::-1])
        await writer.drain()
    writer.close()


def test_proxy_carries_bytes_both_ways() -> None:
    payload = os.urandom(200_000)

    async def run() -> bytes:
        server = await asyncio.start_server(_echo, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        spec = LinkSpec("fast", 1e9, 0.002, loss=0.05)
        with via(f"http://127.0.0.1:{port}", spec) as url:
            host, _, shaped = url.removeprefix("http://").partition(":")
            assert int(shaped) != port
            reader, writer = await asyncio.open_connection(host, int(shaped))
            writer.write(payload[:1000])
            await writer.drain()
            first = await asyncio.wait_for(reader.readexactly(1000), 30)
            writer.write(payload[1000:])
            writer.write_eof()
            rest = await asyncio.wait_for(reader.read(), 30)
            writer.close()
        server.close()
        await server.wait_closed()
        return first + rest

    got = asyncio.run(run())
    assert got[:1000] == payload[:1000][::-1] and len(got) == len(payload)


def test_netem_probe_cleans_up() -> None:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("the netem probe needs root and iproute2")
    reason = netem_unavailable()
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    assert f"hpd-{os.getpid()}-netem-probe" not in left.stdout
    if reason is not None:
        pytest.skip(f"the bench shapes links with its proxy here: {reason}")
