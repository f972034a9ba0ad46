"""`hetero-pd bench pd` on the tiny model: the final JSON line, and the placement rules that
keep its comparison fair."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from hetero_pd.bench import pd
from hetero_pd.bench.pd import deployment, main, parse_args, pin_process, router_placements
from hetero_pd.bench.pd_report import ratios
from hetero_pd.bench.pd_run import DECISIONS
from hetero_pd.deploy.launcher import worker_configs

pytestmark = pytest.mark.timeout(600)


def test_every_worker_core_gets_a_placement_of_the_router() -> None:
    assert router_placements([], [0, 1]) == [[0], [1]]
    assert router_placements([], [3]) == [[3]]
    assert router_placements(["2", "0,1"], [0, 1]) == [[2], [0, 1]]
    # The short run: the router beside the decode worker (pd mode's second core) only.
    assert router_placements([], [4, 7], every=False) == [[7]]
    assert router_placements([], [3], every=False) == [[3]]
    assert router_placements(["2"], [0, 1], every=False) == [[2]]


def test_the_default_run_is_the_short_preset_and_long_the_full_one() -> None:
    short, full = parse_args(["--model", "m"]), parse_args(["--model", "m", "--long"])
    assert (short.num_short, short.long_input_len, short.seeds) == (6, 256, [0, 1])
    assert (full.num_short, full.long_input_len, full.seeds) == (16, 1024, [0, 1, 2])
    assert full.rates == (0.5, 1.0, 2.0) and short.rates == (0.5, 1.0)
    # A flag given wins over either preset.
    given = parse_args(["--model", "m", "--long", "--num-short", "3", "--rate", "4"])
    assert (given.num_short, given.num_long, given.rates) == (3, 4, (0.5, 1.0, 2.0, 4.0))


def test_pinning_reaches_threads_started_before_it() -> None:
    allowed = sorted(os.sched_getaffinity(0))
    started, release = threading.Event(), threading.Event()
    tid: list[int] = []

    def pool_thread() -> None:  # like a tokenizer or torch pool thread, started earlier
        tid.append(threading.get_native_id())
        started.set()
        release.wait(30)

    t = threading.Thread(target=pool_thread)
    t.start()
    assert started.wait(30)
    try:
        pin_process(allowed[:1])
        assert os.sched_getaffinity(tid[0]) == set(allowed[:1])
    finally:
        pin_process(allowed)
        release.set()
        t.join(30)
    assert sorted(os.sched_getaffinity(0)) == allowed


def test_router_variants_reach_the_deployment_and_the_schema_judges_them(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = parse_args(["--model", "m", "--router", "", "--router", "elastic_prefill=false"])
    assert args.router == ["", "elastic_prefill=false"]
    assert deployment(args, "pd", [0, 1], args.router[0]).router.elastic_prefill
    off = deployment(args, "pd", [0, 1], "elastic_prefill=false,elastic_busy_max_tokens=8")
    assert (off.router.elastic_prefill, off.router.elastic_busy_max_tokens) == (False, 8)
    for bad, said in (("elastic_prefil=false", "elastic_prefil"), ("oops", "key=value")):
        with pytest.raises(SystemExit):
            parse_args(["--model", "m", "--router", bad])
        assert said in capsys.readouterr().err


def test_the_goodput_ratio_is_taken_at_the_tightest_scale_where_it_is_defined() -> None:
    """Colocated attains 60% at k = 1.5 but 90% at no rate: its goodput there is 0 and the
    ratio undefined. The ratio reported is the one at the tightest scale where colocated
    has a goodput (issue 30: `goodput_ratio_at_tightest` was null)."""
    args = parse_args(["--model", "m", "--slo-scales", "1.5,3,5", "--rate", "1"])

    def mode(goodput: float, by_scale: list[float], attained: list[float]) -> dict[str, Any]:
        def g(v: float) -> dict[str, float]:
            return {"median": v, "min": v, "max": v}

        scales = [str(k) for k in args.slo_scales]
        return {
            "goodput": g(goodput),
            "goodput_by_scale": {k: g(v) for k, v in zip(scales, by_scale, strict=True)},
            "attainment_by_scale": {k: {"1.0": a} for k, a in zip(scales, attained, strict=True)},
        }

    pd_mode = mode(1.0, [0.5, 1.0, 1.0], [0.9, 1.0, 1.0])
    colocated = mode(0.5, [0.0, 0.5, 1.0], [0.6, 0.9, 1.0])
    out = ratios(args, {"pd": pd_mode, "colocated": colocated})
    assert out["goodput_ratio"] == 2.0
    assert out["goodput_ratio_by_scale"] == {"1.5": None, "3.0": 2.0, "5.0": 1.0}
    assert (out["tightest_scale"], out["goodput_ratio_at_tightest"]) == ("3.0", 2.0)
    # Loose scales by default, where colocated reaches a goodput.
    assert max(parse_args(["--model", "m"]).slo_scales) >= 10


@pytest.mark.parametrize(
    ("mode", "threads"), [("pd", [1, 1]), ("colocated", [1, 1]), ("single", [2])]
)
def test_worker_threads_are_the_cores_it_is_pinned_to(mode: str, threads: list[int]) -> None:
    dep = deployment(parse_args(["--model", "m"]), mode, [4, 7])
    configs = worker_configs(dep)
    assert [c.engine.num_threads for c in configs] == threads
    assert [len(c.cpus) for c in configs] == threads
    assert [c.engine.initial_threads for c in configs] == [None] * len(threads)


def test_bench_pd_smoke(
    text_llama_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    recorded_loads: Callable[[ModuleType], list[int]],
) -> None:
    loads = recorded_loads(pd)
    core = str(sorted(os.sched_getaffinity(0))[0])
    argv = ["--model", str(text_llama_dir), "--num-short", "3", "--num-long", "1"]
    argv += ["--short-input-len", "16", "--short-output-len", "4", "--long-input-len", "96"]
    argv += ["--long-output-len", "3", "--isolated-short", "1", "--isolated-long", "1"]
    argv += ["--rate", "8", "--rates", "4", "--seeds", "0,1", "--slo-scales", "2,5"]
    argv += ["--router-cpus", core, "--kv-cache-gb", "0.05", "--background-load", "1"]
    argv += ["--result-json", str(tmp_path / "pd.json")]
    before = os.sched_getaffinity(0)
    assert main(argv) == 0
    assert loads == [1]  # --background-load reached the load around the measurement
    assert os.sched_getaffinity(0) == before  # the bench gives the test its cores back
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    assert res["workload"]["rates"] == [4.0, 8.0] and res["workload"]["seeds"] == [0, 1]
    assert res["pinning"]["router_and_client"] == [f"router_cpus={core}"]
    assert set(res["isolated_reference_ms"]) == {"short", "long"}
    run = res["results"][f"router_cpus={core}"]
    for mode in ("pd", "colocated"):
        m = run[mode]
        assert m["failed_requests"] == 0
        assert m["tpot_p99_ratio"]["min"] <= m["tpot_p99_ratio"]["median"]
        assert set(m["goodput_by_scale"]) == {"2.0", "5.0"}
        assert set(m["attainment_by_scale"]["5.0"]) == {"4.0", "8.0"}
        assert m["goodput"]["median"] in (0.0, 4.0, 6.0, 8.0)  # medians of two swept rates
    # One transfer per long request run alone, in pd mode only.
    assert run["pd"]["transfer_over_ttft"]["n"] == 2
    assert 0 < run["pd"]["transfer_over_ttft"]["max"] < 1
    assert "transfer_over_ttft" not in run["colocated"]
    # The router's decisions in the mixed phase at --rate: every pd prompt, colocated none.
    decided = {
        m: {d: run[m]["decisions_at_rate"][d]["median"] for d in DECISIONS}
        for m in ("pd", "colocated")
    }
    assert sum(decided["pd"].values()) == 4 and sum(decided["colocated"].values()) == 0
    assert set(run["goodput_ratio_by_scale"]) == {"2.0", "5.0"}

    full = json.loads((tmp_path / "pd.json").read_text())
    seeds = full["runs"][f"router_cpus={core}"]["pd"]
    assert [s["seed"] for s in seeds] == [0, 1]
    for s in seeds:  # every request of every phase answered in full
        assert len(s["isolated"]) == 2 and len(s["alone"]) == 3
        assert all(len(s["mixed"][rate]) == 4 for rate in ("4.0", "8.0"))
        for r in s["isolated"] + s["alone"] + s["mixed"]["8.0"]:
            assert r["success"] and r["output_tokens"] in (3, 4)
