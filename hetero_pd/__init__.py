"""hetero-pd: prefill/decode disaggregated LLM serving across heterogeneous hardware.

`LLM`, `SamplingParams` and the output types import lazily, so that light commands
(`hetero-pd fetch-model`, `--help`) do not pay for importing torch and transformers.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

# Idle OpenMP threads sleep at once instead of spinning. On a busy host (other processes,
# another worker on the same cores, a Kubernetes CPU limit) a spinning thread holds a core
# the thread it waits for needs: the engine ran 3.6-8x slower that way (docs/BENCHMARKS.md,
# section 1). OpenMP reads this when torch loads it, so it holds for this process when torch
# was not imported yet, and for every process started from it. A value you set is kept.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

if TYPE_CHECKING:
    from hetero_pd.llm import LLM
    from hetero_pd.outputs import CompletionOutput, RequestOutput
    from hetero_pd.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "__version__"]

_LAZY = {
    "LLM": "hetero_pd.llm",
    "CompletionOutput": "hetero_pd.outputs",
    "RequestOutput": "hetero_pd.outputs",
    "SamplingParams": "hetero_pd.sampling_params",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hetero_pd' has no attribute {name!r}")
