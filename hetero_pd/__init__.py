"""hetero-pd: prefill/decode disaggregated LLM serving across heterogeneous hardware."""

__version__ = "0.1.0"
