"""Typed, frozen config sections built from plain values, with every problem recorded.

A section is a frozen dataclass whose fields may carry constraints made with `opt()`:

    port: int = opt(8000, lo=0, hi=65535, doc="the HTTP port")
    policy: str = opt("least_loaded", choices=POLICIES)
    kv_cache_gb: float = opt(1.0, gt=0)

`build(cls, raw, "router", src)` rejects unknown keys (naming the allowed ones), checks each
value's type and constraints, and records an issue at the exact key for each problem; it
returns None when anything was wrong, so the caller keeps going and reports them all.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import types
import typing
from collections.abc import Sequence
from typing import Any, TypeVar

from hetero_pd.deploy.source import Source

T = TypeVar("T")


def opt(
    default: Any,
    *,
    choices: Sequence[Any] | None = None,
    lo: float | None = None,
    hi: float | None = None,
    gt: float | None = None,
    doc: str = "",
) -> Any:
    """A dataclass field with an immutable default and the constraints `build()` checks:
    `choices`, bounds `lo` <= value <= `hi`, or `gt` < value (a positive size)."""
    meta = {"choices": choices, "lo": lo, "hi": hi, "gt": gt, "doc": doc}
    return dataclasses.field(default=default, metadata=meta)


def required(*, choices: Sequence[Any] | None = None, doc: str = "") -> Any:
    """A dataclass field without a default (a missing key is an error) and its choices."""
    return dataclasses.field(metadata={"choices": choices, "doc": doc})


def build(cls: type[T], raw: Any, key: str, src: Source) -> T | None:
    """An instance of section `cls` from `raw` (a mapping), or None after recording issues."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        src.error(key, f"must be a mapping of keys to values, got {_kind(raw)}")
        return None
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    hints = typing.get_type_hints(cls)
    before = len(src.issues)
    values: dict[str, Any] = {}
    for name, value in raw.items():
        path = f"{key}.{name}" if key else str(name)
        f = fields.get(name)
        if f is None:
            src.error(path, f"unknown key; allowed in {key or 'the top level'}: {_names(fields)}")
            continue
        checked = check_value(value, hints[name], path, src, f.metadata)
        if checked is not BAD:
            values[name] = checked
    missing = [
        n
        for n, f in fields.items()
        if n not in raw
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    for name in missing:
        src.error(key, f"missing required key {name!r}")
    if len(src.issues) > before:
        return None
    return cls(**values)


#: What `check_value` returns for a value it recorded an issue about.
BAD: Any = object()


def check_value(value: Any, tp: Any, key: str, src: Source, meta: Any = None) -> Any:
    """`value` converted to `tp` (lists become tuples), or `BAD` after recording an issue."""
    meta = meta or {}
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (tp,) = [a for a in args if a is not type(None)]
        origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp):  # a section inside a section (router.rebalance)
        section = build(tp, value, key, src)  # type: ignore[arg-type]
        return BAD if section is None else section
    if origin is tuple:
        if not isinstance(value, list):
            src.error(key, f"must be a list, got {_kind(value)}")
            return BAD
        items = [check_value(v, args[0], f"{key}[{i}]", src, meta) for i, v in enumerate(value)]
        return BAD if any(i is BAD for i in items) else tuple(items)
    if origin is dict:
        if not isinstance(value, dict):
            src.error(key, f"must be a mapping, got {_kind(value)}")
            return BAD
        if args[1] is Any:
            return dict(value)
        out = {str(k): check_value(v, args[1], f"{key}.{k}", src) for k, v in value.items()}
        return BAD if any(v is BAD for v in out.values()) else out
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        str: isinstance(value, str),
    }.get(tp, True)
    if not ok:
        src.error(key, f"must be {_type_name(tp)}, got {_kind(value)} {value!r}")
        return BAD
    if tp is float:
        value = float(value)
        if not math.isfinite(value):  # nan compares false with every bound: it passes them
            src.error(key, f"must be a finite number, got {value}")
            return BAD
    return _constrain(value, key, src, meta)


def _constrain(value: Any, key: str, src: Source, meta: Any) -> Any:
    choices, lo, hi, gt = meta.get("choices"), meta.get("lo"), meta.get("hi"), meta.get("gt")
    if choices is not None and value not in choices:
        src.error(key, f"{value!r} is not allowed; allowed: {', '.join(map(str, choices))}")
        return BAD
    if gt is not None and value <= gt:
        src.error(key, f"{value!r} is out of range; must be > {gt}")
        return BAD
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f">= {lo}" if hi is None else f"in [{lo}, {hi}]" if lo is not None else f"<= {hi}"
        src.error(key, f"{value!r} is out of range; must be {bounds}")
        return BAD
    return value


def _names(fields: dict[str, Any]) -> str:
    return ", ".join(sorted(fields))


def _type_name(tp: Any) -> str:
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(
        tp, str(tp)
    )


def _kind(value: Any) -> str:
    return {dict: "a mapping", list: "a list", type(None): "nothing (null)"}.get(
        type(value), type(value).__name__
    )


def json_object(text: str) -> dict[str, Any]:
    """An argparse type: a JSON object (`--speculative-config`, bench's `--extra-body`)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e.msg}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value
