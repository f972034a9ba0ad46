"""Helpers of scripts/vllm_side_by_side.sh that run in hetero-pd's environment.

    side_by_side.py resolve-dtype MODEL_DIR DTYPE        the engine's dtype for DTYPE (auto)
    side_by_side.py config CONFIG DTYPE OUT [--port P]   CONFIG with its dtype (and router
                                                         port) set
    side_by_side.py spec MODEL_DIR DTYPE OUT [options]   the offline workload, as token ids
    side_by_side.py serve-ratios VLLM.json HPD.json      one JSON line: hetero-pd / vLLM
                                                         (with --sweep: goodput rates too)
    side_by_side.py offline-ratios DIR                   one JSON line from DIR/offline-*.json
    side_by_side.py roofline MODEL_DIR DTYPE RESULT...   per served result: its model FLOP/s
                                                         and share of this CPU's GEMM rate

Ratios are hetero-pd's number over vLLM's: above 1 is better for throughput, below 1 is
better for latencies.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from pathlib import Path
from typing import Any

import yaml


def resolve_dtype(args: argparse.Namespace) -> None:
    from hetero_pd import LLM
    from hetero_pd.bench.offline_side import engine_dtype

    print(engine_dtype(LLM(args.model_dir, dtype=args.dtype, num_kv_blocks=16)))


def config(args: argparse.Namespace) -> None:
    raw = yaml.safe_load(Path(args.config).read_text())
    raw["dtype"] = args.dtype
    if args.port is not None:  # a free port, so no other server on the fixed one is measured
        router = raw.setdefault("router", {})
        router["host"], router["port"] = "127.0.0.1", args.port
    Path(args.out).write_text(yaml.safe_dump(raw, sort_keys=False))


def spec(args: argparse.Namespace) -> None:
    from hetero_pd.bench.offline import parse_args, workload_spec

    argv = ["--model", args.model_dir, "--dtype", args.dtype, "--threads", str(args.threads)]
    argv += ["--num-prompts", str(args.num_prompts), "--max-tokens", str(args.max_tokens)]
    side = workload_spec(parse_args([*argv, "--seed", str(args.seed)]))
    Path(args.out).write_text(json.dumps(dataclasses.asdict(side)))


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def serve_ratios(args: argparse.Namespace) -> None:
    v, h = (json.loads(p.read_text()) if p.is_file() else {} for p in (args.vllm, args.hetero_pd))
    out: dict[str, Any] = {"mode": "serve", "dtype": args.dtype, "hetero_pd": h.get("label")}
    if "sweep" in h and "sweep" in v:  # no single run: its throughput and latencies are none
        print(json.dumps({**out, **_sweep_ratios(v, h)}))
        return
    for key, name in (
        ("output_throughput", "output_throughput_ratio"),
        ("p50_ttft_ms", "ttft_p50_ratio"),
        ("p99_ttft_ms", "ttft_p99_ratio"),
        ("mean_ttft_ms", "ttft_mean_ratio"),
        ("p50_tpot_ms", "tpot_p50_ratio"),
        ("p99_tpot_ms", "tpot_p99_ratio"),
        ("p99_itl_ms", "itl_p99_ratio"),
    ):
        out[name] = _ratio(h.get(key), v.get(key))
        out[f"hetero_pd_{key}"], out[f"vllm_{key}"] = h.get(key), v.get(key)
    out["completed"] = {"hetero_pd": h.get("completed"), "vllm": v.get("completed")}
    print(json.dumps(out))


def _sweep_ratios(v: dict[str, Any], h: dict[str, Any]) -> dict[str, Any]:
    """Goodput (bench serve --sweep: the highest rate with the target share of requests in
    the SLO) of each side and ours over vLLM's; a side whose search passed its top rate is
    saturated, so its goodput is a floor and so is the ratio where it is ours."""
    hs, vs = h.get("sweep") or {}, v.get("sweep") or {}
    return {
        "goodput_rate_ratio": _ratio(hs.get("goodput_rate"), vs.get("goodput_rate")),
        "hetero_pd_goodput_rate": hs.get("goodput_rate"),
        "vllm_goodput_rate": vs.get("goodput_rate"),
        "saturated": {"hetero_pd": hs.get("saturated"), "vllm": vs.get("saturated")},
        "probes": {"hetero_pd": len(hs.get("probes", [])), "vllm": len(vs.get("probes", []))},
        "slo": h.get("slo") or v.get("slo"),
        "sweep_target": hs.get("target", vs.get("target")),
    }


def _last_json(path: Path) -> dict[str, Any]:
    lines = path.read_text().strip().splitlines()
    if not lines:
        raise SystemExit(f"{path}: empty (that side failed; see its log)")
    return dict(json.loads(lines[-1]))


def offline_ratios(args: argparse.Namespace) -> None:
    from hetero_pd.bench.offline import compare_tokens

    out_dir = Path(args.dir)
    runs: dict[str, list[dict[str, Any]]] = {}
    for side in ("hetero-pd", "vllm"):
        files = sorted(out_dir.glob(f"offline-{side}-*.json"))
        runs[side] = [_last_json(f) for f in files]
    hpd, vllm = runs["hetero-pd"], runs["vllm"]
    if not hpd:
        raise SystemExit(f"no offline-hetero-pd-*.json in {out_dir}")
    tok_s = {
        s: [sum(map(len, r["token_ids"])) / r["elapsed_s"] for r in rs] for s, rs in runs.items()
    }
    out: dict[str, Any] = {
        "mode": "offline",
        "dtype": hpd[0]["dtype"],
        "rounds": len(hpd),
        "hetero_pd_tok_s": round(statistics.median(tok_s["hetero-pd"]), 2),
        "hetero_pd_peak_rss_mb": max(r["peak_rss_mb"] for r in hpd),
    }
    if vllm:
        ratios = [a / b for a, b in zip(tok_s["hetero-pd"], tok_s["vllm"], strict=False)]
        check = compare_tokens(hpd[0]["token_ids"], vllm[0]["token_ids"])
        out.update(
            vllm_dtype=vllm[0]["dtype"],
            vllm_tok_s=round(statistics.median(tok_s["vllm"]), 2),
            vllm_peak_rss_mb=max(r["peak_rss_mb"] for r in vllm),
            ratio=round(statistics.median(ratios), 3),
            ratio_min=round(min(ratios), 3),
            ratio_max=round(max(ratios), 3),
            token_mismatches=len(check.mismatched),
            token_agreement_pct=check.agreement_pct,
        )
    print(json.dumps(out))


def roofline(args: argparse.Namespace) -> None:
    """One JSON line per `bench serve` result: the model FLOPs its requests took
    (profile_ops.served_flops: prompts prefilled, outputs decoded over their context, the LM
    head per output token) over its duration, and that rate's share of the roofline: the
    GEMM rate of the model's own layer shapes at `--rows` tokens in DTYPE on this machine
    (F.linear or oneDNN's packed linear, the faster; median of `--repeats`), measured here
    after the servers are gone. Both sides served the same requests, so the shares compare
    their durations against one ceiling."""
    from hetero_pd import LLM
    from hetero_pd.bench import profile_ops

    model = LLM(args.model_dir, dtype=args.dtype, num_kv_blocks=16).engine.runner.model
    dtype = next(model.parameters()).dtype
    shapes = profile_ops.linear_shapes(model)
    layers = [s for s in shapes if s[0] != "lm_head"]
    rate = profile_ops.gemm_rate(layers, args.rows, dtype, args.repeats)["best"]
    for path in args.results:
        r = json.loads(path.read_text())
        flops = profile_ops.served_flops(
            model.cfg, shapes, r["completed"], r["total_input_tokens"], r["total_output_tokens"]
        )
        achieved = flops / r["duration"] / 1e9
        out = {"mode": "roofline", "label": r.get("label"), "dtype": str(dtype)[6:]}
        out |= {"model_gflop": _sig(flops / 1e9), "achieved_gflops": _sig(achieved)}
        out |= {"gemm_gflops": _sig(rate), "gemm_rows": args.rows}
        print(json.dumps({**out, "roofline_share": round(achieved / rate, 3)}))


def _sig(x: float) -> float:
    """x to 4 significant digits."""
    return float(f"{x:.4g}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("resolve-dtype")
    s.add_argument("model_dir")
    s.add_argument("dtype")
    s.set_defaults(run=resolve_dtype)
    s = sub.add_parser("config")
    s.add_argument("config")
    s.add_argument("dtype")
    s.add_argument("out")
    s.add_argument("--port", type=int, default=None)
    s.set_defaults(run=config)
    s = sub.add_parser("spec")
    s.add_argument("model_dir")
    s.add_argument("dtype")
    s.add_argument("out")
    s.add_argument("--threads", type=int, default=1)
    s.add_argument("--num-prompts", type=int, default=32)
    s.add_argument("--max-tokens", type=int, default=64)
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(run=spec)
    s = sub.add_parser("serve-ratios")
    s.add_argument("vllm", type=Path, help="its bench serve result (absent: skipped)")
    s.add_argument("hetero_pd", type=Path, help="its bench serve result (absent: skipped)")
    s.add_argument("--dtype", default=None)
    s.set_defaults(run=serve_ratios)
    s = sub.add_parser("offline-ratios")
    s.add_argument("dir")
    s.set_defaults(run=offline_ratios)
    s = sub.add_parser("roofline")
    s.add_argument("model_dir")
    s.add_argument("dtype")
    s.add_argument("results", type=Path, nargs="+")
    s.add_argument("--rows", type=int, default=2048, help="tokens of the GEMM probe")
    s.add_argument("--repeats", type=int, default=5)
    s.set_defaults(run=roofline)
    args = p.parse_args()
    args.run(args)
    return 0


if __name__ == "__main__":
    from hetero_pd.process_exit import exit_after

    exit_after(main)
