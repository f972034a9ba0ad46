"""A model's privacy profile: per split layer k, the share of a prompt's tokens the strongest
measured inversion attack recovers from what that split sends. `hetero-pd bench
edge-privacy` measures and stores it; the split planner reads it to respect a floor
(`hetero-pd edge plan --max-recovery 0.1`).

Stored as JSON, one file per model, under the cache folder::

    {"model": "...", "attacks": "nn+linear", "codecs": ["float16", "int8"],
     "top1": {"1": 0.98, "4": 0.61, ...}, "kv_top1": {"1": 1.0, ...}, "measured": "..."}
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hetero_pd.envs import cache_dir

FIELDS = ("model", "attacks", "codecs", "top1", "kv_top1", "measured")


class PrivacyProfileError(ValueError):
    """A profile is missing or malformed; the message says which file and what to run."""


class PrivacyFloorError(ValueError):
    """No candidate split layer meets the maximum recovery rate; the message names the
    measured rates."""


def apply_floor(
    ks: Sequence[int], recovery: Mapping[int, float], max_recovery: float
) -> tuple[list[int], list[tuple[int, str]]]:
    """(the split layers in `ks` whose measured top-1 recovery is at most `max_recovery`,
    [(k, why refused)] for the others: measured above it, or not measured at all)."""
    if not 0 <= max_recovery <= 1:
        raise ValueError(f"max recovery is a share of tokens in [0, 1], got {max_recovery}")
    allowed, refused = [], []
    for k in ks:
        rate = recovery.get(k)
        if rate is None:
            refused.append((k, "recovery not measured (bench edge-privacy --splits ...)"))
        elif rate > max_recovery:
            refused.append((k, f"measured top-1 recovery {rate:.1%} > {max_recovery:.1%}"))
        else:
            allowed.append(k)
    if not allowed:
        measured = ", ".join(f"k={k}: {recovery[k]:.1%}" for k in ks if k in recovery)
        raise PrivacyFloorError(
            f"no split layer keeps token recovery at or below {max_recovery:.1%}; measured "
            f"top-1 recovery {measured or 'for none of them'}. Raise --max-recovery, measure "
            f"more layers (hetero-pd bench edge-privacy --splits ...), or use the noise defence"
        )
    return allowed, refused


@dataclass(frozen=True, slots=True)
class PrivacyProfile:
    """`top1[k]`: the worst measured top-1 token recovery from the hidden states a split at
    k sends (over the attacks and codecs measured, no noise); `kv_top1[k]`: the same from
    the K/V rows a `prompt_only` session sends."""

    model: str
    attacks: str
    codecs: tuple[str, ...]
    top1: Mapping[int, float]
    kv_top1: Mapping[int, float] = field(default_factory=dict)
    measured: str = ""

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        body = {
            "model": self.model,
            "attacks": self.attacks,
            "codecs": list(self.codecs),
            "top1": {str(k): v for k, v in sorted(self.top1.items())},
            "kv_top1": {str(k): v for k, v in sorted(self.kv_top1.items())},
            "measured": self.measured,
        }
        path.write_text(json.dumps(body, indent=1) + "\n")

    @classmethod
    def load(cls, path: Path) -> PrivacyProfile:
        if not path.is_file():
            raise PrivacyProfileError(
                f"no privacy profile at {path}: measure one with `hetero-pd bench edge-privacy "
                f"--model MODEL` (or pass --privacy-profile FILE)"
            )
        try:
            body = json.loads(path.read_text())
            unknown = sorted(set(body) - set(FIELDS))
            if unknown:
                raise PrivacyProfileError(f"{path}: unknown key(s) {unknown}; known: {FIELDS}")
            return cls(
                model=str(body["model"]),
                attacks=str(body["attacks"]),
                codecs=tuple(body["codecs"]),
                top1={int(k): float(v) for k, v in body["top1"].items()},
                kv_top1={int(k): float(v) for k, v in body.get("kv_top1", {}).items()},
                measured=str(body.get("measured", "")),
            )
        except (KeyError, TypeError, ValueError, json.JSONDecodeError) as e:
            if isinstance(e, PrivacyProfileError):
                raise
            raise PrivacyProfileError(f"{path}: not a privacy profile ({e!r})") from e


def check_split(
    model: str, split_layer: int, max_recovery: float, path: Path | None = None
) -> float:
    """The measured top-1 recovery of `model` split at `split_layer` (from `path`, default the
    stored profile); PrivacyFloorError when it is above `max_recovery` or was never measured."""
    where = path or default_path(model)
    rate = PrivacyProfile.load(where).top1.get(split_layer)
    if rate is None:
        raise PrivacyFloorError(
            f"split layer {split_layer}: its token recovery was never measured ({where}); run "
            f"hetero-pd bench edge-privacy --model {model} --splits {split_layer}"
        )
    if rate > max_recovery:
        raise PrivacyFloorError(
            f"split layer {split_layer}: measured top-1 token recovery {rate:.1%} is above the "
            f"maximum {max_recovery:.1%} ({where}); `hetero-pd edge plan --max-recovery "
            f"{max_recovery:g}` lists the split layers that meet it"
        )
    return rate


def default_path(model: str) -> Path:
    """Where the bench stores, and the planner looks for, a model's profile."""
    return cache_dir() / "privacy" / f"{Path(model).name}.json"
