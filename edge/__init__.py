"""Edge split: the device runs a model's first k layers (torch or ONNX Runtime) so raw text
never leaves it, encodes their hidden states for the wire (`encode`/`decode`), and a planner
recommends k (`plan_split`). `EdgeClient` runs a session against the cloud's router.
ONNX Runtime is imported only by `edge.onnx_runtime`."""

from __future__ import annotations

from edge.client import EdgeClient, EdgeError, EdgeMismatchError
from edge.codec import CodecError, decode, encode
from edge.loader import split_fingerprint
from edge.planner import LinkProfile, SideProfile, SplitPlan, format_plan, plan_split
from edge.runtime import EdgeRuntime

__all__ = [
    "CodecError",
    "EdgeClient",
    "EdgeError",
    "EdgeMismatchError",
    "EdgeRuntime",
    "LinkProfile",
    "SideProfile",
    "SplitPlan",
    "decode",
    "encode",
    "format_plan",
    "plan_split",
    "split_fingerprint",
]
