"""`hetero-pd bench transfer` runs end to end and ends with the promised JSON line."""

from __future__ import annotations

import json

import pytest

from hetero_pd.bench.transfer import main

KEYS = {
    "shm_gbps",
    "tcp_gbps",
    "memcpy_gbps",
    "raw_zmq_gbps",
    "tcp_vs_raw_zmq",
    "shm_vs_memcpy",
    "checksum_overhead",
    "tcp_sealed_gbps",
    "encrypt_overhead",
    "tcp_cpu_s_per_gb",
    "tcp_sealed_cpu_s_per_gb",
    "encrypt_cpu_overhead",
}


def test_bench_transfer_quick(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--tokens", "256", "--repeats", "1", "--repeat", "2"]) == 0
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    assert set(result) >= KEYS
    overheads = {"checksum_overhead", "encrypt_overhead", "encrypt_cpu_overhead"}
    assert all(result[k] > 0 for k in KEYS - overheads)
    assert result["runs"] == 2
    for ratio in ("tcp_vs_raw_zmq", "shm_vs_memcpy", "checksum_overhead", "encrypt_overhead"):
        low, high = result["spread"][ratio]
        assert low <= result[ratio] <= high
        assert f"{ratio}: median" in out
    assert result["cpu"]["model"] and "cpu:" in out
