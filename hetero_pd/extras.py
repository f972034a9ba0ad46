"""Optional dependencies, imported when a feature needs them, with an error naming the extra
that installs them (`pip install 'hetero-pd[EXTRA]'`)."""

from __future__ import annotations

import importlib
from types import ModuleType

#: extra -> what it is for (pyproject.toml's optional-dependencies)
EXTRAS = {
    "fetch": "converting the embedded default model (gguf, accelerate)",
    "bench": "benchmark plots (matplotlib)",
    "edge": "the edge runtime's ONNX path on CPUs (onnx, onnxruntime)",
    "edge-gpu": "the edge runtime's ONNX path on NVIDIA GPUs (onnx, onnxruntime-gpu)",
    "npu": "Ascend NPUs (torch-npu matching the torch pin)",
}


class MissingExtraError(ModuleNotFoundError):
    """An optional dependency is not installed; the message says which extra has it."""


def require(module: str, extra: str, purpose: str) -> ModuleType:
    """`module`, imported; MissingExtraError naming `extra` when it is not installed."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name is None or module.split(".")[0] != e.name.split(".")[0]:
            raise  # the module is there but something it needs is broken: say that
        raise MissingExtraError(
            f"{purpose} needs the Python package {e.name!r}, which is not installed: "
            f"pip install 'hetero-pd[{extra}]' ({EXTRAS[extra]})",
            name=e.name,
        ) from e
