"""Side-by-side table of ``hetero-pd bench serve`` result files (e.g. vLLM vs hetero-pd).

    python -m hetero_pd.bench.compare vllm.json hetero-pd.json

Columns are the files, named by their ``label`` (else the file name); with two files a
last column gives the ratio second / first.  The last stdout line is one JSON object:
``{label: {metric: value}}``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROWS = (
    ("completed", "completed requests"),
    ("failed", "failed requests"),
    ("duration", "duration (s)"),
    ("request_throughput", "requests/s"),
    ("output_throughput", "output tok/s"),
    ("total_token_throughput", "total tok/s"),
    ("mean_ttft_ms", "TTFT mean (ms)"),
    ("p50_ttft_ms", "TTFT p50 (ms)"),
    ("p99_ttft_ms", "TTFT p99 (ms)"),
    ("mean_tpot_ms", "TPOT mean (ms)"),
    ("p50_tpot_ms", "TPOT p50 (ms)"),
    ("p99_tpot_ms", "TPOT p99 (ms)"),
    ("mean_itl_ms", "ITL mean (ms)"),
    ("p99_itl_ms", "ITL p99 (ms)"),
    ("mean_e2el_ms", "E2E mean (ms)"),
    ("p99_e2el_ms", "E2E p99 (ms)"),
    ("slo_attainment", "SLO attainment"),
    ("request_goodput", "goodput (req/s)"),
)


def _fmt(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def _ratio(a: Any, b: Any) -> str:
    if isinstance(a, int | float) and isinstance(b, int | float) and a:
        return f"{b / a:.2f}x"
    return ""


def load(path: Path) -> tuple[str, dict[str, Any]]:
    """A result file's label and its contents."""
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or "completed" not in data:
        raise ValueError(f"{path}: not a single-run result of `hetero-pd bench serve`")
    return str(data.get("label") or path.stem), data


def table(runs: list[tuple[str, dict[str, Any]]]) -> str:
    """The comparison as aligned text."""
    header = ["metric", *(label for label, _ in runs)]
    ratio = len(runs) == 2
    if ratio:
        header.append(f"{runs[1][0]} / {runs[0][0]}")
    lines = [header]
    for key, name in ROWS:
        values = [data.get(key) for _, data in runs]
        row = [name, *(_fmt(v) for v in values)]
        if ratio:
            row.append(_ratio(values[0], values[1]))
        lines.append(row)
    widths = [max(len(r[i]) for r in lines) for i in range(len(header))]
    return "\n".join(
        "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in lines
    )


def main(argv: list[str] | None = None) -> int:
    """Print the comparison of the result files named in ``argv``."""
    p = argparse.ArgumentParser(prog="python -m hetero_pd.bench.compare", description=__doc__)
    p.add_argument("results", nargs="+", type=Path, help="--result-json files")
    args = p.parse_args(argv)
    try:
        runs = [load(path) for path in args.results]
        labels = [label for label, _ in runs]
        runs = [
            (f"{label}#{i}" if labels.count(label) > 1 else label, data)
            for i, (label, data) in enumerate(runs, start=1)
        ]
    except (OSError, ValueError) as e:
        print(f"compare: error: {e}", file=sys.stderr)
        return 2
    print(table(runs))
    print(json.dumps({label: {k: d.get(k) for k, _ in ROWS} for label, d in runs}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
