"""``hetero-pd bench transfer``: KV transfer throughput, side by side with raw baselines.

Two processes on this host: this one sends, a spawned child receives. For each token count
the default model's KV (30 layers x K,V x 3 KV heads x 64 dims, block size 16, float32) is
pushed through our shm and tcp transports, and the same bytes through a raw tensor copy and
a raw pyzmq PUSH/PULL (4 MiB zero-copy frames). The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
from multiprocessing.connection import Connection
from typing import Any

import torch
import zmq

from transfer import EngineConfig, KVRegion, RemoteBlocks, TransferEngine, TransferState
from transfer.layout import as_bytes

LAYERS, KV, HEADS, HEAD_DIM, BLOCK = 30, 2, 3, 64, 16
CHUNK = 4 << 20


def _receiver(conn: Connection, num_blocks: int, secret: bytes) -> None:
    """Child process: a decode-side engine plus a raw PULL socket, driven over ``conn``."""
    torch.set_num_threads(1)
    engine = TransferEngine("bench-d", "decode", EngineConfig(secret=secret))
    region = KVRegion.allocate("kv", LAYERS, num_blocks, (BLOCK, HEADS, HEAD_DIM), shared=True)
    engine.register_region(region)
    pull: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, 0)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    conn.send((engine.address, port))
    try:
        while True:
            cmd, arg = conn.recv()
            if cmd == "reserve":
                rid, n = arg
                blocks = engine.reserve(rid, list(range(n))).blocks
                assert blocks is not None
                conn.send(blocks.to_wire())
            elif cmd == "release":
                engine.release(arg)
                conn.send(True)
            elif cmd == "raw":
                got = 0
                while got < arg:
                    got += len(pull.recv(copy=False))
                conn.send(got)
            elif cmd == "stop":
                break
    finally:
        pull.close(0)
        engine.close()


def _push(
    engine: TransferEngine, conn: Connection, n: int, transport: str, checksum: bool, tag: str
) -> float:
    conn.send(("reserve", (tag, n)))
    blocks = RemoteBlocks.from_wire(conn.recv())
    t0 = time.perf_counter()
    h = engine.push_blocks("bench-d", range(n), blocks, transport=transport, checksum=checksum)
    if h.wait(120) is not TransferState.DONE:
        raise RuntimeError(f"{transport} push failed: {h.error}")
    dt = time.perf_counter() - t0
    conn.send(("release", tag))
    conn.recv()
    return dt


def _raw_zmq(push: zmq.Socket[bytes], conn: Connection, payload: torch.Tensor) -> float:
    view = as_bytes(payload)
    t0 = time.perf_counter()
    conn.send(("raw", len(view)))
    for off in range(0, len(view), CHUNK):
        push.send(view[off : off + CHUNK], copy=False)
    conn.recv()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print a table then one JSON line. Returns the exit code."""
    ap = argparse.ArgumentParser(prog="hetero-pd bench transfer", description=__doc__)
    ap.add_argument(
        "--tokens",
        type=int,
        nargs="+",
        default=[1024, 4096, 8192],
        help="token counts to move (default: 1024 4096 8192; up to 32768)",
    )
    ap.add_argument("--repeats", type=int, default=3, help="runs per measurement (median)")
    args = ap.parse_args(argv)
    max_blocks = max(-(-t // BLOCK) for t in args.tokens)
    secret = b"bench"
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(child, max_blocks, secret), daemon=True)
    proc.start()
    engine = TransferEngine("bench-p", "prefill", EngineConfig(secret=secret))
    push: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, 0)
    rows: list[dict[str, Any]] = []
    try:
        if not parent.poll(60):
            raise RuntimeError("receiver process did not start")
        address, raw_port = parent.recv()
        push.connect(f"tcp://127.0.0.1:{raw_port}")
        src = KVRegion.allocate("kv", LAYERS, max_blocks, (BLOCK, HEADS, HEAD_DIM))
        for t in src.tensors:
            t.uniform_()
        engine.register_region(src)
        engine.link("bench-d", address)
        for tokens in args.tokens:
            rows.append(_measure(engine, parent, push, src, tokens, args.repeats))
            r = rows[-1]
            print(
                f"{tokens:>6} tokens {r['mb']:8.1f} MB  shm {r['shm']:6.2f}  tcp {r['tcp']:6.2f}"
                f"  tcp(no ck) {r['tcp_nock']:6.2f}  memcpy {r['memcpy']:6.2f}"
                f"  raw zmq {r['raw_zmq']:6.2f}  GB/s",
                flush=True,
            )
        parent.send(("stop", None))
    finally:
        push.close(0)
        engine.close()
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    summary = _summarize(rows)
    print(json.dumps(summary))
    return 0


def _measure(
    engine: TransferEngine,
    conn: Connection,
    push: zmq.Socket[bytes],
    src: KVRegion,
    tokens: int,
    repeats: int,
) -> dict[str, Any]:
    n = -(-tokens // BLOCK)
    nbytes = n * src.block_bytes * len(src.tensors)
    flat_src = torch.empty(nbytes // 4, dtype=torch.float32).uniform_()
    flat_dst = torch.empty_like(flat_src)
    times: dict[str, list[float]] = {k: [] for k in ("shm", "tcp", "tcp_nock", "memcpy", "raw_zmq")}
    _push(engine, conn, n, "shm", False, "warm-shm")
    _push(engine, conn, n, "tcp", True, "warm-tcp")
    for i in range(repeats):  # interleaved, so drift hits every variant alike
        times["shm"].append(_push(engine, conn, n, "shm", False, f"s{tokens}-{i}"))
        times["tcp"].append(_push(engine, conn, n, "tcp", True, f"t{tokens}-{i}"))
        times["tcp_nock"].append(_push(engine, conn, n, "tcp", False, f"n{tokens}-{i}"))
        t0 = time.perf_counter()
        flat_dst.copy_(flat_src)
        times["memcpy"].append(time.perf_counter() - t0)
        times["raw_zmq"].append(_raw_zmq(push, conn, flat_src))
    row: dict[str, Any] = {"tokens": tokens, "mb": nbytes / 1e6, "bytes": nbytes}
    for key, ts in times.items():
        row[key] = nbytes / statistics.median(ts) / 1e9
    return row


def _summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def total(key: str) -> float:  # bytes-weighted: total bytes / total median time
        return sum(r["bytes"] for r in rows) / sum(r["bytes"] / (r[key] * 1e9) for r in rows) / 1e9

    shm, tcp, nock = total("shm"), total("tcp"), total("tcp_nock")
    memcpy, raw = total("memcpy"), total("raw_zmq")
    return {
        "shm_gbps": round(shm, 3),
        "tcp_gbps": round(tcp, 3),
        "tcp_nochecksum_gbps": round(nock, 3),
        "memcpy_gbps": round(memcpy, 3),
        "raw_zmq_gbps": round(raw, 3),
        "tcp_vs_raw_zmq": round(tcp / raw, 3),
        "shm_vs_memcpy": round(shm / memcpy, 3),
        "checksum_overhead": round(max(nock / tcp - 1.0, 0.0), 3),
        "tokens": [r["tokens"] for r in rows],
        "layout": "30 layers x K,V x 3 heads x 64 dims, block 16, float32",
    }


if __name__ == "__main__":
    raise SystemExit(main())
