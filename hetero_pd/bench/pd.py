"""`hetero-pd bench pd`: 1P1D disaggregated vs colocated (two `both` workers) vs a single
worker, on one mixed workload (short chat turns plus long summarization prompts, Poisson
arrivals), all in one run on this machine.

Workers are pinned to cores, and a worker's torch threads are the cores it is pinned to.
The router and this load generator (one process) sit on one core, and that core is a
worker's in every mode: in pd mode the prefill worker's or the decode worker's, which are
not the same thing. So the whole run is repeated once per placement (`--router-cpus`,
default: each worker core in turn) and every placement is reported: a control run.

By default the run is short (a few minutes on 2 cores): a small workload, two seeds, and the
placement where interference shows, the router on the decode worker's core. `--long` is the
full run (~30 minutes there): larger prompts, three seeds, every placement. Any flag given
overrides the preset's value. `--router key=value[,...]`, once per variant, runs the same
deployments with other router settings side by side (e.g. elastic prefill on and off).

Each deployment runs every seed (`--seeds`) through warm-up, isolated, alone and mixed
phases with prompts of their own (see `hetero_pd.bench.pd_run`). Reported per placement
and mode, with the median and spread over seeds:

- `tpot_p99_ratio`: TPOT p99 of the short requests mixed with long ones at `--rate`,
  divided by their TPOT p99 alone at the same rate (interference; 1.0 is none);
- `goodput`: the highest rate of the sweep (`--rates`) at which >= 90% of requests meet
  the absolute SLOs (`--slo-ttft-ms`, `--slo-tpot-ms`);
- `goodput_by_scale`, `attainment_by_scale`: the same at SLOs of k x each request class's
  isolated TTFT and TPOT, both scaled by k (`--slo-scales`), as DistServe plots them; the
  isolated reference is the fastest deployment's, the same for all;
- `goodput_ratio_by_scale`: PD goodput / colocated goodput at each scale (undefined where
  colocated has none); `goodput_ratio_at_tightest`: at `tightest_scale`, the tightest
  scale where it is defined;
- `decisions_at_rate`: where the router computed the mixed phase's prompts at `--rate`
  (`local_prefill`: on the decode worker; `disaggregated`: on the prefill worker);
- `transfer_over_ttft`: per long request run alone in pd mode, its KV transfer seconds /
  its TTFT.

The last stdout line is one JSON object; `--result-json` writes every request as well.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import sys
from typing import Any

import yaml

from hetero_pd.bench import datasets as ds
from hetero_pd.bench.background import background_load, check_count
from hetero_pd.bench.pd_report import summarize
from hetero_pd.bench.pd_run import WorkloadSpec, make_workload, run_deployment
from hetero_pd.deploy.schema import ConfigError, Deployment, parse_deployment
from hetero_pd.models.fetch import resolve_model

MODES = ("pd", "colocated", "single")


def mode_workers(mode: str, cpus: list[int]) -> list[dict[str, Any]]:
    a, b = (cpus[0], cpus[1]) if len(cpus) > 1 else (cpus[0], cpus[0])
    return {
        "pd": [{"role": "prefill", "cpus": [a]}, {"role": "decode", "cpus": [b]}],
        "colocated": [{"role": "both", "cpus": [a]}, {"role": "both", "cpus": [b]}],
        "single": [{"role": "both", "cpus": sorted({a, b})}],
    }[mode]


def pin_process(cpus: list[int]) -> None:
    """Pins every thread of this process (`sched_setaffinity(0)` alone pins the calling
    thread only; tokenizer and torch pools started earlier would keep floating)."""
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that just ended
            os.sched_setaffinity(int(tid), cpus)


def router_placements(given: list[str], cpus: list[int], every: bool = True) -> list[list[int]]:
    """The `--router-cpus` placements; else one per worker core (a control run each), or
    with `every` False only the decode worker's core (pd mode's second worker), where the
    router and client compete with decode steps."""
    if given:
        return [_ints(c) for c in given]
    cores = sorted(set(cpus[:2]))
    return [[c] for c in cores] if every else [[cpus[:2][-1]]]


#: What `--long` and the default (short) run measure, flag by flag; a flag given wins.
PRESETS: dict[str, dict[str, Any]] = {
    "short": {
        "num_short": 6,
        "num_long": 2,
        "short_input_len": 32,
        "short_output_len": 16,
        "long_input_len": 256,
        "long_output_len": 8,
        "isolated_short": 1,
        "isolated_long": 1,
        "rate": 0.5,
        "rates": "0.5,1",
        "seeds": "0,1",
    },
    "long": {
        "num_short": 16,
        "num_long": 4,
        "short_input_len": 64,
        "short_output_len": 64,
        "long_input_len": 1024,
        "long_output_len": 16,
        "isolated_short": 2,
        "isolated_long": 2,
        "rate": 1.0,
        "rates": "0.5,1,2",
        "seeds": "0,1,2",
    },
}


def router_variant(text: str) -> dict[str, Any]:
    """`--router key=value,key=value` as router-section values (YAML scalars)."""
    out: dict[str, Any] = {}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--router {text!r}: expected key=value[,key=value], got {item!r}")
        out[key.strip()] = yaml.safe_load(value)
    return out


def deployment(
    args: argparse.Namespace, mode: str, cpus: list[int], router: str = ""
) -> Deployment:
    raw = {
        "model": args.model,
        "dtype": args.dtype,
        "workers": mode_workers(mode, cpus),
        "router": {"host": "127.0.0.1", "port": 0, **router_variant(router)},
        "engine": {"max_num_batched_tokens": 256, "kv_cache_gb": args.kv_cache_gb},
    }
    return parse_deployment(raw, mode)


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(v) for v in text.split(",") if v)


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="hetero-pd bench pd",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="float32", help="the deployment's dtype (auto, float32, ...)")
    p.add_argument(
        "--long",
        action="store_true",
        help="the full run: PRESETS['long'] and every router placement (default: the short one)",
    )
    p.add_argument("--num-short", type=int)
    p.add_argument("--num-long", type=int)
    p.add_argument("--short-input-len", type=int)
    p.add_argument("--short-output-len", type=int)
    p.add_argument("--long-input-len", type=int)
    p.add_argument("--long-output-len", type=int)
    p.add_argument("--isolated-short", type=int, help="per seed, one at a time")
    p.add_argument("--isolated-long", type=int, help="per seed, one at a time")
    p.add_argument("--rate", type=float, help="req/s (Poisson) of alone/mixed")
    p.add_argument("--rates", help="the sweep (--rate is added to it)")
    p.add_argument("--slo-ttft-ms", type=float, default=8000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=200.0)
    p.add_argument(
        "--slo-scales",
        default="1.5,2,3,5,8,12,20",
        help="k of the SLOs k x isolated TTFT and TPOT; up to loose ones, where colocated "
        "has a goodput and the PD:colocated ratio is defined",
    )
    p.add_argument("--seeds")
    p.add_argument("--modes", default="pd,colocated")
    p.add_argument("--cpus", default="", help="two core ids to pin workers to (default: 0,1)")
    p.add_argument(
        "--router-cpus",
        action="append",
        default=[],
        help="cores of this process (router, API, load generator), one placement per use "
        "(e.g. --router-cpus 0 --router-cpus 1); default: each worker core in turn",
    )
    p.add_argument(
        "--router",
        action="append",
        default=[],
        metavar="KEY=VALUE[,KEY=VALUE]",
        help="router settings of one variant, run side by side with the others given "
        "(e.g. --router '' --router elastic_prefill=false); default: the router's defaults",
    )
    p.add_argument("--kv-cache-gb", type=float, default=0.5)
    p.add_argument("--background-load", type=int, default=0, metavar="N", help="busy processes")
    p.add_argument("--result-json", help="write every run's requests and metrics here")
    args = p.parse_args(argv)
    for name, value in PRESETS["long" if args.long else "short"].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.modes = [m for m in args.modes.split(",") if m]
    bad = sorted(set(args.modes) - set(MODES))
    if bad or not args.modes:
        p.error(f"--modes: unknown {bad}; choose from {list(MODES)}")
    args.seeds = _ints(args.seeds)
    args.slo_scales = sorted(_floats(args.slo_scales))
    args.rates = tuple(sorted(set(_floats(args.rates)) | {args.rate}))
    if not args.seeds or not args.slo_scales or min(args.rates) <= 0:
        p.error("--seeds and --slo-scales must be non-empty, rates > 0")
    if min(args.num_short, args.isolated_short, args.isolated_long) < 1 or args.num_long < 0:
        p.error("--num-short, --isolated-short and --isolated-long must be >= 1")
    try:
        check_count(args.background_load)
        for router in args.router or [""]:  # the schema judges --dtype, sizes and --router
            deployment(args, "pd", [0], router)
    except (ValueError, ConfigError) as e:
        p.error(str(e))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    allowed = sorted(os.sched_getaffinity(0))
    cpus = _ints(args.cpus) or allowed[:2]
    placements = router_placements(args.router_cpus, cpus, every=args.long)
    spec = WorkloadSpec(
        num_short=args.num_short,
        num_long=args.num_long,
        mixed=ds.MixedSpec(
            long_fraction=args.num_long / (args.num_short + args.num_long),
            short_input_len=args.short_input_len,
            short_output_len=args.short_output_len,
            long_input_len=args.long_input_len,
            long_output_len=args.long_output_len,
        ),
        isolated_short=args.isolated_short,
        isolated_long=args.isolated_long,
        rate=args.rate,
        rates=args.rates,
    )
    source = ds.TokenizerText(resolve_model(args.model))
    loads = [make_workload(spec, source, seed) for seed in args.seeds]
    runs: dict[str, dict[str, Any]] = {}
    try:
        with background_load(args.background_load, allowed):
            for router_cpus, router in itertools.product(placements, args.router or [""]):
                label = "router_cpus=" + ",".join(map(str, router_cpus))
                label += f" router:{router}" if router else ""
                # Workers pin themselves when they start; the router and client stay here.
                pin_process(router_cpus)
                for mode in args.modes:
                    dep = deployment(args, mode, cpus, router)
                    print(
                        f"== {label}, {mode}: workers on {[w.cpus for w in dep.workers]}, "
                        f"{len(loads)} seed(s), rates {list(args.rates)}",
                        file=sys.stderr,
                    )
                    runs.setdefault(label, {})[mode] = run_deployment(dep, spec, loads)
    finally:
        pin_process(allowed)
    pinning = {m: [list(w.cpus) for w in deployment(args, m, cpus).workers] for m in args.modes}
    summary, details = summarize(args, runs, pinning)
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump({**summary, "runs": details}, f, indent=1, default=str)
    print(json.dumps(summary, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
