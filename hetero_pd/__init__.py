"""hetero-pd: prefill/decode disaggregated LLM serving across heterogeneous hardware.

`LLM`, `SamplingParams` and the output types import lazily, so that light commands
(`hetero-pd fetch-model`, `--help`) do not pay for importing torch and transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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
