"""ServingMetrics: what /metrics renders, parsed back with prometheus_client's own parser."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from hetero_pd.serving.router.metrics import DECISIONS, OUTCOMES, ServingMetrics


def samples(m: ServingMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    body, content_type = m.render()
    assert content_type.startswith("text/plain; version=0.0.4")
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            labels = dict(s.labels)
            assert labels.pop("model_name") == m.model_name, "every series names the model"
            out[(s.name, tuple(sorted(labels.items())))] = s.value
    return out


def test_requests_latencies_and_tokens() -> None:
    m = ServingMetrics()
    m.observe_request(0.25, 0.05, [0.04, 0.06, 3.0], 1.5, 100, 4, "stop")
    m.observe_request(None, None, [], None, 10, 0, "abort")
    m.count_request("rejected")
    s = samples(m)
    assert s[("hetero_pd_requests_total", (("outcome", "stop"),))] == 1
    assert s[("hetero_pd_requests_total", (("outcome", "abort"),))] == 1
    assert s[("hetero_pd_requests_total", (("outcome", "rejected"),))] == 1
    assert s[("hetero_pd_requests_total", (("outcome", "error"),))] == 0  # pre-created
    assert s[("hetero_pd_time_to_first_token_seconds_count", ())] == 1
    assert s[("hetero_pd_time_to_first_token_seconds_sum", ())] == 0.25
    assert s[("hetero_pd_time_to_first_token_seconds_bucket", (("le", "0.2"),))] == 0
    assert s[("hetero_pd_time_to_first_token_seconds_bucket", (("le", "0.3"),))] == 1
    assert s[("hetero_pd_time_per_output_token_seconds_sum", ())] == 0.05
    assert s[("hetero_pd_inter_token_latency_seconds_count", ())] == 3
    assert s[("hetero_pd_inter_token_latency_seconds_bucket", (("le", "0.1"),))] == 2
    assert s[("hetero_pd_e2e_request_latency_seconds_count", ())] == 1
    assert s[("hetero_pd_prompt_tokens_total", ())] == 110
    assert s[("hetero_pd_generation_tokens_total", ())] == 4
    bounds = {
        float(dict(k[1])["le"])
        for k in s
        if k[0].startswith("hetero_pd_") and k[0].endswith("seconds_bucket") and k[1]
    }
    assert min(bounds) == 0.001 and max(b for b in bounds if b != float("inf")) == 120


def test_workers_set_replace_and_remove() -> None:
    m = ServingMetrics()
    m.set_worker("p0", "prefill", queue_depth=3, running=2, kv_usage=0.25, up=True)
    m.set_worker("d0", "decode", queue_depth=0, running=7, kv_usage=1.7, up=False)
    s = samples(m)
    p0 = (("role", "prefill"), ("worker", "p0"))
    d0 = (("role", "decode"), ("worker", "d0"))
    assert s[("hetero_pd_worker_queue_depth", p0)] == 3
    assert s[("hetero_pd_worker_running", p0)] == 2
    assert s[("hetero_pd_worker_kv_usage_ratio", p0)] == 0.25
    assert s[("hetero_pd_worker_up", p0)] == 1
    assert s[("hetero_pd_worker_kv_usage_ratio", d0)] == 1.0  # clamped to 0..1
    assert s[("hetero_pd_worker_up", d0)] == 0
    m.set_worker("p0", "colocated", queue_depth=1, running=1, kv_usage=0.5, up=True)
    s = samples(m)
    assert ("hetero_pd_worker_up", p0) not in s
    assert s[("hetero_pd_worker_up", (("role", "colocated"), ("worker", "p0")))] == 1
    m.remove_worker("p0")
    m.remove_worker("never-seen")
    s = samples(m)
    assert not any(dict(labels).get("worker") == "p0" for _, labels in s)
    assert ("hetero_pd_worker_running", d0) in s


def test_transfers_and_decisions() -> None:
    m = ServingMetrics()
    m.observe_transfer("shm", 4_000_000_000, 2.0)
    m.observe_transfer("tcp", 1_000_000, 0.004)
    m.observe_transfer("tcp", 0, 0.0)  # zero duration: counted, throughput left alone
    m.transfer_failure("TIMEOUT")
    m.transfer_failure("TIMEOUT")
    m.transfer_retry()
    m.decision("disaggregated")
    m.decision("recompute")
    s = samples(m)
    assert s[("hetero_pd_kv_transfer_bytes_total", (("transport", "shm"),))] == 4e9
    throughput = "hetero_pd_kv_transfer_throughput_bytes_per_second"
    assert s[(throughput, (("transport", "shm"),))] == pytest.approx(2e9)
    assert s[(throughput, (("transport", "tcp"),))] == pytest.approx(0.25e9)
    assert s[("hetero_pd_kv_transfer_seconds_count", (("transport", "tcp"),))] == 2
    assert s[("hetero_pd_kv_transfer_failures_total", (("code", "TIMEOUT"),))] == 2
    assert s[("hetero_pd_kv_transfer_retries_total", ())] == 1
    for name in DECISIONS:
        expected = 1 if name in ("disaggregated", "recompute") else 0
        assert s[("hetero_pd_policy_decisions_total", (("decision", name),))] == expected


def test_unknown_labels_are_refused() -> None:
    m = ServingMetrics()
    with pytest.raises(ValueError, match="unknown request outcome 'ok'"):
        m.count_request("ok")
    with pytest.raises(ValueError, match="unknown policy decision 'yolo'"):
        m.decision("yolo")
    assert set(OUTCOMES) == {"stop", "length", "abort", "rejected", "error"}


def test_separate_registries_do_not_clash() -> None:
    a, b = ServingMetrics(), ServingMetrics()  # same names, no "Duplicated timeseries" error
    a.count_request("stop")
    assert samples(a)[("hetero_pd_requests_total", (("outcome", "stop"),))] == 1
    assert samples(b)[("hetero_pd_requests_total", (("outcome", "stop"),))] == 0
    assert b"hetero_pd_" not in generate_latest(REGISTRY)


def test_vllm_named_series_for_dashboards_and_gateways() -> None:
    m = ServingMetrics(model_name="tiny")
    m.set_worker("p0", "prefill", queue_depth=4, running=1, kv_usage=0.9, up=True)
    m.set_worker("d0", "decode", queue_depth=2, running=6, kv_usage=0.5, up=True)
    m.set_worker("d1", "decode", queue_depth=1, running=3, kv_usage=0.1, up=True)
    m.set_worker("d2", "decode", queue_depth=9, running=9, kv_usage=1.0, up=False)  # down
    m.observe_request(0.3, 0.05, [], 1.0, 10, 4, "stop")
    s = samples(m)
    assert s[("vllm:num_requests_running", ())] == 1 + 6 + 3
    assert s[("vllm:num_requests_waiting", ())] == 4 + 2 + 1
    # The decode workers' mean: prefill KV only passes through.
    assert s[("vllm:kv_cache_usage_perc", ())] == pytest.approx(0.3)
    assert s[("vllm:gpu_cache_usage_perc", ())] == pytest.approx(0.3)
    assert s[("vllm:time_to_first_token_seconds_count", ())] == 1
    assert s[("vllm:time_to_first_token_seconds_bucket", (("le", "0.25"),))] == 0
    assert s[("vllm:time_to_first_token_seconds_bucket", (("le", "0.5"),))] == 1
    assert s[("vllm:time_per_output_token_seconds_sum", ())] == 0.05
    m.remove_worker("d1")
    assert samples(m)[("vllm:num_requests_running", ())] == 1 + 6


def test_names_follow_the_conventions() -> None:
    """Counters end in _total, histograms of time in _seconds, fractions in _ratio; no
    series of ours is in a derived unit (GB/s, ms)."""
    m = ServingMetrics(model_name="x")
    m.observe_transfer("shm", 10, 1.0)
    m.transfer_failure("TIMEOUT")
    body = m.render()[0].decode()
    for family in text_string_to_metric_families(body):
        if family.name.startswith("vllm:"):
            continue
        assert family.name.startswith("hetero_pd_"), family.name
        if family.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in family.samples)
        if family.type == "histogram":
            assert family.name.endswith("_seconds"), family.name
        assert not any(u in family.name for u in ("gbps", "_ms")), family.name
        if family.type == "gauge" and "usage" in family.name:
            assert family.name.endswith("_ratio"), family.name
