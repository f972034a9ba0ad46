"""SpeculativeConfig: vLLM's `speculative_config` (methods `ngram` and `draft_model`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "draft_model")
#: Proposals one step verifies per sequence, at most (acceptance is reported per position).
MAX_SPECULATIVE_TOKENS = 64


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """How a decode step proposes tokens to verify (vLLM's names).

    `ngram` (prompt lookup): the last n tokens of a sequence (n from `prompt_lookup_max`
    down to `prompt_lookup_min`) are looked up earlier in its prompt and output; the up to
    `num_speculative_tokens` tokens that followed their latest match are proposed.

    `draft_model`: `model` (a folder or known name), a smaller model with the target's
    tokenizer, proposes `num_speculative_tokens` tokens greedily (spec/draft.py).
    """

    num_speculative_tokens: int
    method: str = "ngram"
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    model: str | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(
                f"speculative_config.method must be one of {METHODS}, got {self.method!r}"
            )
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError(
                "speculative_config.model names the draft model of method draft_model, and "
                f"only of it: got method {self.method!r} with model {self.model!r}"
            )
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise ValueError(f"speculative_config.model must be a path or name, got {self.model!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(
                    f"speculative_config.{name} must be an integer >= 1, got {value!r}"
                )
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"speculative_config.num_speculative_tokens must be at most "
                f"{MAX_SPECULATIVE_TOKENS}, got {self.num_speculative_tokens}"
            )
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) exceeds "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | None) -> SpeculativeConfig | None:
        """A config from vLLM's `speculative_config` dict (unknown keys rejected by name)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise TypeError(
                f"speculative_config must be a mapping such as {{'method': 'ngram', "
                f"'num_speculative_tokens': 3}}, got {type(value).__name__}"
            )
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ValueError(
                f"unknown speculative_config key(s) {unknown}; allowed: {sorted(names)}"
            )
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config needs num_speculative_tokens")
        return cls(**value)
