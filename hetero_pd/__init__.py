"""hetero-pd: prefill/decode disaggregated LLM serving across heterogeneous hardware.

`LLM`, `SamplingParams` and the output types import lazily, so that light commands
(`hetero-pd fetch-model`, `--help`) do not pay for importing torch and transformers.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import MutableMapping
from typing import TYPE_CHECKING, Any


def omp_wait_defaults(environ: MutableMapping[str, str]) -> None:
    """Idle OpenMP threads spin briefly before they sleep (libgomp: GOMP_SPINCOUNT=30000,
    about 0.5-1.5 ms of `pause`s; LLVM/Intel OpenMP: KMP_BLOCKTIME=1 ms), unless the user
    chose OMP_WAIT_POLICY (or the variable itself).

    Within a step the threads stay awake between parallel regions: sleeping at once
    (PASSIVE) cost 25-35% on an idle 2-vCPU VM, where a halted vCPU is descheduled and its
    wake-up is paid in steal time. Spinning long (libgomp's default, 300000) made the engine
    3.6-8x slower on a busy host; there the engine's ThreadGovernor (backends/cpu_share.py)
    also drops to the threads the host has room for. docs/BENCHMARKS.md section 1 has the
    numbers. OpenMP reads this when torch loads it: set before torch is imported, it holds
    for this process and every process started from it."""
    if "OMP_WAIT_POLICY" not in environ:
        environ.setdefault("GOMP_SPINCOUNT", "30000")
        environ.setdefault("KMP_BLOCKTIME", "1")


omp_wait_defaults(os.environ)

if TYPE_CHECKING:
    from hetero_pd.llm import LLM
    from hetero_pd.outputs import CompletionOutput, RequestOutput
    from hetero_pd.sampling_params import SamplingParams
    from hetero_pd.structured_outputs import StructuredOutputsParams

__version__ = "0.1.0"
__all__ = [
    "LLM",
    "CompletionOutput",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "__version__",
]

_LAZY = {
    "LLM": "hetero_pd.llm",
    "CompletionOutput": "hetero_pd.outputs",
    "RequestOutput": "hetero_pd.outputs",
    "SamplingParams": "hetero_pd.sampling_params",
    "StructuredOutputsParams": "hetero_pd.structured_outputs",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hetero_pd' has no attribute {name!r}")
