"""`hetero-pd bench kv wire`: KV bytes on the TCP wire raw vs int8, and what int8 costs.

Two transfer engines in this process, linked over loopback TCP (the data channel, checksums
on, as shipped), push the default model's KV layout (30 layers x K,V x 3 KV heads x 64
dims, block size 16, float32) for each token count, raw (`kv_codec: none`) and int8
(`kv_codec: int8`) interleaved; reported per count: bytes the sender put on the wire and the
median push time of each. Then the int8 codec's teacher-forced top-1 agreement on the
default model (`hetero_pd.engine.kv_codec_agreement`; `--no-agreement` skips it). On
loopback the wire is nearly free, so times here show the codec's CPU cost; on a real link the
bytes ratio is what a transfer saves. The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

from hetero_pd.bench.machine import cpu_info
from transfer import KVRegion, TransferConfig, TransferEngine, TransferState
from transfer.testing import fill

LAYERS, HEADS, HEAD_DIM, BLOCK = 30, 3, 64, 16
CODECS = ("none", "int8")
SECRET = b"bench-kv-wire"


class Link:
    """A sender and a receiver engine for one codec, linked over loopback TCP."""

    def __init__(self, codec: str, num_blocks: int) -> None:
        cfg = TransferConfig(secret=SECRET, transports=("tcp",), kv_codec=codec)
        self.src = TransferEngine(f"wire-p-{codec}", "prefill", cfg)
        self.dst = TransferEngine(f"wire-d-{codec}", "decode", cfg)
        shape = (BLOCK, HEADS, HEAD_DIM)
        region = KVRegion.allocate("kv", LAYERS, num_blocks, shape)
        fill(region, 1)
        self.src.register_region(region)
        self.dst.register_region(KVRegion.allocate("kv", LAYERS, num_blocks, shape))
        self.src.link(self.dst.engine_id, self.dst.address)
        self.pushes = 0

    def push(self, n: int) -> tuple[int, float]:
        """Bytes sent and seconds for one push of blocks ``[0, n)``."""
        self.pushes += 1
        rid = f"r{self.pushes}"
        recv = self.dst.reserve(rid, list(range(n)), writer=self.src.engine_id)
        assert recv.blocks is not None
        before = self._sent()
        t0 = time.perf_counter()
        h = self.src.push_blocks(self.dst.engine_id, list(range(n)), recv.blocks)
        if h.wait(300) is not TransferState.DONE:
            raise RuntimeError(f"push failed: {h.error}")
        seconds = time.perf_counter() - t0
        self.dst.release(rid)
        return self._sent() - before, seconds

    def _sent(self) -> int:
        return self.src.metrics().transport("tcp").bytes_sent_total

    def close(self) -> None:
        self.src.close()
        self.dst.close()


def measure(tokens: list[int], repeats: int) -> list[dict[str, Any]]:
    """One row per token count: wire bytes and median push seconds per codec."""
    most = max(-(-t // BLOCK) for t in tokens)
    links = {codec: Link(codec, most) for codec in CODECS}
    rows = []
    try:
        for t in tokens:
            n = -(-t // BLOCK)
            for link in links.values():
                link.push(n)  # warm-up
            sent: dict[str, int] = {}
            times: dict[str, list[float]] = {c: [] for c in CODECS}
            for _ in range(repeats):  # interleaved: drift hits both alike
                for codec, link in links.items():
                    sent[codec], seconds = link.push(n)
                    times[codec].append(seconds)
            row: dict[str, Any] = {"tokens": t}
            for codec in CODECS:
                row[f"{codec}_mb"] = round(sent[codec] / 1e6, 3)
                row[f"{codec}_ms"] = round(1000 * statistics.median(times[codec]), 1)
            row["bytes_ratio"] = round(sent["int8"] / sent["none"], 4)
            row["time_ratio"] = round(row["int8_ms"] / row["none_ms"], 3)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
    finally:
        for link in links.values():
            link.close()
    return rows


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hetero-pd bench kv wire", description=__doc__)
    p.add_argument("--tokens", default="1024,4096", help="comma-separated prompt lengths")
    p.add_argument("--repeat", type=int, default=3, help="pushes per codec and length")
    p.add_argument("--model", default="smollm2-135m-instruct", help="for the agreement")
    p.add_argument("--no-agreement", action="store_true", help="skip the model agreement")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    tokens = [int(t) for t in args.tokens.split(",") if t]
    report: dict[str, Any] = {
        "cpu": cpu_info(),
        "layout": f"{LAYERS} layers x K,V x {HEADS} heads x {HEAD_DIM} dims, block {BLOCK}, "
        "float32",
        "rows": measure(tokens, args.repeat),
    }
    if not args.no_agreement:
        from hetero_pd.engine.kv_codec_agreement import kv_codec_agreement

        report["agreement"] = kv_codec_agreement(args.model, "int8").to_dict()
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
