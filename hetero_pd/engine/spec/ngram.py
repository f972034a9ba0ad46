"""Prompt lookup (vLLM's `ngram` method): propose what followed the sequence's last n-gram
the last time it occurred in the sequence."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from hetero_pd.engine.spec.config import SpeculativeConfig


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.n_min, self.n_max = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, token_ids: list[int], max_tokens: int) -> list[int]:
        """Up to `min(k, max_tokens)` tokens: for n from n_max down to n_min, the tokens
        after the latest earlier occurrence of the last n tokens; [] when none occurs."""
        k = min(self.k, max_tokens)
        if k <= 0 or len(token_ids) <= self.n_min:
            return []
        seq = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.n_max, len(seq) - 1), self.n_min - 1, -1):
            # Windows that end before the last token: never the suffix itself.
            windows = sliding_window_view(seq[:-1], n)
            hits = np.flatnonzero((windows == seq[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return seq[start : start + k].tolist()
        return []
