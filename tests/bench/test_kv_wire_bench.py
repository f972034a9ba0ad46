"""`hetero-pd bench kv wire`: bytes on the wire raw vs int8, measured through real engines."""

from __future__ import annotations

import json

import pytest

from hetero_pd.cli import main


def test_kv_wire_reports_the_bytes_each_codec_put_on_the_wire(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["bench", "kv", "wire", "--tokens", "40", "--repeat", "1", "--no-agreement"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    (row,) = report["rows"]
    # 3 blocks x 60 tensors x 16 tokens x 3 heads x 64 dims: 4 bytes each raw; 1 byte each
    # plus a float32 per token and head in int8
    values = 3 * 60 * 16 * 3 * 64
    assert row["none_mb"] == pytest.approx(values * 4 / 1e6, abs=1e-3)
    assert row["int8_mb"] == pytest.approx((values + values // 64 * 4) / 1e6, abs=1e-3)
    assert row["bytes_ratio"] == pytest.approx(1.0625 / 4, abs=1e-4)
    assert report["cpu"]["cores"] and "agreement" not in report
