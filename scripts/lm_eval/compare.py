"""One JSON line comparing two lm_eval --log_samples output folders.

Used by scripts/lm_eval_side_by_side.sh.

Per task: each side's metrics (their stderr left out), the questions whose scored answer
differs, and for log-likelihood tasks the largest difference between the two sides'
log-likelihoods of any (question, choice).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _results(folder: Path) -> dict[str, dict[str, Any]]:
    files = sorted(folder.rglob("results_*.json"))
    if not files:
        raise SystemExit(f"no results_*.json under {folder}")
    results: dict[str, dict[str, Any]] = json.loads(files[-1].read_text())["results"]
    return results


def _samples(folder: Path, task: str) -> dict[int, dict[str, Any]]:
    files = sorted(folder.rglob(f"samples_{task}_*.jsonl"))
    if not files:
        raise SystemExit(f"no samples_{task}_*.jsonl under {folder} (lm_eval needs --log_samples)")
    lines = files[-1].read_text().splitlines()
    return {s["doc_id"]: s for s in map(json.loads, lines) if s}


def _metrics(result: dict[str, Any]) -> dict[str, float]:
    return {
        k: round(v, 4) for k, v in result.items() if isinstance(v, float) and "_stderr" not in k
    }


def compare(served: Path, reference: Path) -> dict[str, Any]:
    ours, theirs = _results(served), _results(reference)
    out: dict[str, Any] = {}
    for task in sorted(ours.keys() & theirs.keys()):
        a, b = _samples(served, task), _samples(reference, task)
        docs = sorted(a.keys() & b.keys())
        loglikelihood = bool(docs) and not isinstance(a[docs[0]]["filtered_resps"][0], str)
        answer = _choice if loglikelihood else _text
        entry: dict[str, Any] = {
            "hetero_pd": _metrics(ours[task]),
            "hf": _metrics(theirs[task]),
            "questions": len(docs),
            "answers_differ": sum(answer(a[d]) != answer(b[d]) for d in docs),
        }
        if loglikelihood:
            entry["max_abs_loglikelihood_diff"] = max(
                abs(float(x[0]) - float(y[0]))
                for d in docs
                for x, y in zip(a[d]["filtered_resps"], b[d]["filtered_resps"], strict=True)
            )
        out[task] = entry
    return out


def _choice(sample: dict[str, Any]) -> int:
    """The choice a log-likelihood sample scored highest (lm_eval logs the numbers as text)."""
    lls = [float(r[0]) for r in sample["filtered_resps"]]
    return lls.index(max(lls))


def _text(sample: dict[str, Any]) -> str:
    return str(sample["filtered_resps"][0])


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: compare.py SERVED_OUTPUT_DIR HF_OUTPUT_DIR")
    print(json.dumps(compare(Path(sys.argv[1]), Path(sys.argv[2])), sort_keys=True))
