"""Split planner: the math on synthetic profiles, and real (fast) profiling of a tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest

from edge import cli as edge_cli
from edge.codec import bytes_per_token
from edge.link_probe import measure_link, serve_link_probe
from edge.planner import (
    FRAME_OVERHEAD_BYTES,
    LinkProfile,
    SideProfile,
    format_plan,
    interpolate,
    plan_split,
    predict,
)
from edge.profiling import profile_layers, profile_runtime

MS = 1e-3


def uniform(layers: int, prefill_per_token: float, decode: float, head: float = 0.0) -> SideProfile:
    """Each layer costs `prefill_per_token` per prompt token and `decode` per decode step."""
    return SideProfile(
        seq_lens=(10, 100),
        prefill_s=((prefill_per_token * 10,) * layers, (prefill_per_token * 100,) * layers),
        decode_s=((decode,) * layers, (decode,) * layers),
        head_s=head,
    )


def test_interpolate() -> None:
    assert interpolate([10, 20], [1.0, 3.0], 15) == pytest.approx(2.0)
    assert interpolate([10, 20], [1.0, 3.0], 30) == pytest.approx(5.0)  # extrapolated
    assert interpolate([10, 20], [1.0, 3.0], 1) == pytest.approx(0.0)  # clamped at 0
    assert interpolate([10], [2.0], 5) == pytest.approx(1.0)
    assert interpolate([10], [2.0], 5, through_origin=False) == pytest.approx(2.0)


def test_prediction_adds_up() -> None:
    edge = uniform(4, 1 * MS, 2 * MS)
    cloud = uniform(4, 0.1 * MS, 0.5 * MS, head=1 * MS)
    link = LinkProfile(bandwidth_bps=1e6, rtt_s=10 * MS)
    p = predict(edge, cloud, link, 1, prompt_len=50, token_bytes=100)
    assert p.edge_prefill_s == pytest.approx(50 * MS)
    assert p.prompt_bytes == 50 * 100 + FRAME_OVERHEAD_BYTES
    assert p.link_prefill_s == pytest.approx(10 * MS + p.prompt_bytes / 1e6)
    assert p.cloud_prefill_s == pytest.approx(3 * 5 * MS + 1 * MS)
    assert p.ttft_s == pytest.approx(p.edge_prefill_s + p.link_prefill_s + p.cloud_prefill_s)
    assert p.edge_decode_s == pytest.approx(2 * MS)
    assert p.cloud_decode_s == pytest.approx(3 * 0.5 * MS + 1 * MS)
    assert p.tpot_s == pytest.approx(2 * MS + 10 * MS + (100 + 96) / 1e6 + 2.5 * MS)


def test_slow_edge_keeps_one_layer_fast_edge_takes_more() -> None:
    cloud = uniform(6, 1 * MS, 1 * MS)
    link = LinkProfile(bandwidth_bps=1e9, rtt_s=1 * MS)
    slow = plan_split(
        uniform(6, 1 * MS, 1 * MS).scaled(10), cloud, link, prompt_len=64, hidden_size=64
    )
    assert slow.best.split_layer == 1
    assert [p.split_layer for p in slow.candidates] == [1, 2, 3, 4, 5]
    # An edge faster than the cloud should run as much as it may.
    fast = plan_split(uniform(6, 0.1 * MS, 0.1 * MS), cloud, link, prompt_len=64, hidden_size=64)
    assert fast.best.split_layer == 5
    assert fast.unsplit.split_layer == 0 and fast.unsplit.edge_prefill_s == 0


def test_layer_dependent_cost_picks_the_cheap_cut() -> None:
    """The link costs the same at every k, so compute decides: the edge takes layers while
    they are cheaper there than on the cloud and stops before its costly third layer."""
    edge = SideProfile(
        seq_lens=(32,),
        prefill_s=((1 * MS, 1 * MS, 50 * MS, 1 * MS),),
        decode_s=((MS, MS, MS, MS),),
    )
    cloud = uniform(4, 2 * MS / 32, MS)
    link = LinkProfile(bandwidth_bps=1e7, rtt_s=5 * MS)
    plan = plan_split(edge, cloud, link, prompt_len=32, hidden_size=64, codec="int8")
    assert plan.best.split_layer == 2
    assert plan.best.bytes_per_token == bytes_per_token(64, "int8") + FRAME_OVERHEAD_BYTES
    assert bytes_per_token(64, "int8") == 64 + 4 + 8 * 6
    text = format_plan(plan)
    assert "recommended k=2" in text and "codec int8" in text


def test_latency_objective_weighs_decode() -> None:
    # The edge prefills fast but decodes slowly: best for TTFT is deep, for latency shallow.
    edge = uniform(4, 0.01 * MS, 5 * MS)
    cloud = uniform(4, 1 * MS, 0.1 * MS)
    link = LinkProfile(bandwidth_bps=1e9, rtt_s=0.0)
    first_token = plan_split(edge, cloud, link, prompt_len=100, hidden_size=8)
    assert first_token.best.split_layer == 3
    whole = plan_split(
        edge, cloud, link, prompt_len=100, hidden_size=8, objective="latency", output_tokens=100
    )
    assert whole.best.split_layer == 1


def test_bad_inputs() -> None:
    with pytest.raises(ValueError, match="ascending"):
        SideProfile(seq_lens=(8, 4), prefill_s=((1.0,), (1.0,)), decode_s=((1.0,), (1.0,)))
    with pytest.raises(ValueError, match="same, non-zero number"):
        SideProfile(seq_lens=(4,), prefill_s=((1.0,),), decode_s=((1.0, 2.0),))
    with pytest.raises(ValueError, match="bandwidth"):
        LinkProfile(bandwidth_bps=0, rtt_s=0)
    p = uniform(3, MS, MS)
    link = LinkProfile(1e6, 0)
    with pytest.raises(ValueError, match="disagree"):
        plan_split(p, uniform(4, MS, MS), link, prompt_len=4, hidden_size=4)
    with pytest.raises(ValueError, match="objective"):
        plan_split(p, p, link, prompt_len=4, hidden_size=4, objective="x")
    with pytest.raises(ValueError, match="outside"):
        predict(p, p, link, 3, 4, 4)


def test_profile_tiny_model_and_plan(tiny_llama_dir: Path) -> None:
    profile = profile_layers(tiny_llama_dir, "cpu", seq_lens=(8, 32), repeats=2)
    assert profile.num_layers == 3 and profile.seq_lens == (8, 32)
    assert all(t > 0 for row in (*profile.prefill_s, *profile.decode_s) for t in row)
    assert profile.head_s > 0
    slow = profile.scaled(4.0)
    assert slow.prefill(0, 3, 8) == pytest.approx(4 * profile.prefill(0, 3, 8))
    with serve_link_probe() as (host, port):
        link = measure_link(host, port, payload_bytes=1 << 16, pings=5, bulk=2)
    assert 0 < link.rtt_s < 0.1 and link.bandwidth_bps > 1e6
    plan = plan_split(slow, profile, link, prompt_len=20, hidden_size=64)
    assert plan.best.split_layer in (1, 2)
    assert "recommended k=" in format_plan(plan)


def test_profile_runtime_prices_every_split(tiny_qwen2_dir: Path) -> None:
    from edge import EdgeRuntime

    rt = EdgeRuntime(tiny_qwen2_dir, 2, max_positions=64)
    profile = profile_runtime(rt, 3, seq_lens=(8, 16), repeats=1)
    assert profile.num_layers == 3 and profile.device == "cpu (torch)"
    assert profile.prefill(0, 2, 8) > 0 and profile.decode_s[0][0] == profile.decode_s[0][2]
    assert rt.num_tokens == 0


def test_measure_link_reports_unreachable_host() -> None:
    with serve_link_probe() as (host, port):
        pass  # closed again: nothing listens there now
    with pytest.raises(ConnectionError, match=f"link probe to {host}:{port} failed"):
        measure_link(host, port, timeout_s=1.0)


def test_edge_plan_command_prices_the_link_it_is_given(
    tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`hetero-pd edge plan` for a described link: one row per split k (0 = unsplit); the link
    columns are the RTT plus the bytes over the bandwidth given; the device's layers cost
    --edge-slowdown times the cloud's; the row marked best minimizes TTFT + (output tokens
    - 1) * TPOT. Printed in milliseconds to 0.01, hence the tolerances."""
    args = "--prompt-len 20 --output-tokens 8 --codec float16 --edge-slowdown 10 --rtt-ms 10"
    assert (
        edge_cli.main(["plan", "--model", str(tiny_llama_dir), *args.split(), "--mbps", "80"]) == 0
    )
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("link: RTT 10.00 ms, 80.0 Mbit/s; device 10x this host's")
    assert lines[1] == "split planner: prompt 20 tokens, codec float16, objective latency"
    rows = {
        int(line[1:].split()[0]): [float(x) for x in line[1:].split()[1:]] for line in lines[3:-1]
    }
    assert sorted(rows) == [0, 1, 2]  # unsplit, then k = 1 .. L-1 of the tiny model's 3 layers
    token = 64 * 2  # hidden size 64 in float16
    bytes_per_ms = 80e6 / 8 / 1e3
    for k, (e_pf, l_pf, c_pf, ttft, e_dc, l_dc, c_dc, tpot) in rows.items():
        wire = 4 if k == 0 else token  # unsplit: token ids
        prompt_ms = (20 * wire + FRAME_OVERHEAD_BYTES) / bytes_per_ms
        assert l_pf == pytest.approx(10 + prompt_ms, abs=0.006), k
        assert l_dc == pytest.approx(10 + (wire + FRAME_OVERHEAD_BYTES) / bytes_per_ms, abs=0.006)
        assert ttft == pytest.approx(e_pf + l_pf + c_pf, abs=0.02), k
        assert tpot == pytest.approx(e_dc + l_dc + c_dc, abs=0.02), k
    assert rows[0][0] == rows[0][4] == 0.0  # unsplit: nothing runs on the device
    # Layer 1 runs on the device for k=2 and in the cloud for k=1: 10x the time there.
    assert rows[2][0] - rows[1][0] == pytest.approx(10 * (rows[1][2] - rows[2][2]), abs=0.12)
    assert rows[2][4] - rows[1][4] == pytest.approx(10 * (rows[1][6] - rows[2][6]), abs=0.12)
    marked = [line for line in lines[3:-1] if line.startswith("*")]
    assert len(marked) == 1
    best = int(marked[0][1:].split()[0])
    cost = {k: r[3] + 7 * r[7] for k, r in rows.items() if k}
    assert cost[best] <= min(cost.values()) + 0.16, cost
    assert lines[-1].startswith(f"recommended k={best}: predicted TTFT {rows[best][3]:.2f} ms")
    sizes = (
        f"{20 * token + FRAME_OVERHEAD_BYTES} B for the prompt, {token + FRAME_OVERHEAD_BYTES} B"
    )
    assert sizes in lines[-1]
